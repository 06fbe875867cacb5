// A file browser over /v1/sandboxes/{id}/files: list, stat, mkdir, delete,
// download (fetch → Blob: held in the browser's memory, so meant for files
// up to some hundreds of MiB) and upload (PUT with the File as the body,
// streamed by the browser).
import { useState } from "preact/hooks";
import { call, enc, json, saveBlob, sbPath, type FileEntry } from "../api";
import { bytes, dateTime, modeString } from "../format";
import { usePoll } from "../hooks";
import { ErrorBox, KV, Loading } from "./common";

const join = (dir: string, name: string) => (dir === "/" ? "/" + name : dir + "/" + name);
const parent = (dir: string) => (dir === "/" ? "/" : dir.slice(0, dir.lastIndexOf("/")) || "/");

export function Files({ sandboxId, path, onPath }: { sandboxId: string; path: string; onPath: (p: string) => void }) {
  const base = sbPath(sandboxId) + "/files";
  const list = usePoll(
    (signal) => json<{ entries: FileEntry[] }>("GET", `${base}/list?path=${enc(path)}`, { signal }),
    0,
    [sandboxId, path],
  );
  const [busy, setBusy] = useState("");
  const [error, setError] = useState<Error | undefined>();
  const [stat, setStat] = useState<unknown>(null);
  const [newDir, setNewDir] = useState("");

  const act = async (what: string, fn: () => Promise<unknown>) => {
    setBusy(what);
    setError(undefined);
    try {
      await fn();
    } catch (e) {
      setError(e as Error);
    } finally {
      setBusy("");
    }
  };

  const download = (name: string) =>
    act("downloading " + name, async () => {
      const r = await call("GET", `${base}?path=${enc(join(path, name))}`);
      saveBlob(await r.blob(), name);
    });

  const upload = (files: FileList | null) => {
    if (!files || !files.length) return;
    act("uploading", async () => {
      for (const f of Array.from(files)) {
        // A name is one path component: a "/" in it would name a directory.
        if (f.name.includes("/") || f.name === "." || f.name === "..") {
          throw new Error(`cannot upload "${f.name}": a file name cannot contain "/" or be "." or ".."`);
        }
        setBusy(`uploading ${f.name} (${bytes(f.size)})`);
        await call("PUT", `${base}?path=${enc(join(path, f.name))}`, { body: f });
      }
      list.refresh();
    });
  };

  const remove = (e: FileEntry) => {
    const dir = e.type === "dir" || e.type === "directory";
    if (!confirm(`Delete ${join(path, e.name)}${dir ? " and everything in it" : ""}?`)) return;
    act("deleting " + e.name, async () => {
      await json("DELETE", `${base}?path=${enc(join(path, e.name))}${dir ? "&recursive=true" : ""}`);
      list.refresh();
    });
  };

  const mkdir = (ev: Event) => {
    ev.preventDefault();
    const name = newDir.trim();
    if (!name) return;
    act("mkdir", async () => {
      await json("POST", `${base}/mkdir`, { body: { path: name.startsWith("/") ? name : join(path, name), parents: true } });
      setNewDir("");
      list.refresh();
    });
  };

  const showStat = (name: string) =>
    act("stat", async () => setStat(await json("GET", `${base}/stat?path=${enc(join(path, name))}`)));

  // The path as links, one per directory.
  const crumbs: [string, string][] = [["/", "/"]];
  let acc = "";
  for (const seg of path.split("/").filter(Boolean)) {
    acc += "/" + seg;
    crumbs.push([seg, acc]);
  }

  const entries = (list.data?.entries || []).slice().sort((a, b) => {
    const da = a.type === "dir" || a.type === "directory" ? 0 : 1;
    const db = b.type === "dir" || b.type === "directory" ? 0 : 1;
    return da - db || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
  });

  return (
    <div class="files" data-testid="files">
      <div class="toolbar">
        <span class="crumbs" data-testid="files-path">
          {crumbs.map(([label, p], i) => (
            <>
              {i > 1 ? <span class="sep">/</span> : null}
              <a href="#" onClick={(e) => (e.preventDefault(), onPath(p))}>
                {label}
              </a>
            </>
          ))}
        </span>
        <span class="spacer" />
        <form class="inline" onSubmit={mkdir}>
          <input
            value={newDir}
            onInput={(e) => setNewDir((e.target as HTMLInputElement).value)}
            placeholder="new directory"
            data-testid="files-mkdir-name"
          />
          <button class="btn small" type="submit" data-testid="files-mkdir">
            Make dir
          </button>
        </form>
        <label class="btn small primary upload">
          Upload…
          <input
            type="file"
            multiple
            data-testid="file-upload"
            onChange={(e) => {
              const input = e.target as HTMLInputElement;
              upload(input.files);
              input.value = "";
            }}
          />
        </label>
        <button class="btn small" onClick={list.refresh}>
          Refresh
        </button>
      </div>
      {busy ? <div class="muted small" data-testid="files-busy">{busy}…</div> : null}
      <ErrorBox error={error} />
      <ErrorBox error={list.error} what={"list " + path} />
      {list.loading && !list.data ? <Loading /> : null}
      {list.data ? (
        <table class="grid files-table">
          <thead>
            <tr>
              <th>name</th>
              <th>type</th>
              <th class="num">size</th>
              <th>mode</th>
              <th>owner</th>
              <th>modified</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {path !== "/" ? (
              <tr>
                <td colSpan={7}>
                  <a href="#" onClick={(e) => (e.preventDefault(), onPath(parent(path)))}>
                    ..
                  </a>
                </td>
              </tr>
            ) : null}
            {entries.map((e) => {
              const dir = e.type === "dir" || e.type === "directory";
              return (
                <tr data-testid="file-row" data-name={e.name}>
                  <td class="name">
                    {dir ? (
                      <a href="#" onClick={(ev) => (ev.preventDefault(), onPath(join(path, e.name)))}>
                        {e.name}/
                      </a>
                    ) : e.type === "file" || e.type === "regular" ? (
                      <a href="#" title="download" data-testid="file-download" onClick={(ev) => (ev.preventDefault(), download(e.name))}>
                        {e.name}
                      </a>
                    ) : (
                      <span>{e.name}</span>
                    )}
                  </td>
                  <td>{e.type}</td>
                  <td class="num">{dir ? "" : bytes(e.size)}</td>
                  <td class="mono">{modeString(e.mode)}</td>
                  <td class="mono">
                    {e.uid ?? "–"}:{e.gid ?? "–"}
                  </td>
                  <td>{dateTime(e.mtime)}</td>
                  <td class="actions">
                    <button class="btn tiny" onClick={() => showStat(e.name)}>
                      stat
                    </button>
                    <button class="btn tiny danger" onClick={() => remove(e)} data-testid="file-delete">
                      delete
                    </button>
                  </td>
                </tr>
              );
            })}
            {entries.length === 0 ? (
              <tr>
                <td colSpan={7} class="muted">
                  empty directory
                </td>
              </tr>
            ) : null}
          </tbody>
        </table>
      ) : null}
      {stat ? (
        <div class="stat">
          <KV rows={Object.entries(stat as Record<string, unknown>).map(([k, v]) => [k, String(v)])} />
          <button class="btn tiny" onClick={() => setStat(null)}>
            close
          </button>
        </div>
      ) : null}
    </div>
  );
}
