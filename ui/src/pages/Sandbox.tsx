// One sandbox: its record (spec, labels, limits, policy and phases), audit
// refusals, resource use over the last hour (CPU, memory, tasks: the node's
// readings from GET …/stats, polled every 5 s, whose last reading is taken at
// the call; OOM kills and pids-limit hits from the record's `stats`, sampled
// while the page is open), stop/pause/resume, and the terminal, files and
// ports tabs. Tabs once shown stay mounted (hidden), so the terminal keeps
// its screen and its stream while another tab is looked at.
import { useEffect, useRef, useState } from "preact/hooks";
import {
  getAudit,
  getSandbox,
  getStats,
  pauseSandbox,
  resumeSandbox,
  stopSandbox,
  type Audit,
  type Sandbox as SandboxT,
} from "../api";
import { Chart, color } from "../components/Chart";
import { ErrorBox, KV, Labels, Loading, Mono, Section, StateBadge, Tabs } from "../components/common";
import { Files } from "../components/Files";
import { Ports } from "../components/Ports";
import { Terminal } from "../components/Terminal";
import { ago, bytes, dateTime, duration, num, shortDigest } from "../format";
import { href, replaceQuery, useAction, usePoll, type Route } from "../hooks";

const TABS: [string, string][] = [
  ["overview", "Overview"],
  ["terminal", "Terminal"],
  ["files", "Files"],
  ["ports", "Ports"],
];
const SAMPLE_MS = 5000;
const KEEP = 720; // an hour of samples
const WINDOW_S = 3600;

// The record's event counters, sampled while the page is open.
interface Samples {
  t: number[];
  oom: (number | null)[];
  pidsHits: (number | null)[];
}

// The node's readings as charted: every reading seen while the page is open,
// by time (each poll's last one is taken at the call, so they add up between
// the node's own), the last hour.
export interface History {
  t: number[];
  cpu: (number | null)[];
  mem: (number | null)[];
  pids: (number | null)[];
  intervalS: number;
  cpuLimit: number;
  memLimit: number;
  pidsLimit: number;
}
type Reading = { cpu: number | null; mem: number; pids: number };

export function Sandbox({ route }: { route: Route }) {
  const id = route.parts[1];
  const tab = TABS.some(([t]) => t === route.parts[2]) ? route.parts[2] : "overview";
  const sb = usePoll((signal) => getSandbox(id, signal), SAMPLE_MS, [id]);
  const running = sb.data?.state === "running";
  const audit = usePoll(
    (signal) => (running ? getAudit(id, signal) : Promise.resolve(null)),
    15000,
    [id, running],
  );
  const action = useAction();
  const [seen, setSeen] = useState<Set<string>>(new Set([tab]));
  useEffect(() => setSeen((s) => (s.has(tab) ? s : new Set([...s, tab]))), [tab]);

  // Event counters over the time the page is open.
  const samples = useRef<Samples>({ t: [], oom: [], pidsHits: [] });
  const [, bump] = useState(0);
  useEffect(() => {
    samples.current = { t: [], oom: [], pidsHits: [] };
  }, [id]);
  useEffect(() => {
    const d = sb.data;
    if (!d || !sb.at) return;
    const s = samples.current;
    const st = d.stats;
    s.t = [...s.t, sb.at / 1000].slice(-KEEP);
    s.oom = [...s.oom, st?.oom_kills ?? null].slice(-KEEP);
    s.pidsHits = [...s.pidsHits, st?.pids_limit_hits ?? null].slice(-KEEP);
    bump((x) => x + 1);
  }, [sb.at]);

  // CPU, memory and tasks: the node's last hour, merged by time.
  const stats = usePoll((signal) => getStats(id, WINDOW_S, signal), SAMPLE_MS, [id]);
  const readings = useRef<Map<number, Reading>>(new Map());
  const [history, setHistory] = useState<History | null>(null);
  useEffect(() => {
    readings.current = new Map();
    setHistory(null);
  }, [id]);
  useEffect(() => {
    const h = stats.data;
    if (!h) return;
    const m = readings.current;
    h.t.forEach((t, i) => m.set(t, { cpu: h.cpu[i], mem: h.memory_bytes[i], pids: h.pids[i] }));
    const from = Date.now() / 1000 - WINDOW_S;
    for (const t of [...m.keys()]) if (t < from) m.delete(t);
    const ts = [...m.keys()].sort((a, b) => a - b);
    setHistory({
      t: ts,
      cpu: ts.map((t) => m.get(t)!.cpu),
      mem: ts.map((t) => m.get(t)!.mem),
      pids: ts.map((t) => m.get(t)!.pids),
      intervalS: h.interval_s,
      cpuLimit: h.cpu_limit,
      memLimit: h.memory_limit_bytes,
      pidsLimit: h.pids_limit,
    });
  }, [stats.at]);

  const doAction = (what: string, fn: () => Promise<SandboxT>) =>
    action.run(async () => {
      if (what === "stop" && !confirm(`Stop sandbox ${id}? Its processes are killed and its files removed.`)) return;
      await fn();
      sb.refresh();
    });

  const d = sb.data;
  const s = samples.current;
  return (
    <div class="page">
      <div class="page-head">
        <a href={href(["sandboxes"])} class="muted">
          Sandboxes
        </a>
        <span class="muted">/</span>
        <h1 class="mono" data-testid="sb-id">
          {id}
        </h1>
        {d ? <StateBadge state={d.state} /> : null}
        <span class="spacer" />
        {d && d.state === "running" ? (
          <button class="btn" disabled={action.busy} onClick={() => doAction("pause", () => pauseSandbox(id))} data-testid="sb-pause">
            Pause
          </button>
        ) : null}
        {d && d.state === "paused" ? (
          <button class="btn" disabled={action.busy} onClick={() => doAction("resume", () => resumeSandbox(id))} data-testid="sb-resume">
            Resume
          </button>
        ) : null}
        {d && !["stopped", "failed", "stopping"].includes(d.state) ? (
          <button class="btn danger" disabled={action.busy} onClick={() => doAction("stop", () => stopSandbox(id))} data-testid="sb-stop">
            Stop
          </button>
        ) : null}
      </div>
      <ErrorBox error={action.error} />
      <ErrorBox error={sb.error} what={"sandbox " + id} />
      {sb.loading && !d ? <Loading what="the sandbox" /> : null}
      {d?.error ? <div class="error">{d.error}</div> : null}
      <Tabs tabs={TABS} active={tab} hrefOf={(t) => href(["sandboxes", id, ...(t === "overview" ? [] : [t])])} />
      {d ? (
        <div class="tab-body">
          <div hidden={tab !== "overview"}>
            <Overview
              d={d}
              audit={audit.data ?? null}
              auditError={audit.error}
              s={s}
              h={history}
              statsError={stats.error}
            />
          </div>
          {seen.has("terminal") ? (
            <div hidden={tab !== "terminal"}>
              <Terminal sandboxId={id} active={tab === "terminal"} running={running} />
            </div>
          ) : null}
          {seen.has("files") ? (
            <div hidden={tab !== "files"}>
              {running || d.state === "paused" ? (
                <Files
                  sandboxId={id}
                  path={route.query.get("path") || "/"}
                  onPath={(p) => replaceQuery(["sandboxes", id, "files"], { path: p })}
                />
              ) : (
                <div class="notice">The sandbox is {d.state}: its files are gone or unreachable.</div>
              )}
            </div>
          ) : null}
          {seen.has("ports") ? (
            <div hidden={tab !== "ports"}>
              <Ports sandboxId={id} running={running} />
            </div>
          ) : null}
        </div>
      ) : null}
    </div>
  );
}

