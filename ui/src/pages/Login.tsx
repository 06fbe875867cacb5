// The login page: an API key, checked with GET /v1/whoami, kept in this
// tab's sessionStorage (gone when the tab closes; never a cookie).
import { useState } from "preact/hooks";
import { ApiError, whoami, type WhoAmI } from "../api";

export function Login({ onLogin, message }: { onLogin: (key: string, who: WhoAmI) => void; message?: string }) {
  const [key, setKey] = useState("");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(message || "");

  const submit = async (e: Event) => {
    e.preventDefault();
    const k = key.trim();
    if (!k) {
      setError("Enter an API key.");
      return;
    }
    setBusy(true);
    setError("");
    try {
      const who = await whoami(k);
      onLogin(k, who);
    } catch (err) {
      const a = err as ApiError;
      setError(a.status === 401 ? "That key is not valid: " + a.message : a.message);
    } finally {
      setBusy(false);
    }
  };

  return (
    <div class="login">
      <form class="card login-card" onSubmit={submit}>
        <h1>
          <span class="logo">dsec</span> console
        </h1>
        <p class="muted">
          Sign in with an API key: the platform's token (<code>&lt;data-dir&gt;/token</code>) or a tenant's key
          (<code>dsec key create TENANT</code>).
        </p>
        <label for="key">API key</label>
        <input
          id="key"
          type="password"
          autocomplete="off"
          spellcheck={false}
          value={key}
          onInput={(e) => setKey((e.target as HTMLInputElement).value)}
          data-testid="login-key"
          autoFocus
        />
        <button class="btn primary" type="submit" disabled={busy} data-testid="login-submit">
          {busy ? "Checking…" : "Sign in"}
        </button>
        {error ? (
          <div class="error" role="alert" data-testid="login-error">
            {error}
          </div>
        ) : null}
        <p class="muted small">The key stays in this tab only (sessionStorage) and is sent as a bearer token.</p>
      </form>
    </div>
  );
}
