// Trajectories (Chronus): the list, and one trajectory's steps in order from
// its JSONL export, with how each ran (executed, replayed ×n, re-executed by
// a recovery), its checkpoints, its stored recoveries (GET …/info) and a
// Recover button.
import { useState } from "preact/hooks";
import {
  exportTrajectory,
  listTrajectories,
  recoverTrajectory,
  saveBlob,
  trajectoryInfo,
  type Recovery,
  type Step,
  type StoredRecovery,
} from "../api";
import { ErrorBox, JsonBlock, Loading, Mono, Section, StateBadge } from "../components/common";
import { ago, bytes, dateTime, decodeB64, utf8OrNull } from "../format";
import { href, useAction, usePoll, type Route } from "../hooks";

export function Trajectories() {
  const list = usePoll((signal) => listTrajectories(signal), 10000, []);
  const [q, setQ] = useState("");
  const rows = (list.data?.trajectories || [])
    .filter((t) => !q || t.id.toLowerCase().includes(q.toLowerCase()))
    .sort((a, b) => (b.last_at || "").localeCompare(a.last_at || ""));
  return (
    <div class="page">
      <div class="page-head">
        <h1>Trajectories</h1>
        <span class="muted">{list.data ? rows.length : ""}</span>
        <span class="spacer" />
        <input placeholder="search id" value={q} onInput={(e) => setQ((e.target as HTMLInputElement).value)} />
      </div>
      <ErrorBox error={list.error} what="list trajectories" />
      {list.loading && !list.data ? <Loading /> : null}
      {list.data ? (
        <table class="grid" data-testid="traj-table">
          <thead>
            <tr>
              <th>id</th>
              <th class="num">steps</th>
              <th>first step</th>
              <th>last step</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((t) => (
              <tr data-testid={"traj-row-" + t.id}>
                <td>
                  <a class="mono" href={href(["trajectories", t.id])}>
                    {t.id}
                  </a>
                </td>
                <td class="num">{t.steps}</td>
                <td title={dateTime(t.first_at)}>{ago(t.first_at)}</td>
                <td title={dateTime(t.last_at)}>{ago(t.last_at)}</td>
              </tr>
            ))}
            {rows.length === 0 ? (
              <tr>
                <td colSpan={4} class="muted">
                  No trajectory.
                </td>
              </tr>
            ) : null}
          </tbody>
        </table>
      ) : null}
    </div>
  );
}

// What a step did, in a few words.
function summary(s: Step): string {
  const r = s.request || {};
  switch (s.kind) {
    case "exec":
      return Array.isArray(r.cmd) ? r.cmd.join(" ") : String(r.cmd ?? "");
    case "write":
      return `${r.path ?? ""} (${bytes(r.size)})`;
    case "read":
    case "remove":
    case "mkdir":
      return String(r.path ?? "");
    case "checkpoint":
      return `${r.name ?? ""}:${r.tag ?? "latest"}`;
    default:
      return JSON.stringify(r).slice(0, 120);
  }
}

function outcome(s: Step): string {
  const res = s.result;
  if (s.kind === "exec" && res) {
    if (res.timed_out) return "timed out";
    if (res.signal) return "signal " + res.signal;
    return "exit " + res.exit_code;
  }
  if (s.kind === "checkpoint" && res) return res.ref || `${res.name}:${res.tag}`;
  if (s.result_b64 !== undefined) return bytes(decodeB64(s.result_b64).length);
  return String(s.status);
}

function StepDetail({ s }: { s: Step }) {
  let body: unknown = s.result;
  if (s.result_b64 !== undefined) {
    const b = decodeB64(s.result_b64);
    const text = utf8OrNull(b);
    body = text !== null ? text.slice(0, 64 * 1024) : `(${b.length} bytes, not text)`;
  }
  return (
    <div class="step-detail">
      <div>
        <h3>request</h3>
        <JsonBlock value={s.request} />
      </div>
      <div>
        <h3>result</h3>
        {typeof body === "string" ? <pre class="json">{body}</pre> : <JsonBlock value={body} />}
        <div class="muted small">
          digest <Mono>{s.digest}</Mono>
        </div>
      </div>
    </div>
  );
}

