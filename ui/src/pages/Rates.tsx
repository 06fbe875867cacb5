// The cluster's rates over the last hour (admins): creates/s, calls in
// flight, errors, sandboxes, refusals, from rates.ts (the platform's history
// when it has one, else samples this tab takes of /v1/metrics).
import { ApiError } from "../api";
import { Chart, color } from "../components/Chart";
import { ErrorBox, Loading } from "../components/common";
import { num } from "../format";
import { usePoll } from "../hooks";
import { fetchRates } from "../rates";

const f2 = (v: number) => num(v, 2);

export function Rates() {
  const rates = usePoll((signal) => fetchRates(signal), 10000, []);
  const r = rates.data;
  if (rates.error instanceof ApiError && rates.error.status === 403) {
    return (
      <div class="page">
        <h1>Cluster rates</h1>
        <ErrorBox error={rates.error} what="metrics" />
      </div>
    );
  }
  const s = r?.series || {};
  const charts: { title: string; id: string; keys: [string, string][]; fmt?: (v: number) => string }[] = [
    { title: "Creates per second", id: "chart-creates", keys: [["creates_per_s", "creates/s"]], fmt: f2 },
    {
      title: "In flight",
      id: "chart-inflight",
      keys: [
        ["calls_in_flight", "calls on sandboxes (execs, sessions, files)"],
        ["http_requests_in_flight", "HTTP requests"],
        ["blocking_busy", "busy workers"],
        ["blocking_queued", "queued work"],
      ],
    },
    {
      title: "Errors per second",
      id: "chart-errors",
      keys: [
        ["api_errors_per_s", "API errors/s"],
        ["create_errors_per_s", "create errors/s"],
      ],
      fmt: f2,
    },
    {
      title: "Sandboxes",
      id: "chart-sandboxes",
      keys: [
        ["sandboxes.running", "running"],
        ["sandboxes.paused", "paused"],
        ["sandboxes.creating", "creating"],
      ],
    },
    {
      title: "Policy refusals per second",
      id: "chart-refusals",
      keys: [
        ["syscalls_denied_per_s", "syscalls refused/s"],
        ["egress_denied_per_s", "egress refused/s"],
      ],
      fmt: f2,
    },
    {
      title: "Nodes up, exposed-port connections",
      id: "chart-nodes",
      keys: [
        ["nodes_up", "nodes up"],
        ["port_connections", "port connections"],
      ],
    },
  ];
  return (
    <div class="page">
      <div class="page-head">
        <h1>Cluster rates</h1>
        <span class="muted small" data-testid="rates-source">
          {r
            ? r.source === "history"
              ? "the platform's last hour"
              : `sampled by this tab every ${r.intervalS} s since the console opened (the platform keeps no history)`
            : ""}
        </span>
      </div>
      <ErrorBox error={rates.error} what="rates" />
      {rates.loading && !r ? <Loading /> : null}
      {r ? (
        <div class="charts">
          {charts.map((c) => (
            <div class="card">
              <Chart
                title={c.title}
                testid={c.id}
                times={r.t}
                series={c.keys.map(([, label], i) => ({ label, color: color(i), fmt: c.fmt }))}
                values={c.keys.map(([k]) => s[k] || r.t.map(() => null))}
                yFmt={c.fmt}
              />
            </div>
          ))}
        </div>
      ) : null}
    </div>
  );
}