function Overview({
  d,
  audit,
  auditError,
  s,
  h,
  statsError,
}: {
  d: SandboxT;
  audit: Audit | null;
  auditError?: Error;
  s: Samples;
  h: History | null;
  statsError?: Error;
}) {
  const limitBytes = (d.memory_mb || 0) * 1024 * 1024;
  return (
    <div class="grid2">
      <Section title="Spec" testid="sb-spec">
        <KV
          rows={[
            ["image", <Mono>{d.image}</Mono>],
            ["backend", d.backend],
            ["workspaces", (d.workspaces || []).join(", ")],
            ["toolkits", (d.toolkits || []).join(", ")],
            ["diffs", (d.diffs || []).map(shortDigest).join(", ")],
            ["layers", <span title={(d.layers || []).join("\n")}>{(d.layers || []).map(shortDigest).join(" ")}</span>],
            ["tenant", d.owner],
            ["node / pool", `${d.node || "–"} / ${d.pool || "–"}${d.burstable ? " (burstable)" : ""}`],
            ["batch", d.batch || ""],
            ["created", `${dateTime(d.created_at)} (${ago(d.created_at)})`],
            d.state === "stopped" || d.state === "failed"
              ? ["stopped", d.stopped_at ? `${dateTime(d.stopped_at)} (${ago(d.stopped_at)})` : d.state]
              : ["expires", d.expires_at ? `${dateTime(d.expires_at)} (${ago(d.expires_at)})` : "never"],
            ["user / working dir", `${d.user || "(image's)"} / ${d.working_dir || "(image's)"}`],
            [
              "env",
              Object.keys(d.env || {}).length ? (
                <pre class="env">{Object.entries(d.env || {}).map(([k, v]) => `${k}=${v}`).join("\n")}</pre>
              ) : (
                ""
              ),
            ],
            ["labels", <Labels labels={d.labels} />],
          ]}
        />
      </Section>
      <Section title="Limits">
        <KV
          rows={[
            ["cpu", d.cpu !== undefined ? d.cpu + " cores" : ""],
            ["memory", d.memory_mb !== undefined ? bytes(limitBytes) : ""],
            ["disk", d.disk_mb !== undefined ? bytes(d.disk_mb * 1024 * 1024) : ""],
            ["pids", d.pids],
            ["ttl", d.ttl_s ? duration(d.ttl_s) : "none"],
            ["idle timeout", d.idle_timeout_s ? duration(d.idle_timeout_s) : "none"],
            ["auto pause", d.auto_pause_s ? duration(d.auto_pause_s) : "none"],
            ["paused to", d.pause_memory || ""],
          ]}
        />
      </Section>
      <Section title="Policy and phases" testid="sb-policy">
        <KV
          rows={[
            ["policy", <strong>{d.policy}</strong>],
            ["read-only paths", (d.readonly_paths || []).join(", ")],
            ["hidden paths", (d.hidden_paths || []).join(", ")],
          ]}
        />
        {d.phases && d.phases.length ? (
          <table class="grid compact">
            <thead>
              <tr>
                <th>phase</th>
                <th>since</th>
              </tr>
            </thead>
            <tbody>
              {d.phases.map((p) => (
                <tr>
                  <td>{p.policy}</td>
                  <td>{dateTime(p.at)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        ) : null}
      </Section>
      <Section title="Audit: refusals" testid="sb-audit">
        {d.state !== "running" ? <div class="muted">Only a running sandbox reports its audit.</div> : null}
        <ErrorBox error={auditError} what="audit" />
        {audit ? (
          <>
            <KV
              rows={[
                ["syscalls refused", audit.denied_total ?? 0],
                ["egress refused", audit.egress_denied ?? 0],
                ["last egress refused", audit.egress_last_denied || ""],
              ]}
            />
            {Object.keys(audit.denied_syscalls || {}).length ? (
              <table class="grid compact">
                <thead>
                  <tr>
                    <th>syscall</th>
                    <th class="num">refused</th>
                  </tr>
                </thead>
                <tbody>
                  {Object.entries(audit.denied_syscalls || {})
                    .sort((a, b) => b[1] - a[1])
                    .map(([k, v]) => (
                      <tr>
                        <td class="mono">{k}</td>
                        <td class="num">{v}</td>
                      </tr>
                    ))}
                </tbody>
              </table>
            ) : null}
          </>
        ) : null}
      </Section>
      <Section title="Resource use (last hour)" testid="sb-stats">
        {d.stats ? (
          <KV
            rows={[
              ["memory", d.stats.memory_bytes !== undefined ? `${bytes(d.stats.memory_bytes)} of ${bytes(limitBytes)}` : ""],
              ["cpu time", d.stats.cpu_usec !== undefined ? duration(d.stats.cpu_usec / 1e6) : ""],
              ["tasks", d.stats.pids !== undefined ? `${d.stats.pids} of ${d.pids ?? "–"}` : ""],
              ["OOM kills", d.stats.oom_kills ?? 0],
              ["pids limit hits", d.stats.pids_limit_hits ?? 0],
            ]}
          />
        ) : (
          <div class="muted">No figures: the sandbox is not running.</div>
        )}
        <ErrorBox error={statsError} what="resource history" />
        {h ? (
          <div class="muted small" data-testid="stats-interval">
            {h.intervalS > 0
              ? `Sampled by the node every ${num(h.intervalS)} s (kept an hour); the newest reading is taken when the page polls.`
              : "This node keeps no history: readings are taken while the page is open."}
          </div>
        ) : null}
        <ResourceCharts h={h} />
        <Chart
          title="OOM kills, pids limit hits (cumulative)"
          testid="chart-events"
          times={s.t}
          series={[
            { label: "OOM kills", color: color(1) },
            { label: "pids limit hits", color: color(3) },
          ]}
          values={[s.oom, s.pidsHits]}
          height={120}
        />
      </Section>
    </div>
  );
}

const cores = (v: number) => num(v, 2);

// CPU (cores used), memory and tasks, their limits in the titles (a line at
// the limit would flatten what a mostly idle sandbox uses).
function ResourceCharts({ h }: { h: History | null }) {
  const t = h?.t ?? [];
  const limit = (v: number | undefined, fmt: (x: number) => string) =>
    h ? (v && v > 0 ? ` (limit ${fmt(v)})` : " (no limit)") : "";
  return (
    <>
      <Chart
        title={"cpu, cores" + limit(h?.cpuLimit, cores)}
        testid="chart-cpu"
        times={t}
        series={[{ label: "cpu", color: color(0), fmt: cores }]}
        values={[h?.cpu ?? []]}
        yFmt={cores}
      />
      <Chart
        title={"memory" + limit(h?.memLimit, bytes)}
        testid="chart-memory"
        times={t}
        series={[{ label: "memory", color: color(2), fmt: bytes }]}
        values={[h?.mem ?? []]}
        yFmt={bytes}
      />
      <Chart
        title={"tasks" + limit(h?.pidsLimit, String)}
        testid="chart-pids"
        times={t}
        series={[{ label: "tasks", color: color(4) }]}
        values={[h?.pids ?? []]}
        height={120}
      />
    </>
  );
}
