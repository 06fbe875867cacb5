// A terminal on a process session with a PTY (docs/processes.md): xterm.js
// draws it; the output is the session's NDJSON stream read with fetch;
// keystrokes are coalesced for ~10 ms into one input call; the terminal's
// size follows its box (fit addon → resize call). A dropped stream
// reconnects from the offset after the last byte shown, so nothing is
// missed or shown twice; a reload of the page re-attaches to the same shell.
import { FitAddon } from "@xterm/addon-fit";
import { Terminal as XTerm } from "@xterm/xterm";
import { useEffect, useRef, useState } from "preact/hooks";
import { ApiError, call, json, ndjson, sbPath, type Process } from "../api";
import { decodeB64, encodeB64 } from "../format";
import { ErrorBox } from "./common";

const SHELL = ["/bin/sh", "-c", "[ -x /bin/bash ] && exec /bin/bash -i; exec /bin/sh -i"];
const COALESCE_MS = 10;
const storeKey = (id: string) => "dsec.term." + id;

type Status = "idle" | "starting" | "connected" | "reconnecting" | "exited" | "failed";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export function Terminal({ sandboxId, active, running }: { sandboxId: string; active: boolean; running: boolean }) {
  const box = useRef<HTMLDivElement>(null);
  const term = useRef<XTerm | null>(null);
  const fit = useRef<FitAddon | null>(null);
  const session = useRef<{ pid: number; stop: () => void } | null>(null);
  const [status, setStatus] = useState<Status>("idle");
  const [pid, setPid] = useState<number | null>(null);
  const [note, setNote] = useState("");
  const [error, setError] = useState<Error | undefined>();
  const started = useRef(false);
  const base = sbPath(sandboxId) + "/processes";

  // The xterm instance lives as long as this component.
  useEffect(() => {
    const t = new XTerm({
      cursorBlink: true,
      convertEol: false,
      fontFamily: 'ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace',
      fontSize: 13,
      scrollback: 5000,
      theme: { background: "#111827", foreground: "#e5e7eb" },
    });
    const f = new FitAddon();
    t.loadAddon(f);
    t.open(box.current!);
    term.current = t;
    fit.current = f;
    const ro = new ResizeObserver(() => {
      if (box.current && box.current.clientWidth > 0) {
        try {
          f.fit();
        } catch {
          /* not laid out yet */
        }
      }
    });
    ro.observe(box.current!);
    return () => {
      ro.disconnect();
      session.current?.stop();
      t.dispose();
    };
  }, []);

  // Attaches to session pid from `from`: output into the terminal, input and
  // resizes to the session, until it ends or the component goes.
  const attach = (p: number, from: number) => {
    session.current?.stop();
    const t = term.current!;
    let stopped = false;
    let offset = from;
    let ctl: AbortController | undefined;
    const disposers: { dispose(): void }[] = [];

    // Input: coalesced, sent in order (one call in flight at a time).
    let pending = "";
    let timer: number | undefined;
    let sending = false;
    const flush = async () => {
      timer = undefined;
      if (sending || !pending || stopped) return;
      const data = pending;
      pending = "";
      sending = true;
      try {
        await json("POST", `${base}/${p}/input`, { body: { data } });
      } catch (e) {
        if (!stopped) setNote("input: " + (e as Error).message);
      } finally {
        sending = false;
        if (pending) flush();
      }
    };
    const queue = (s: string) => {
      pending += s;
      if (timer === undefined) timer = window.setTimeout(flush, COALESCE_MS);
    };
    disposers.push(t.onData(queue));
    disposers.push(
      t.onBinary((s) => {
        // Bytes (mouse reports of old protocols): as base64, after what is queued.
        const bytes = Uint8Array.from(s, (c) => c.charCodeAt(0) & 0xff);
        const prev = pending;
        pending = "";
        Promise.resolve(prev && json("POST", `${base}/${p}/input`, { body: { data: prev } }))
          .then(() => json("POST", `${base}/${p}/input`, { body: { data_b64: encodeB64(bytes) } }))
          .catch(() => {});
      }),
    );

    // Size: the box's, through fit; debounced to one call.
    let sizeTimer: number | undefined;
    const sendSize = (rows: number, cols: number) => {
      clearTimeout(sizeTimer);
      sizeTimer = window.setTimeout(() => {
        if (!stopped) json("POST", `${base}/${p}/resize`, { body: { rows, cols } }).catch(() => {});
      }, 100);
    };
    disposers.push(t.onResize(({ rows, cols }) => sendSize(rows, cols)));
    sendSize(t.rows, t.cols);

    const stop = () => {
      stopped = true;
      ctl?.abort();
      clearTimeout(timer);
      clearTimeout(sizeTimer);
      disposers.forEach((d) => d.dispose());
    };
    session.current = { pid: p, stop };
    setPid(p);

    (async () => {
      let backoff = 500;
      while (!stopped) {
        ctl = new AbortController();
        try {
          const r = await call("GET", `${base}/${p}/output?follow=true&offset=${offset}&encoding=base64`, {
            signal: ctl.signal,
          });
          setStatus("connected");
          setNote("");
          backoff = 500;
          for await (const ev of ndjson(r)) {
            if (stopped) return;
            if (ev.type === "stdout" || ev.type === "stderr") {
              const b = decodeB64(ev.data_b64 ?? "");
              t.write(b);
              offset = ev.offset + b.length;
            } else if (ev.type === "gap") {
              t.write("\r\n\x1b[33m[output skipped: it left the session's 1 MiB window]\x1b[0m\r\n");
              offset = ev.next;
            } else if (ev.type === "keepalive") {
              offset = Math.max(offset, ev.offset);
            } else if (ev.type === "exit") {
              const why = ev.signal ? "signal " + ev.signal : "exit code " + ev.exit_code;
              t.write(`\r\n\x1b[90m[process ended: ${why}]\x1b[0m\r\n`);
              setStatus("exited");
              sessionStorage.removeItem(storeKey(sandboxId));
              stop();
              return;
            } else if (ev.type === "error") {
              t.write(`\r\n\x1b[31m[session failed: ${ev.error?.message ?? "error"}]\x1b[0m\r\n`);
              setStatus("failed");
              sessionStorage.removeItem(storeKey(sandboxId));
              stop();
              return;
            }
          }
        } catch (e) {
          if (stopped || (e as Error).name === "AbortError") return;
          if (e instanceof ApiError && (e.status === 404 || e.status === 409 || e.status === 401)) {
            setError(e);
            setStatus("failed");
            sessionStorage.removeItem(storeKey(sandboxId));
            stop();
            return;
          }
          setNote((e as Error).message);
        }
        if (stopped) return;
        setStatus("reconnecting");
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 10_000);
      }
    })();
  };

  const start = async () => {
    setError(undefined);
    setStatus("starting");
    const t = term.current!;
    try {
      fit.current?.fit();
    } catch {
      /* hidden */
    }
    try {
      const p = await json<Process>("POST", base, {
        body: { cmd: SHELL, pty: { rows: t.rows, cols: t.cols }, env: { TERM: "xterm-256color" }, tag: "console" },
      });
      sessionStorage.setItem(storeKey(sandboxId), String(p.pid));
      t.reset();
      attach(p.pid, 0);
      t.focus();
    } catch (e) {
      setError(e as Error);
      setStatus("failed");
    }
  };

  // Re-attach to this tab's shell (a reload), else start one, the first
  // time the terminal is shown on a running sandbox.
  useEffect(() => {
    if (!active || !running || started.current) return;
    started.current = true;
    const saved = Number(sessionStorage.getItem(storeKey(sandboxId)));
    (async () => {
      if (saved > 0) {
        try {
          const info = await json<Process & { output_start?: number }>("GET", `${base}/${saved}`);
          if (info.running) {
            attach(saved, info.output_start ?? 0);
            term.current?.focus();
            return;
          }
        } catch {
          /* gone: start a new one */
        }
      }
      start();
    })();
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [active, running]);

  useEffect(() => {
    if (active) {
      try {
        fit.current?.fit();
      } catch {
        /* not laid out */
      }
      term.current?.focus();
    }
  }, [active]);

  const kill = async () => {
    if (pid === null) return;
    try {
      await json("DELETE", `${base}/${pid}`);
    } catch (e) {
      setError(e as Error);
    }
  };

  return (
    <div class="terminal-wrap">
      <div class="toolbar">
        <span class={"badge term-" + status} data-testid="terminal-status">
          {status}
        </span>
        {pid !== null ? <span class="muted">pid {pid}</span> : null}
        {note ? <span class="muted small">{note}</span> : null}
        <span class="spacer" />
        {status === "connected" || status === "reconnecting" ? (
          <button class="btn small danger" onClick={kill}>
            Kill
          </button>
        ) : null}
        {(status === "exited" || status === "failed" || status === "idle") && running ? (
          <button class="btn small" onClick={start} data-testid="terminal-new">
            New shell
          </button>
        ) : null}
      </div>
      <ErrorBox error={error} what="terminal" />
      {!running ? <div class="notice">The sandbox is not running: no terminal.</div> : null}
      <div class="terminal" data-testid="terminal">
        <div ref={box} class="terminal-screen" />
      </div>
    </div>
  );
}
