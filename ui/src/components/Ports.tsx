// Exposed ports of a sandbox (docs/plans/issue-34.md §1): expose, list with
// links, unexpose. The links open in a new tab with no opener and no
// referrer: what a sandbox serves is untrusted, and lives on its own origin
// (host form) or in a CSP sandbox (path form), never the console's.
import { useState } from "preact/hooks";
import { ApiError, exposePort, listPorts, unexposePort, type Exposure } from "../api";
import { dateTime, safeHref } from "../format";
import { usePoll } from "../hooks";
import { ErrorBox, Loading } from "./common";

// The URL as shown: without its token (the link carries it).
function shown(url: string | undefined): string {
  return (url || "").replace(/[?&]dsec_token=[^&#]*/, "");
}

function copy(text: string) {
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).catch(() => prompt("Token:", text));
  else prompt("Token:", text);
}

// The link to open: the URL with its token as ?dsec_token= unless it has one.
function withToken(url: string | undefined, token: string | undefined): string | undefined {
  if (!url) return undefined;
  if (!token || url.includes("dsec_token=")) return safeHref(url);
  return safeHref(url + (url.includes("?") ? "&" : "?") + "dsec_token=" + encodeURIComponent(token));
}

export function Ports({ sandboxId, running }: { sandboxId: string; running: boolean }) {
  const ports = usePoll((signal) => listPorts(sandboxId, signal), 5000, [sandboxId]);
  const [port, setPort] = useState("");
  const [ttl, setTtl] = useState("");
  const [error, setError] = useState<Error | undefined>();
  const [made, setMade] = useState<Record<number, Exposure>>({});
  const missing = ports.error instanceof ApiError && ports.error.status === 404 && /no such endpoint/i.test(ports.error.message);

  const expose = async (e: Event, p?: number, rotate = false) => {
    e.preventDefault();
    setError(undefined);
    const n = p ?? Number(port);
    if (!Number.isInteger(n) || n < 1 || n > 65535) {
      setError(new Error("a port is a number from 1 to 65535"));
      return;
    }
    try {
      const x = await exposePort(sandboxId, n, ttl ? Number(ttl) : undefined, rotate);
      setMade((m) => ({ ...m, [x.port]: x }));
      setPort("");
      ports.refresh();
    } catch (err) {
      setError(err as Error);
    }
  };

  const unexpose = async (p: number) => {
    if (!confirm(`Unexpose port ${p}? Open connections through it are cut.`)) return;
    try {
      await unexposePort(sandboxId, p);
      setMade((m) => {
        const c = { ...m };
        delete c[p];
        return c;
      });
      ports.refresh();
    } catch (err) {
      setError(err as Error);
    }
  };

  // The list may hold no tokens; what this page exposed does.
  const rows: Exposure[] = (ports.data || []).map((x) => ({ ...made[x.port], ...x, token: x.token ?? made[x.port]?.token }));
  for (const x of Object.values(made)) if (!rows.some((r) => r.port === x.port)) rows.push(x);

  return (
    <div class="ports" data-testid="ports">
      {missing ? (
        <div class="notice">This platform has no exposed ports yet (the API answered: {ports.error!.message}).</div>
      ) : (
        <ErrorBox error={ports.error} what="ports" />
      )}
      <form class="inline" onSubmit={(e) => expose(e)}>
        <input
          type="number"
          min={1}
          max={65535}
          placeholder="port, e.g. 8000"
          value={port}
          onInput={(e) => setPort((e.target as HTMLInputElement).value)}
          data-testid="port-input"
        />
        <input
          type="number"
          min={1}
          placeholder="ttl s (optional)"
          value={ttl}
          onInput={(e) => setTtl((e.target as HTMLInputElement).value)}
        />
        <button class="btn small primary" type="submit" disabled={!running} data-testid="port-expose">
          Expose
        </button>
      </form>
      <ErrorBox error={error} what="expose" />
      {ports.loading && !ports.data && !ports.error ? <Loading /> : null}
      {rows.length ? (
        <table class="grid">
          <thead>
            <tr>
              <th class="num">port</th>
              <th>browser URL</th>
              <th>path URL (programs)</th>
              <th>expires</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {rows.map((x) => {
              const link = withToken(x.url, x.token);
              return (
                <tr data-testid={"port-row-" + x.port}>
                  <td class="num">{x.port}</td>
                  <td>
                    {link ? (
                      <a href={link} target="_blank" rel="noopener noreferrer" data-testid={"port-link-" + x.port}>
                        {shown(x.url)}
                      </a>
                    ) : (
                      <span class="muted">{shown(x.url) || "–"}</span>
                    )}
                  </td>
                  <td class="mono small">{x.path_url || "–"}</td>
                  <td>{x.expires_at ? dateTime(x.expires_at) : "never"}</td>
                  <td class="actions">
                    {x.token ? (
                      <button class="btn tiny" title="copy the URL token (programs send it as Authorization: Bearer)" onClick={() => copy(x.token!)}>
                        copy token
                      </button>
                    ) : null}
                    <button class="btn tiny" title="new token; the old one stops working" onClick={(e) => expose(e, x.port, true)}>
                      rotate
                    </button>
                    <button class="btn tiny danger" onClick={() => unexpose(x.port)} data-testid={"port-unexpose-" + x.port}>
                      unexpose
                    </button>
                  </td>
                </tr>
              );
            })}
          </tbody>
        </table>
      ) : ports.data ? (
        <div class="muted">No port is exposed.</div>
      ) : null}
      {Object.values(made).some((x) => x.token) ? (
        <p class="muted small">
          Programs send the token as <code>Authorization: Bearer …</code> or <code>Dsec-Port-Token</code> to the path URL.
        </p>
      ) : null}
    </div>
  );
}
