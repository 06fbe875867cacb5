// The cluster's rates over the last hour, for the Rates page. One function,
// fetchRates(), is all the page calls. It asks the platform's history
// (GET /v1/metrics/history?window_s=3600) and, while the platform has none
// (404), samples /v1/metrics (Prometheus text) every 10 s in this tab and
// derives rates from counter deltas: the chart then covers the time the
// console has been open (it starts sampling when an admin logs in).
import { ApiError, get, metricsText } from "./api";

export interface Rates {
  t: number[]; // unix seconds
  series: Record<string, (number | null)[]>; // keyed by SERIES names
  source: "history" | "console";
  intervalS: number;
}

// What the page charts. `counter`: a rate per second of the family's sum;
// else the gauge's sum. `match`: only samples whose labels include these.
interface Spec {
  family: string;
  counter: boolean;
  match?: Record<string, string>;
  self?: number; // what the console's own scrape adds to a gauge (sampled here only)
}
// Named as the platform's history names them (platform/metrics_history.cc).
export const SERIES: Record<string, Spec> = {
  creates_per_s: { family: "dsec_sandbox_creations_total", counter: true },
  create_errors_per_s: { family: "dsec_sandbox_create_errors_total", counter: true },
  api_errors_per_s: { family: "dsec_api_errors_total", counter: true },
  calls_in_flight: { family: "dsec_sandbox_calls_in_flight", counter: false },
  http_requests_in_flight: { family: "dsec_http_requests_in_flight", counter: false, self: 1 },
  blocking_busy: { family: "dsec_runtime_blocking_busy", counter: false, self: 1 },
  blocking_queued: { family: "dsec_runtime_blocking_queued", counter: false },
  "sandboxes.running": { family: "dsec_sandboxes", counter: false, match: { state: "running" } },
  "sandboxes.paused": { family: "dsec_sandboxes", counter: false, match: { state: "paused" } },
  "sandboxes.creating": { family: "dsec_sandboxes", counter: false, match: { state: "creating" } },
  syscalls_denied_per_s: { family: "dsec_sandbox_syscalls_denied_total", counter: true },
  egress_denied_per_s: { family: "dsec_sandbox_egress_denied_total", counter: true },
  port_connections: { family: "dsec_port_connections", counter: false },
  nodes_up: { family: "dsec_node_up", counter: false },
};

// ----- Prometheus text ---------------------------------------------------------------

export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

export function parsePrometheus(text: string): Sample[] {
  const out: Sample[] = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = LINE.exec(line);
    if (!m) continue;
    const labels: Record<string, string> = {};
    if (m[3]) {
      for (const l of m[3].matchAll(LABEL)) {
        labels[l[1]] = l[2].replace(/\\n/g, "\n").replace(/\\"/g, '"').replace(/\\\\/g, "\\");
      }
    }
    const v = m[4] === "+Inf" ? Infinity : m[4] === "-Inf" ? -Infinity : Number(m[4]);
    out.push({ name: m[1], labels, value: v });
  }
  return out;
}

export function sumOf(samples: Sample[], family: string, match?: Record<string, string>): number | null {
  let sum = 0;
  let seen = false;
  for (const s of samples) {
    if (s.name !== family) continue;
    if (match && !Object.entries(match).every(([k, v]) => s.labels[k] === v)) continue;
    sum += s.value;
    seen = true;
  }
  return seen ? sum : null;
}

// ----- the console's own sampler ------------------------------------------------------

const INTERVAL_S = 10;
const KEEP = 3600 / INTERVAL_S + 1;

interface Raw {
  t: number;
  v: Record<string, number | null>;
}
const raw: Raw[] = [];
let timer: number | undefined;
let lastError: Error | undefined;

async function sampleOnce() {
  try {
    const samples = parsePrometheus(await metricsText());
    const v: Record<string, number | null> = {};
    for (const [k, spec] of Object.entries(SERIES)) {
      const x = sumOf(samples, spec.family, spec.match);
      v[k] = x === null ? null : Math.max(0, x - (spec.self ?? 0));
    }
    raw.push({ t: Date.now() / 1000, v });
    if (raw.length > KEEP) raw.splice(0, raw.length - KEEP);
    lastError = undefined;
  } catch (e) {
    lastError = e as Error;
    if (e instanceof ApiError && (e.status === 401 || e.status === 403)) stopSampler();
  }
}

export function startSampler() {
  if (timer !== undefined) return;
  sampleOnce();
  timer = window.setInterval(sampleOnce, INTERVAL_S * 1000);
}

export function stopSampler() {
  clearInterval(timer);
  timer = undefined;
  raw.length = 0;
}

function consoleRates(): Rates {
  const series: Record<string, (number | null)[]> = {};
  for (const k of Object.keys(SERIES)) series[k] = [];
  const t: number[] = [];
  for (let i = 1; i < raw.length; i++) {
    const a = raw[i - 1];
    const b = raw[i];
    const dt = b.t - a.t;
    t.push(b.t);
    for (const [k, spec] of Object.entries(SERIES)) {
      const x = a.v[k];
      const y = b.v[k];
      if (!spec.counter) series[k].push(y);
      // A counter that went down was reset (a restart): no rate for that step.
      else series[k].push(x === null || y === null || y < x || dt <= 0 ? null : (y - x) / dt);
    }
  }
  return { t, series, source: "console", intervalS: INTERVAL_S };
}

// ----- the platform's history, when it has one ------------------------------------------

// Accepts {"t":[...],"series":{name:[...]}} (names as SERIES, or families:
// then counters are turned into rates here) or {"samples":[{"t",name:value}]}.
function historyRates(j: any): Rates {
  let t: number[] = [];
  let cols: Record<string, (number | null)[]> = {};
  if (Array.isArray(j.samples)) {
    t = j.samples.map((s: any) => s.t);
    for (const s of j.samples) {
      for (const [k, v] of Object.entries(s.values ?? s)) {
        if (k === "t") continue;
        (cols[k] ??= []).push(typeof v === "number" ? v : null);
      }
    }
  } else {
    t = j.t ?? j.times ?? [];
    cols = j.series ?? {};
  }
  const series: Record<string, (number | null)[]> = {};
  for (const [k, spec] of Object.entries(SERIES)) {
    if (cols[k]) series[k] = cols[k];
    else if (cols[spec.family] && !spec.match) {
      const c = cols[spec.family];
      series[k] = spec.counter
        ? c.map((y, i) => {
            const x = c[i - 1];
            const dt = t[i] - t[i - 1];
            return i === 0 || x == null || y == null || y < x || !(dt > 0) ? null : (y - x) / dt;
          })
        : c;
    } else series[k] = t.map(() => null);
  }
  return { t, series, source: "history", intervalS: j.interval_s ?? INTERVAL_S };
}

let mode: "unknown" | "history" | "console" = "unknown";

export async function fetchRates(signal?: AbortSignal): Promise<Rates> {
  if (mode !== "console") {
    try {
      const j = await get<any>("/v1/metrics/history?window_s=3600", signal);
      mode = "history";
      return historyRates(j);
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 404) throw e;
      mode = "console";
    }
  }
  startSampler();
  if (lastError && raw.length === 0) throw lastError;
  return consoleRates();
}
