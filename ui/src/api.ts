// The console's only way to the platform: fetch() on /v1 with the key the
// user typed as a bearer token. No cookies are sent or used (credentials:
// "omit"), so there is nothing for another site to ride on (no CSRF).

const KEY = "dsec.key";
const WHO = "dsec.whoami";

export interface ApiErrorBody {
  code: string;
  message: string;
  field?: string;
}

export class ApiError extends Error {
  constructor(
    public status: number,
    public code: string,
    message: string,
    public field?: string,
  ) {
    super(message);
  }
  get adminOnly(): boolean {
    return this.status === 403;
  }
}

export interface WhoAmI {
  tenant: string;
  role: "admin" | "user";
  key_id: string | null;
  quota?: Record<string, number>;
  usage?: Record<string, number>;
}

// ----- the key, kept for this tab only (sessionStorage) -----------------------

export function storedKey(): string | null {
  return sessionStorage.getItem(KEY);
}
export function storedWho(): WhoAmI | null {
  try {
    return JSON.parse(sessionStorage.getItem(WHO) || "null");
  } catch {
    return null;
  }
}
export function saveLogin(key: string, who: WhoAmI) {
  sessionStorage.setItem(KEY, key);
  sessionStorage.setItem(WHO, JSON.stringify(who));
}
export function clearLogin() {
  sessionStorage.removeItem(KEY);
  sessionStorage.removeItem(WHO);
}

// Called when the platform answers 401 to the stored key (revoked, expired).
let unauthorized: (msg: string) => void = () => {};
export function onUnauthorized(fn: (msg: string) => void) {
  unauthorized = fn;
}

// ----- requests ------------------------------------------------------------------

export interface CallOptions {
  body?: unknown; // an object (sent as JSON), or a Blob/File (sent as is)
  signal?: AbortSignal;
  key?: string; // another key than the stored one (the login check)
  headers?: Record<string, string>;
}

async function errorOf(r: Response): Promise<ApiError> {
  let body: ApiErrorBody | undefined;
  try {
    const j = await r.json();
    body = j && j.error;
  } catch {
    /* not JSON */
  }
  return new ApiError(
    r.status,
    body?.code || "http_" + r.status,
    body?.message || r.statusText || "HTTP " + r.status,
    body?.field || undefined,
  );
}

// The raw Response of a successful call; ApiError otherwise.
export async function call(method: string, path: string, o: CallOptions = {}): Promise<Response> {
  const key = o.key ?? storedKey();
  const headers: Record<string, string> = { ...o.headers };
  if (key) headers["Authorization"] = "Bearer " + key;
  let body: BodyInit | undefined;
  if (o.body instanceof Blob) {
    body = o.body;
    headers["Content-Type"] ??= "application/octet-stream";
  } else if (o.body !== undefined) {
    body = JSON.stringify(o.body);
    headers["Content-Type"] = "application/json";
  }
  let r: Response;
  try {
    r = await fetch(path, {
      method,
      headers,
      body,
      signal: o.signal,
      credentials: "omit",
      cache: "no-store",
      redirect: "error",
    });
  } catch (e) {
    if ((e as Error).name === "AbortError") throw e;
    throw new ApiError(0, "network", "cannot reach the platform: " + (e as Error).message);
  }
  if (!r.ok) {
    const err = await errorOf(r);
    if (r.status === 401 && o.key === undefined && key) unauthorized(err.message);
    throw err;
  }
  return r;
}

export async function json<T>(method: string, path: string, o: CallOptions = {}): Promise<T> {
  const r = await call(method, path, o);
  const text = await r.text();
  return (text ? JSON.parse(text) : {}) as T;
}

export const get = <T>(path: string, signal?: AbortSignal) => json<T>("GET", path, { signal });
export const post = <T>(path: string, body: unknown = {}) => json<T>("POST", path, { body });
export const del = <T>(path: string) => json<T>("DELETE", path);

export const enc = encodeURIComponent;
export const sbPath = (id: string) => `/v1/sandboxes/${enc(id)}`;

// Reads an NDJSON body line by line as it arrives.
export async function* ndjson(r: Response): AsyncGenerator<any> {
  if (!r.body) return;
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl: number;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (line) yield JSON.parse(line);
      }
    }
    const rest = (buf + dec.decode()).trim();
    if (rest) yield JSON.parse(rest);
  } finally {
    reader.releaseLock();
  }
}

// ----- what the API returns (the fields the console reads) -------------------------

