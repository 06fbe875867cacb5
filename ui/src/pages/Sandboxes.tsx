// The sandboxes: the newest 500 from GET /v1/sandboxes?sort=-created&limit=500
// polled every 2 s (no reload), with the total that match; filtered by
// labels (server side, ?label=k=v), state chips (server side when one is
// picked), tenant (admins; client side) and a text search (client side, over
// the rows fetched). The filters live in the URL, so a filtered view can be
// shared.
import { useEffect, useState } from "preact/hooks";
import { listSandboxes, type Sandbox, type WhoAmI } from "../api";
import { ErrorBox, Labels, Loading, StateBadge } from "../components/common";
import { ago, dateTime } from "../format";
import { href, replaceQuery, usePoll, type Route } from "../hooks";

export const STATES = ["creating", "running", "paused", "lost", "stopping", "stopped", "failed"];
const MAX_ROWS = 500;

export function Sandboxes({ route, who }: { route: Route; who: WhoAmI }) {
  const labels = route.query.getAll("label");
  const states = route.query.getAll("state");
  const tenant = route.query.get("tenant") || "";
  const text = route.query.get("q") || "";
  const [labelText, setLabelText] = useState(labels.join(" "));
  const [search, setSearch] = useState(text);
  useEffect(() => setLabelText(labels.join(" ")), [labels.join(" ")]);

  const setQuery = (o: { label?: string[]; state?: string[]; tenant?: string; q?: string }) =>
    replaceQuery(["sandboxes"], {
      label: o.label ?? labels,
      state: o.state ?? states,
      tenant: o.tenant ?? tenant,
      q: o.q ?? text,
    });

  const serverState = states.length === 1 ? states[0] : null;
  const list = usePoll((signal) => listSandboxes(labels, serverState, signal, MAX_ROWS), 2000, [
    labels.join("\u0000"),
    serverState,
  ]);

  const all = list.data?.sandboxes || [];
  // What the server counted before its limit (an older platform: what came).
  const total = list.data?.total ?? all.length;
  const clientFiltered = states.length > 1 || !!tenant || !!text;
  const tenants = Array.from(new Set(all.map((s) => s.owner || ""))).filter(Boolean).sort();
  const needle = text.toLowerCase();
  const shown = all
    .filter((s) => !states.length || states.includes(s.state))
    .filter((s) => !tenant || s.owner === tenant)
    .filter(
      (s) =>
        !needle ||
        s.id.toLowerCase().includes(needle) ||
        s.image.toLowerCase().includes(needle) ||
        (s.node || "").toLowerCase().includes(needle),
    )
    .sort((a, b) => (b.created_at || "").localeCompare(a.created_at || "") || a.id.localeCompare(b.id));
  const counts: Record<string, number> = {};
  for (const s of all) counts[s.state] = (counts[s.state] || 0) + 1;

  const applyLabels = (e?: Event) => {
    e?.preventDefault();
    // Unchanged text (the box left after a label was picked by a click) keeps
    // the labels as they are: a value with a space or a comma would not
    // survive the split below.
    if (labelText === labels.join(" ")) return;
    const ls = labelText.split(/[\s,]+/).filter(Boolean);
    setQuery({ label: ls, q: search });
  };
  const addLabel = (kv: string) => {
    if (!labels.includes(kv)) setQuery({ label: [...labels, kv] });
  };
  const toggleState = (st: string) =>
    setQuery({ state: states.includes(st) ? states.filter((x) => x !== st) : [...states, st] });

  return (
    <div class="page">
      <div class="page-head">
        <h1>Sandboxes</h1>
        <span class={"live " + (list.error ? "down" : "")} title={list.at ? "updated " + dateTime(list.at) : ""}>
          {list.error ? "not updating" : "live"}
        </span>
        <span class="muted" data-testid="sb-count" title={clientFiltered ? `${shown.length} of the ${all.length} newest shown` : ""}>
          {list.data ? `${clientFiltered ? shown.length : all.length} of ${total}` : ""}
        </span>
      </div>
      <form class="filters" onSubmit={applyLabels}>
        <input
          class="grow"
          placeholder="labels: k=v k2=v2 (all must match)"
          value={labelText}
          onInput={(e) => setLabelText((e.target as HTMLInputElement).value)}
          onBlur={() => applyLabels()}
          data-testid="filter-labels"
        />
        <input
          placeholder="search id, image, node"
          value={search}
          onInput={(e) => {
            const v = (e.target as HTMLInputElement).value;
            setSearch(v);
            setQuery({ q: v });
          }}
          data-testid="filter-search"
        />
        {who.role === "admin" ? (
          <select value={tenant} onChange={(e) => setQuery({ tenant: (e.target as HTMLSelectElement).value })} data-testid="filter-tenant">
            <option value="">all tenants</option>
            {tenants.map((t) => (
              <option value={t}>{t}</option>
            ))}
          </select>
        ) : null}
        <button class="btn small" type="submit">
          Apply
        </button>
      </form>
      <div class="chips">
        {STATES.map((st) => (
          <button
            class={"chip state-" + st + (states.includes(st) ? " on" : "")}
            onClick={() => toggleState(st)}
            data-testid={"chip-" + st}
            type="button"
          >
            {st}
            {counts[st] ? <span class="count">{counts[st]}</span> : null}
          </button>
        ))}
        {labels.length || states.length || tenant || text ? (
          <button class="chip clear" type="button" onClick={() => replaceQuery(["sandboxes"], {})}>
            clear filters
          </button>
        ) : null}
      </div>
      <ErrorBox error={list.error} what="list sandboxes" />
      {list.loading && !list.data ? <Loading what="sandboxes" /> : null}
      {list.data ? (
        <table class="grid" data-testid="sb-table">
          <thead>
            <tr>
              <th>id</th>
              <th>image</th>
              <th>backend</th>
              <th>state</th>
              <th>labels</th>
              <th>tenant</th>
              <th>node</th>
              <th>created</th>
            </tr>
          </thead>
          <tbody>
            {shown.slice(0, MAX_ROWS).map((s: Sandbox) => (
              <tr data-testid={"sb-row-" + s.id} class={"state-row-" + s.state}>
                <td>
                  <a href={href(["sandboxes", s.id])} class="mono">
                    {s.id}
                  </a>
                </td>
                <td class="mono">{s.image}</td>
                <td>{s.backend}</td>
                <td>
                  <StateBadge state={s.state} />
                  {s.error ? (
                    <span class="muted small" title={s.error}>
                      {" "}
                      {s.error.length > 40 ? s.error.slice(0, 40) + "…" : s.error}
                    </span>
                  ) : null}
                </td>
                <td>
                  <Labels labels={s.labels} onPick={addLabel} />
                </td>
                <td>{s.owner || "–"}</td>
                <td>{s.node || "–"}</td>
                <td title={dateTime(s.created_at)}>{ago(s.created_at)}</td>
              </tr>
            ))}
            {shown.length === 0 ? (
              <tr>
                <td colSpan={8} class="muted">
                  No sandbox matches.
                </td>
              </tr>
            ) : null}
          </tbody>
        </table>
      ) : null}
      {total > all.length ? (
        <div class="notice" data-testid="sb-truncated">
          Showing the newest {all.length} of {total}: narrow the label or state filter to see others
          {clientFiltered ? " (the tenant and text filters look only at these)" : ""}.
        </div>
      ) : null}
    </div>
  );
}
