// Hash routing and data hooks.
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "./api";

// ----- routing: #/sandboxes/sb-1/files?path=/etc --------------------------------------

export interface Route {
  parts: string[]; // ["sandboxes", "sb-1", "files"]
  query: URLSearchParams;
}

export function parseHash(hash: string): Route {
  const h = hash.replace(/^#\/?/, "");
  const q = h.indexOf("?");
  const path = q >= 0 ? h.slice(0, q) : h;
  return {
    parts: path.split("/").filter(Boolean).map(decodeURIComponent),
    query: new URLSearchParams(q >= 0 ? h.slice(q + 1) : ""),
  };
}

export function href(parts: string[], query?: Record<string, string | string[] | undefined>): string {
  let h = "#/" + parts.map(encodeURIComponent).join("/");
  if (query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) {
      if (Array.isArray(v)) v.forEach((x) => q.append(k, x));
      else if (v !== undefined && v !== "") q.set(k, v);
    }
    const s = q.toString();
    if (s) h += "?" + s;
  }
  return h;
}

export function useRoute(): Route {
  const [hash, setHash] = useState(location.hash);
  useEffect(() => {
    const on = () => setHash(location.hash);
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return parseHash(hash);
}

// Changes the query of the current route without a new history entry.
export function replaceQuery(parts: string[], query: Record<string, string | string[] | undefined>) {
  history.replaceState(null, "", href(parts, query));
  dispatchEvent(new HashChangeEvent("hashchange"));
}

// ----- polling -----------------------------------------------------------------------

export interface Poll<T> {
  data?: T;
  error?: Error;
  loading: boolean;
  refresh: () => void;
  at: number; // when data last arrived (ms)
}

// Calls fn now and every intervalMs after the previous call ended (never two
// at once); slower while the tab is hidden; not again after a 401, 403 or
// 404. A change of deps starts over.
// intervalMs 0: once.
export function usePoll<T>(fn: (signal: AbortSignal) => Promise<T>, intervalMs: number, deps: unknown[]): Poll<T> {
  const [state, setState] = useState<{ data?: T; error?: Error; loading: boolean; at: number }>({
    loading: true,
    at: 0,
  });
  const kick = useRef<() => void>(() => {});
  useEffect(() => {
    let stopped = false;
    let timer: number | undefined;
    let ctl: AbortController | undefined;
    setState((s) => ({ ...s, loading: true, data: undefined, error: undefined }));
    const run = async () => {
      clearTimeout(timer);
      ctl?.abort();
      ctl = new AbortController();
      const mine = ctl;
      try {
        const data = await fn(mine.signal);
        if (stopped || mine.signal.aborted) return;
        setState({ data, error: undefined, loading: false, at: Date.now() });
      } catch (e) {
        if (stopped || mine.signal.aborted) return;
        setState((s) => ({ ...s, error: e as Error, loading: false }));
        // Asking again will not help: not allowed, or gone (refresh() still can).
        const st = (e as ApiError).status;
        if (e instanceof ApiError && (st === 401 || st === 403 || st === 404)) return;
      }
      if (!stopped && intervalMs > 0) {
        timer = window.setTimeout(run, document.hidden ? Math.max(intervalMs, 30_000) : intervalMs);
      }
    };
    kick.current = run;
    const onVisible = () => {
      if (!document.hidden && intervalMs > 0) run();
    };
    document.addEventListener("visibilitychange", onVisible);
    run();
    return () => {
      stopped = true;
      clearTimeout(timer);
      ctl?.abort();
      document.removeEventListener("visibilitychange", onVisible);
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, deps);
  const refresh = useCallback(() => kick.current(), []);
  return { ...state, refresh };
}

// Runs an action, tracking busy and error, for buttons.
export function useAction() {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<Error | undefined>();
  const run = useCallback(async <T>(fn: () => Promise<T>): Promise<T | undefined> => {
    setBusy(true);
    setError(undefined);
    try {
      return await fn();
    } catch (e) {
      setError(e as Error);
      return undefined;
    } finally {
      setBusy(false);
    }
  }, []);
  return { busy, error, run, setError };
}