export interface Sandbox {
  id: string;
  backend: string;
  image: string;
  workspaces?: string[];
  toolkits?: string[];
  diffs?: string[];
  layers?: string[];
  state: string;
  cpu?: number;
  memory_mb?: number;
  disk_mb?: number;
  pids?: number;
  ttl_s?: number;
  idle_timeout_s?: number;
  auto_pause_s?: number;
  env?: Record<string, string>;
  user?: string;
  working_dir?: string;
  labels?: Record<string, string>;
  node?: string;
  pool?: string;
  burstable?: boolean;
  created_at?: string;
  expires_at?: string | null;
  stopped_at?: string | null;
  error?: string | null;
  policy?: string;
  readonly_paths?: string[];
  hidden_paths?: string[];
  phases?: { policy: string; at: string }[];
  owner?: string;
  batch?: string | null;
  pause_memory?: string | null;
  stats?: {
    oom_kills?: number;
    pids_limit_hits?: number;
    memory_bytes?: number;
    cpu_usec?: number;
    pids?: number;
    [k: string]: unknown;
  };
}

// GET /v1/sandboxes/ID/stats: the node's readings, oldest first, as parallel
// arrays; cpu is cores used since the reading before (null for the first).
export interface StatsHistory {
  id: string;
  state: string;
  window_s: number;
  interval_s: number;
  t: number[];
  cpu: (number | null)[];
  memory_bytes: number[];
  pids: number[];
  cpu_limit: number;
  memory_limit_bytes: number;
  pids_limit: number;
}

export interface Audit {
  id: string;
  denied_syscalls?: Record<string, number>;
  denied_total?: number;
  egress_denied?: number;
  egress_last_denied?: string | null;
}

export interface Image {
  name: string;
  tag: string;
  ref: string;
  kind: string;
  layers: string[];
  size?: number;
  created_at?: string;
  parent?: unknown;
  config?: { user?: string; env?: string[]; working_dir?: string };
  owner?: string;
  visibility?: string;
  source?: unknown;
  logical_bytes?: number;
  stored_bytes?: number;
}

export interface Layer {
  digest: string;
  kind: string | null;
  size: number;
  created_at?: string;
  images: string[];
  in_use: boolean;
  data: { digest: string; size?: number } | null;
  extra_data?: { digest: string; size?: number }[];
}

export interface Node {
  name: string;
  pool: string;
  state: string;
  local?: boolean;
  url?: string | null;
  capacity?: { cpus?: number; memory_mb?: number; slots?: number };
  allocated?: { cpus?: number; memory_mb?: number; sandboxes?: number };
  inflight?: number;
  reported_sandboxes?: number | null;
  layers?: number | string[];
  loadavg_1m?: number | null;
  last_heartbeat_age_s?: number;
  [k: string]: unknown;
}

export interface PoolInfo {
  name: string;
  nodes: number;
  up: number;
  utilization: number;
  burst_pool: boolean;
  bursts: number;
}

export interface NodesAnswer {
  nodes: Node[];
  pools?: PoolInfo[];
  burst?: { pool: string | null; threshold: number };
}

export interface TrajectorySummary {
  id: string;
  steps: number;
  first_at?: string;
  last_at?: string;
}

export interface Step {
  trajectory_id: string;
  step: number;
  kind: string;
  sandbox: string;
  digest: string;
  request: any;
  status: number;
  result?: any;
  result_b64?: string;
  started_at?: string;
  duration_ms?: number;
}

export interface Recovery {
  trajectory_id: string;
  sandbox: Sandbox;
  previous_sandbox?: string;
  checkpoint_step: number | null;
  checkpoint_image: string | null;
  skipped_checkpoints?: unknown[];
  reexecuted_steps: number;
  diverged: { step: number; kind: string; reason: string; logged?: unknown; now?: unknown }[];
  last_step?: number;
}

// A recovery as the platform stores it (GET /v1/trajectories/ID/info).
export interface StoredRecovery {
  at?: string;
  previous_sandbox?: string;
  sandbox: string;
  checkpoint_step: number | null;
  reexecuted_steps: number;
  diverged: Recovery["diverged"];
}

// What the platform keeps of a trajectory beside its steps.
export interface TrajectoryInfo {
  trajectory_id: string;
  steps: number;
  first_at?: string;
  last_at?: string;
  sandbox?: string; // the trajectory's sandbox now
  replaced?: string[]; // the sandboxes recoveries replaced
  recoveries?: StoredRecovery[]; // oldest first
  checkpoints?: { step: number; sandbox: string; status: number; image?: string; name?: string; tag?: string; ref?: string }[];
  kinds?: Record<string, number>;
  replays?: Record<string, number>; // step -> answers replayed from the log (since this replica started)
}