export function Trajectory({ route }: { route: Route }) {
  const id = route.parts[1];
  const data = usePoll((signal) => exportTrajectory(id, signal), 0, [id]);
  // Recoveries, checkpoints and replay counts (a platform without …/info: 404, then none).
  const info = usePoll((signal) => trajectoryInfo(id, signal), 10000, [id]);
  const [open, setOpen] = useState<Set<number>>(new Set());
  const [force, setForce] = useState(false);
  const [recovery, setRecovery] = useState<Recovery | null>(null);
  const action = useAction();
  const steps = (data.data?.steps || []).slice().sort((a, b) => a.step - b.step);
  const checkpoints = steps.filter((s) => s.kind === "checkpoint");
  const sandboxes = Array.from(new Set(steps.map((s) => s.sandbox)));
  const stored: StoredRecovery[] = info.data?.recoveries || [];
  const replays = info.data?.replays || {};
  // The recovery that made the trajectory's sandbox now: the one just made
  // here, else the latest the platform stored.
  const latest: StoredRecovery | null = recovery
    ? { ...recovery, sandbox: recovery.sandbox.id }
    : stored.length
      ? stored[stored.length - 1]
      : null;
  const diverged = new Map((latest?.diverged || []).map((d) => [d.step, d]));
  const after = latest ? (latest.checkpoint_step ?? -1) : Infinity;
  const mutating = new Set(["exec", "write", "mkdir", "remove"]);

  const recover = () =>
    action.run(async () => {
      const r = await recoverTrajectory(id, force);
      setRecovery(r);
      data.refresh();
      info.refresh();
    });

  const toggle = (n: number) =>
    setOpen((o) => {
      const c = new Set(o);
      if (c.has(n)) c.delete(n);
      else c.add(n);
      return c;
    });

  return (
    <div class="page">
      <div class="page-head">
        <a href={href(["trajectories"])} class="muted">
          Trajectories
        </a>
        <span class="muted">/</span>
        <h1 class="mono" data-testid="traj-id">
          {id}
        </h1>
        <span class="spacer" />
        {data.data ? (
          <button class="btn" onClick={() => saveBlob(new Blob([data.data!.text], { type: "application/x-ndjson" }), id + ".jsonl")}>
            Export JSONL
          </button>
        ) : null}
      </div>
      <ErrorBox error={data.error} what={"trajectory " + id} />
      {data.loading && !data.data ? <Loading what="steps" /> : null}
      <div class="grid2">
        <Section title="Recover" testid="traj-recover">
          <p class="muted small">
            A new sandbox made as the trajectory's was, on its latest usable checkpoint; the mutating steps after it are
            re-executed in order. Steps whose exit status differs are reported as diverged.
          </p>
          <label class="check">
            <input type="checkbox" checked={force} onChange={(e) => setForce((e.target as HTMLInputElement).checked)} data-testid="recover-force" />
            force (even if its sandbox still runs; the old one is left as it is)
          </label>
          <button class="btn primary" disabled={action.busy} onClick={recover} data-testid="recover-button">
            {action.busy ? "Recovering…" : "Recover"}
          </button>
          <ErrorBox error={action.error} what="recover" />
          {recovery ? (
            <div class="recovery" data-testid="recover-result">
              <p>
                New sandbox{" "}
                <a class="mono" href={href(["sandboxes", recovery.sandbox.id])} data-testid="recover-sandbox">
                  {recovery.sandbox.id}
                </a>{" "}
                <StateBadge state={recovery.sandbox.state} /> replaces <Mono>{recovery.previous_sandbox || "–"}</Mono>.
              </p>
              <p>
                {recovery.checkpoint_step !== null
                  ? `From checkpoint step ${recovery.checkpoint_step} (${recovery.checkpoint_image}); `
                  : "From the start (no usable checkpoint); "}
                {recovery.reexecuted_steps} step(s) re-executed, {recovery.diverged.length} diverged.
              </p>
              {recovery.skipped_checkpoints && recovery.skipped_checkpoints.length ? (
                <p class="muted small">Skipped checkpoints: {JSON.stringify(recovery.skipped_checkpoints)}</p>
              ) : null}
            </div>
          ) : null}
        </Section>
        <Section title="Summary">
          <table class="kv">
            <tbody>
              <tr>
                <th>steps</th>
                <td>{steps.length}</td>
              </tr>
              {info.data?.sandbox ? (
                <tr>
                  <th>sandbox now</th>
                  <td data-testid="traj-sandbox">
                    <a class="mono" href={href(["sandboxes", info.data.sandbox])}>
                      {info.data.sandbox}
                    </a>
                    {info.data.replaced && info.data.replaced.length ? (
                      <span class="muted small"> (replaced {info.data.replaced.join(", ")})</span>
                    ) : null}
                  </td>
                </tr>
              ) : null}
              <tr>
                <th>sandboxes</th>
                <td>
                  {sandboxes.map((sb) => (
                    <>
                      <a class="mono" href={href(["sandboxes", sb])}>
                        {sb}
                      </a>{" "}
                    </>
                  ))}
                </td>
              </tr>
              <tr>
                <th>checkpoints</th>
                <td data-testid="traj-checkpoints">
                  {checkpoints.length
                    ? checkpoints.map((c) => (
                        <div data-testid={"traj-checkpoint-" + c.step}>
                          step {c.step}: <Mono>{outcome(c)}</Mono>
                          {c.status >= 300 ? <span class="muted small"> (failed: {c.status})</span> : null}
                        </div>
                      ))
                    : "none"}
                </td>
              </tr>
              <tr>
                <th>first / last</th>
                <td>
                  {dateTime(steps[0]?.started_at)} / {dateTime(steps[steps.length - 1]?.started_at)}
                </td>
              </tr>
            </tbody>
          </table>
        </Section>
      </div>
      {stored.length ? (
        <Section title={`Recoveries (${stored.length})`} testid="traj-recoveries">
          <table class="grid compact">
            <thead>
              <tr>
                <th>at</th>
                <th>previous sandbox</th>
                <th>new sandbox</th>
                <th>from</th>
                <th class="num">re-executed</th>
                <th class="num">diverged</th>
              </tr>
            </thead>
            <tbody>
              {stored.map((r, i) => (
                <tr data-testid={"recovery-row-" + i}>
                  <td title={dateTime(r.at)}>{ago(r.at)}</td>
                  <td class="mono small">{r.previous_sandbox || "–"}</td>
                  <td>
                    <a class="mono small" href={href(["sandboxes", r.sandbox])}>
                      {r.sandbox}
                    </a>
                  </td>
                  <td>{r.checkpoint_step !== null && r.checkpoint_step !== undefined ? `checkpoint step ${r.checkpoint_step}` : "the image"}</td>
                  <td class="num">{r.reexecuted_steps}</td>
                  <td class="num" title={(r.diverged || []).map((d) => `step ${d.step}: ${d.reason}`).join("\n")}>
                    {(r.diverged || []).length}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </Section>
      ) : null}
      {data.data ? (
        <table class="grid steps" data-testid="traj-steps">
          <thead>
            <tr>
              <th class="num">step</th>
              <th>kind</th>
              <th>what</th>
              <th>outcome</th>
              <th>how it ran</th>
              <th>sandbox</th>
              <th>started</th>
              <th class="num">ms</th>
            </tr>
          </thead>
          <tbody>
            {steps.map((s) => {
              const dv = diverged.get(s.step);
              // Steps logged in the recovered sandbox itself ran there live.
              const before = latest && s.sandbox !== latest.sandbox;
              const ran =
                s.kind === "checkpoint"
                  ? "checkpoint"
                  : before && s.step > after && mutating.has(s.kind)
                    ? dv
                      ? "re-executed, diverged"
                      : "re-executed"
                    : before && s.step <= after
                      ? "in checkpoint"
                      : before && !mutating.has(s.kind)
                        ? "executed (not re-run: changes nothing)"
                        : "executed";
              const nReplayed = replays[String(s.step)] || 0;
              return (
                <>
                  <tr
                    data-testid={"step-row-" + s.step}
                    class={"clickable kind-" + s.kind + (dv ? " diverged" : "")}
                    onClick={() => toggle(s.step)}
                  >
                    <td class="num">{s.step}</td>
                    <td>
                      <span class={"badge kind-" + s.kind}>{s.kind}</span>
                    </td>
                    <td class="mono what">{summary(s)}</td>
                    <td>{outcome(s)}</td>
                    <td title={dv ? dv.reason : ""} data-testid={"step-ran-" + s.step}>
                      {ran}
                      {nReplayed ? (
                        <span class="badge replayed" title="repeats of this step answered from the log, not run again">
                          replayed ×{nReplayed}
                        </span>
                      ) : null}
                    </td>
                    <td class="mono small">{s.sandbox}</td>
                    <td>{dateTime(s.started_at)}</td>
                    <td class="num">{s.duration_ms !== undefined ? s.duration_ms.toFixed(1) : "–"}</td>
                  </tr>
                  {open.has(s.step) ? (
                    <tr class="detail">
                      <td colSpan={8}>
                        {dv ? <div class="error">diverged: {dv.reason}</div> : null}
                        <StepDetail s={s} />
                      </td>
                    </tr>
                  ) : null}
                </>
              );
            })}
          </tbody>
        </table>
      ) : null}
      <p class="muted small">
        The export logs each step as it first ran ("executed"); a repeat of a step is answered from this log and
        adds no row ("replayed ×n": how often this replica did so since it started). After a recovery, the steps
        the new sandbox re-ran are marked here.
      </p>
    </div>
  );
}
