// Nodes and pools (admins): /v1/nodes grouped by pool, with each pool's
// utilization and bursts and the burst policy (its `pools` and `burst`: the
// figures the scheduler compares). Fields the console does not know are
// shown too.
import { ApiError, listNodes, type Node, type PoolInfo } from "../api";
import { Bar, ErrorBox, Loading, Section } from "../components/common";
import { duration, num } from "../format";
import { usePoll } from "../hooks";

const KNOWN = new Set([
  "name",
  "pool",
  "state",
  "local",
  "url",
  "capacity",
  "allocated",
  "inflight",
  "reported_sandboxes",
  "layers",
  "loadavg_1m",
  "last_heartbeat_age_s",
]);

function extra(n: Node): string {
  return Object.entries(n)
    .filter(([k]) => !KNOWN.has(k))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : String(v)}`)
    .join(" ");
}

export function Nodes() {
  const nodes = usePoll((signal) => listNodes(signal), 5000, []);
  if (nodes.error instanceof ApiError && nodes.error.status === 403) {
    return (
      <div class="page">
        <h1>Nodes and pools</h1>
        <ErrorBox error={nodes.error} what="nodes" />
      </div>
    );
  }
  const byPool = new Map<string, Node[]>();
  for (const n of nodes.data?.nodes || []) {
    if (!byPool.has(n.pool)) byPool.set(n.pool, []);
    byPool.get(n.pool)!.push(n);
  }
  const pools = new Map<string, PoolInfo>((nodes.data?.pools || []).map((p) => [p.name, p]));
  const burst = nodes.data?.burst;
  const threshold = burst?.threshold ?? null;
  const pct = (u: number) => Math.round(u * 100) + "%";

  return (
    <div class="page">
      <div class="page-head">
        <h1>Nodes and pools</h1>
        <span class="muted">{nodes.data ? `${nodes.data.nodes.length} nodes, ${byPool.size} pools` : ""}</span>
        <span class="spacer" />
        {burst ? (
          <span class="muted" data-testid="burst-policy">
            {burst.pool
              ? `bursting: burstable sandboxes go to pool ${burst.pool} when their pool is at ${pct(burst.threshold)} or more`
              : "bursting off"}
          </span>
        ) : null}
      </div>
      <ErrorBox error={nodes.error} what="nodes" />
      {nodes.loading && !nodes.data ? <Loading /> : null}
      {Array.from(byPool.entries())
        .sort(([a], [b]) => a.localeCompare(b))
        .map(([pool, list]) => {
          const info = pools.get(pool);
          const util = info ? info.utilization : null;
          const bursts = info ? info.bursts : null;
          const isBurstPool = info ? info.burst_pool : burst?.pool === pool;
          const hot = util !== null && threshold !== null && !!burst?.pool && !isBurstPool && util >= threshold;
          const up = list.filter((n) => n.state === "up").length;
          const cap = list.reduce(
            (a, n) => ({
              cpus: a.cpus + (n.capacity?.cpus || 0),
              cpuUsed: a.cpuUsed + (n.allocated?.cpus || 0),
              mem: a.mem + (n.capacity?.memory_mb || 0),
              memUsed: a.memUsed + (n.allocated?.memory_mb || 0),
              slots: a.slots + (n.capacity?.slots || 0),
              sbs: a.sbs + (n.allocated?.sandboxes || 0),
            }),
            { cpus: 0, cpuUsed: 0, mem: 0, memUsed: 0, slots: 0, sbs: 0 },
          );
          return (
            <Section
              title={"pool " + pool}
              testid={"pool-" + pool}
              extra={
                <span class="pool-summary" data-testid={"pool-summary-" + pool}>
                  {up}/{list.length} up · utilization{" "}
                  <strong class={hot ? "warn" : ""} title={hot ? "at or above the burst threshold: burstable creates go to the burst pool" : ""}>
                    {util === null ? "–" : pct(util)}
                  </strong>
                  {threshold !== null && burst?.pool && !isBurstPool ? ` (bursts at ${pct(threshold)})` : ""}
                  {bursts !== null && !isBurstPool ? ` · ${bursts} burst out` : ""}
                  {isBurstPool ? " · the burst pool" : ""}
                </span>
              }
            >
              <div class="pool-bars">
                <div>
                  cpu <Bar used={cap.cpuUsed} total={cap.cpus} label={`${num(cap.cpuUsed)} / ${num(cap.cpus)} cores`} />
                </div>
                <div>
                  memory <Bar used={cap.memUsed} total={cap.mem} label={`${num(cap.memUsed / 1024, 1)} / ${num(cap.mem / 1024, 1)} GiB`} />
                </div>
                <div>
                  slots <Bar used={cap.sbs} total={cap.slots} label={`${cap.sbs} / ${num(cap.slots)} sandboxes`} />
                </div>
              </div>
              <table class="grid" data-testid="nodes-table">
                <thead>
                  <tr>
                    <th>node</th>
                    <th>state</th>
                    <th>cpu</th>
                    <th>memory</th>
                    <th>sandboxes</th>
                    <th class="num">creating</th>
                    <th class="num">load 1m</th>
                    <th class="num">cached layers</th>
                    <th>heartbeat</th>
                    <th>url</th>
                  </tr>
                </thead>
                <tbody>
                  {list
                    .slice()
                    .sort((a, b) => a.name.localeCompare(b.name))
                    .map((n) => (
                      <tr data-testid={"node-row-" + n.name} title={extra(n)}>
                        <td>
                          {n.name}
                          {n.local ? <span class="muted small"> (local)</span> : null}
                        </td>
                        <td>
                          <span class={"badge " + (n.state === "up" ? "state-running" : "state-failed")}>{n.state}</span>
                        </td>
                        <td>
                          <Bar used={n.allocated?.cpus || 0} total={n.capacity?.cpus || 0} label={`${num(n.allocated?.cpus)} / ${num(n.capacity?.cpus)}`} />
                        </td>
                        <td>
                          <Bar
                            used={n.allocated?.memory_mb || 0}
                            total={n.capacity?.memory_mb || 0}
                            label={`${num((n.allocated?.memory_mb || 0) / 1024, 1)} / ${num((n.capacity?.memory_mb || 0) / 1024, 1)} GiB`}
                          />
                        </td>
                        <td>
                          <Bar
                            used={n.allocated?.sandboxes || 0}
                            total={n.capacity?.slots || 0}
                            label={`${n.allocated?.sandboxes ?? 0} / ${num(n.capacity?.slots)}`}
                          />
                        </td>
                        <td class="num">{n.inflight ?? "–"}</td>
                        <td class="num">{n.loadavg_1m === null || n.loadavg_1m === undefined ? "–" : num(n.loadavg_1m)}</td>
                        <td class="num">{Array.isArray(n.layers) ? n.layers.length : (n.layers ?? "–")}</td>
                        <td>{n.local ? "local" : duration(n.last_heartbeat_age_s) + " ago"}</td>
                        <td class="mono small">{n.url || "–"}</td>
                      </tr>
                    ))}
                </tbody>
              </table>
            </Section>
          );
        })}
    </div>
  );
}
