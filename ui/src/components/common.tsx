// Small shared pieces. Everything shown is a text node or an attribute set
// by Preact: labels, names and outputs are escaped by construction.
import type { ComponentChildren } from "preact";
import { ApiError } from "../api";

export function ErrorBox({ error, what }: { error: Error | undefined | null; what?: string }) {
  if (!error) return null;
  if (error instanceof ApiError && error.status === 403) {
    return (
      <div class="notice admin-only" data-testid="admin-only">
        <strong>Admin only.</strong> {what ? what + ": " : ""}
        {error.message}
      </div>
    );
  }
  const e = error as ApiError;
  return (
    <div class="error" role="alert" data-testid="error">
      {what ? <strong>{what}: </strong> : null}
      {e.status ? <span class="code">{e.status + " " + e.code}</span> : null}
      {e.message}
      {e.field ? <span class="field"> (field {e.field})</span> : null}
    </div>
  );
}

export function Loading({ what }: { what?: string }) {
  return <div class="muted loading">Loading{what ? " " + what : ""}…</div>;
}

export function StateBadge({ state }: { state: string }) {
  return <span class={"badge state-" + state.replace(/[^a-z]/g, "")}>{state}</span>;
}

export function Labels({ labels, onPick }: { labels?: Record<string, string>; onPick?: (kv: string) => void }) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return <span class="muted">–</span>;
  return (
    <span class="labels">
      {entries.map(([k, v]) => (
        <span
          class={"label" + (onPick ? " clickable" : "")}
          title={onPick ? "filter by " + k + "=" + v : k + "=" + v}
          onClick={onPick ? (e) => (e.preventDefault(), e.stopPropagation(), onPick(k + "=" + v)) : undefined}
        >
          <span class="k">{k}</span>=<span class="v">{v}</span>
        </span>
      ))}
    </span>
  );
}

export type KVRow = [string, ComponentChildren];

export function KV({ rows, testid }: { rows: KVRow[]; testid?: string }) {
  return (
    <table class="kv" data-testid={testid}>
      <tbody>
        {rows.map(([k, v]) => (
          <tr>
            <th>{k}</th>
            <td>{v === undefined || v === null || v === "" ? <span class="muted">–</span> : v}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

export function Section({ title, children, extra, testid }: { title: string; children: ComponentChildren; extra?: ComponentChildren; testid?: string }) {
  return (
    <section class="card" data-testid={testid}>
      <header>
        <h2>{title}</h2>
        {extra ? <div class="extra">{extra}</div> : null}
      </header>
      <div class="body">{children}</div>
    </section>
  );
}

export function Tabs({ tabs, active, hrefOf }: { tabs: [string, string][]; active: string; hrefOf: (id: string) => string }) {
  return (
    <nav class="tabs">
      {tabs.map(([id, title]) => (
        <a href={hrefOf(id)} class={id === active ? "active" : ""} data-testid={"tab-" + id}>
          {title}
        </a>
      ))}
    </nav>
  );
}

export function Mono({ children, title }: { children: ComponentChildren; title?: string }) {
  return (
    <code class="mono" title={title}>
      {children}
    </code>
  );
}

export function JsonBlock({ value }: { value: unknown }) {
  return <pre class="json">{JSON.stringify(value, null, 2)}</pre>;
}

// A horizontal bar: used / total.
export function Bar({ used, total, label }: { used: number; total: number; label?: string }) {
  const pct = total > 0 ? Math.min(100, (used / total) * 100) : 0;
  const cls = pct >= 90 ? "hot" : pct >= 70 ? "warm" : "";
  return (
    <div class="bar" title={label ?? `${used} / ${total}`}>
      <div class={"fill " + cls} style={{ width: pct.toFixed(1) + "%" }} />
      <span class="bar-text">{label ?? `${Math.round(pct)}%`}</span>
    </div>
  );
}