export interface Process {
  pid: number;
  cmd?: string[] | string;
  running?: boolean;
  pty?: { rows: number; cols: number } | boolean | null;
  tag?: string | null;
  exit_code?: number;
  signal?: number;
  [k: string]: unknown;
}

export interface FileEntry {
  name: string;
  type: string;
  size: number;
  mode: number;
  mtime: number | string;
  uid?: number;
  gid?: number;
}

export interface Exposure {
  port: number;
  gen?: number;
  url?: string;
  path_url?: string;
  token?: string;
  expires_at?: string | null;
  created_at?: string;
}

// ----- calls -----------------------------------------------------------------------

export const whoami = (key?: string) => json<WhoAmI>("GET", "/v1/whoami", { key });

// The newest `limit` sandboxes matching the filters, and how many match.
export function listSandboxes(labels: string[], state: string | null, signal?: AbortSignal, limit = 500) {
  const q = new URLSearchParams();
  for (const l of labels) q.append("label", l);
  if (state) q.set("state", state);
  q.set("sort", "-created");
  q.set("limit", String(limit));
  return get<{ sandboxes: Sandbox[]; total?: number }>("/v1/sandboxes?" + q.toString(), signal);
}

export const getSandbox = (id: string, signal?: AbortSignal) => get<Sandbox>(sbPath(id), signal);
export const stopSandbox = (id: string) => del<Sandbox>(sbPath(id));
export const pauseSandbox = (id: string) => post<Sandbox>(sbPath(id) + "/pause");
export const resumeSandbox = (id: string) => post<Sandbox>(sbPath(id) + "/resume");
export const getAudit = (id: string, signal?: AbortSignal) => get<Audit>(sbPath(id) + "/audit", signal);
export const getStats = (id: string, windowS: number, signal?: AbortSignal) =>
  get<StatsHistory>(`${sbPath(id)}/stats?window_s=${windowS}`, signal);

export const listPorts = async (id: string, signal?: AbortSignal): Promise<Exposure[]> => {
  const j = await get<Exposure[] | { ports: Exposure[] }>(sbPath(id) + "/ports", signal);
  return Array.isArray(j) ? j : j.ports || [];
};
export const exposePort = (id: string, port: number, ttl_s?: number, rotate?: boolean) =>
  post<Exposure>(sbPath(id) + "/ports", {
    port,
    ...(ttl_s ? { ttl_s } : {}),
    ...(rotate ? { rotate: true } : {}),
  });
export const unexposePort = (id: string, port: number) => del<unknown>(`${sbPath(id)}/ports/${port}`);

export const listImages = (signal?: AbortSignal) => get<{ images: Image[] }>("/v1/images", signal);
export const getImage = (ref: string) =>
  get<Image>("/v1/images/" + ref.split("/").map(enc).join("/"));
export const listLayers = (signal?: AbortSignal) => get<{ layers: Layer[] }>("/v1/layers", signal);
export const listNodes = (signal?: AbortSignal) => get<NodesAnswer>("/v1/nodes", signal);

export const listTrajectories = (signal?: AbortSignal) =>
  get<{ trajectories: TrajectorySummary[] }>("/v1/trajectories", signal);
export async function exportTrajectory(id: string, signal?: AbortSignal): Promise<{ text: string; steps: Step[] }> {
  const r = await call("GET", "/v1/trajectories/" + enc(id), { signal });
  const text = await r.text();
  const steps = text
    .split("\n")
    .filter((l) => l.trim())
    .map((l) => JSON.parse(l) as Step);
  return { text, steps };
}
export const trajectoryInfo = (id: string, signal?: AbortSignal) =>
  get<TrajectoryInfo>(`/v1/trajectories/${enc(id)}/info`, signal);
export const recoverTrajectory = (id: string, force: boolean) =>
  post<Recovery>(`/v1/trajectories/${enc(id)}/recover`, force ? { force: true } : {});

export async function metricsText(signal?: AbortSignal): Promise<string> {
  const r = await call("GET", "/v1/metrics", { signal });
  return r.text();
}

// Saves a Blob as a download (object URL, revoked after the click).
export function saveBlob(blob: Blob, name: string) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
