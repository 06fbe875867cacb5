// Images and layers: /v1/images (one image's stored vs logical bytes from
// /v1/images/{ref}), /v1/layers (admins), and which sandboxes use each image
// (client side: a live sandbox whose layer stack holds all the image's
// layers).
import { useState } from "preact/hooks";
import { ApiError, getImage, listImages, listLayers, listSandboxes, type Image, type Sandbox } from "../api";
import { ErrorBox, JsonBlock, KV, Loading, Mono, Section, StateBadge } from "../components/common";
import { ago, bytes, dateTime, shortDigest } from "../format";
import { href, usePoll } from "../hooks";

const LIVE = new Set(["creating", "running", "paused", "lost", "stopping"]);

function users(img: Image, sandboxes: Sandbox[]): Sandbox[] {
  if (!img.layers.length) return sandboxes.filter((s) => s.image === img.ref);
  return sandboxes.filter((s) => {
    if (!LIVE.has(s.state)) return false;
    const have = new Set(s.layers || []);
    return img.layers.every((l) => have.has(l)) || s.image === img.ref;
  });
}

function ImageDetail({ img, used }: { img: Image; used: Sandbox[] }) {
  const one = usePoll(() => getImage(img.ref), 0, [img.ref]);
  const d = one.data;
  return (
    <div class="image-detail">
      <ErrorBox error={one.error} />
      {one.loading ? <Loading /> : null}
      {d ? (
        <div class="grid2">
          <KV
            rows={[
              ["logical bytes", bytes(d.logical_bytes)],
              ["stored bytes", bytes(d.stored_bytes)],
              ["owner / visibility", `${d.owner || "–"} / ${d.visibility || "–"}`],
              ["user / working dir", `${d.config?.user || "–"} / ${d.config?.working_dir || "–"}`],
              ["env", (d.config?.env || []).join(" ")],
              ["layers (bottom first)", <div>{d.layers.map((l) => <div><Mono title={l}>{shortDigest(l)}</Mono></div>)}</div>],
            ]}
          />
          <div>
            {d.parent ? (
              <>
                <h3>parent</h3>
                <JsonBlock value={d.parent} />
              </>
            ) : null}
            {d.source ? (
              <>
                <h3>source</h3>
                <JsonBlock value={d.source} />
              </>
            ) : null}
          </div>
        </div>
      ) : null}
      <h3>Used by {used.length} live sandbox(es)</h3>
      {used.length ? (
        <div class="users">
          {used.slice(0, 200).map((s) => (
            <span class="user">
              <a class="mono" href={href(["sandboxes", s.id])}>
                {s.id}
              </a>{" "}
              <StateBadge state={s.state} />
            </span>
          ))}
        </div>
      ) : null}
    </div>
  );
}

export function Images() {
  const images = usePoll((signal) => listImages(signal), 15000, []);
  const sandboxes = usePoll((signal) => listSandboxes([], null, signal, 10000), 15000, []);
  const layers = usePoll((signal) => listLayers(signal), 30000, []);
  const [open, setOpen] = useState<string | null>(null);
  const [q, setQ] = useState("");
  const all = sandboxes.data?.sandboxes || [];
  const rows = (images.data?.images || [])
    .filter((i) => !q || i.ref.toLowerCase().includes(q.toLowerCase()))
    .sort((a, b) => a.ref.localeCompare(b.ref));
  const layerAdminOnly = layers.error instanceof ApiError && layers.error.status === 403;
  const layerRows = (layers.data?.layers || []).slice().sort((a, b) => (b.size + (b.data?.size || 0)) - (a.size + (a.data?.size || 0)));
  const totalLayerBytes = layerRows.reduce((n, l) => n + l.size + (l.data?.size || 0), 0);

  return (
    <div class="page">
      <div class="page-head">
        <h1>Images</h1>
        <span class="muted">{images.data ? rows.length : ""}</span>
        <span class="spacer" />
        <input placeholder="search ref" value={q} onInput={(e) => setQ((e.target as HTMLInputElement).value)} />
      </div>
      <ErrorBox error={images.error} what="list images" />
      <ErrorBox error={sandboxes.error} what="list sandboxes" />
      {images.loading && !images.data ? <Loading /> : null}
      {images.data ? (
        <table class="grid" data-testid="images-table">
          <thead>
            <tr>
              <th>ref</th>
              <th>kind</th>
              <th class="num">layers</th>
              <th class="num">size</th>
              <th>owner</th>
              <th>created</th>
              <th class="num">live sandboxes</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((img) => {
              const used = users(img, all);
              const isOpen = open === img.ref;
              return (
                <>
                  <tr class="clickable" data-testid={"image-row-" + img.ref} onClick={() => setOpen(isOpen ? null : img.ref)}>
                    <td class="mono">
                      {isOpen ? "▾ " : "▸ "}
                      {img.ref}
                    </td>
                    <td>{img.kind}</td>
                    <td class="num">{img.layers.length}</td>
                    <td class="num">{bytes(img.size)}</td>
                    <td>
                      {img.owner || "–"}
                      {img.visibility === "private" ? <span class="muted small"> (private)</span> : null}
                    </td>
                    <td title={dateTime(img.created_at)}>{ago(img.created_at)}</td>
                    <td class="num">{sandboxes.data ? used.length : "…"}</td>
                  </tr>
                  {isOpen ? (
                    <tr class="detail">
                      <td colSpan={7}>
                        <ImageDetail img={img} used={used} />
                      </td>
                    </tr>
                  ) : null}
                </>
              );
            })}
          </tbody>
        </table>
      ) : null}

      <Section
        title="Layers"
        testid="layers"
        extra={layers.data ? <span class="muted">{layerRows.length} layers, {bytes(totalLayerBytes)} stored</span> : null}
      >
        {layerAdminOnly ? (
          <div class="notice admin-only" data-testid="admin-only">
            Admin only: the layer store is shared by every tenant.
          </div>
        ) : (
          <ErrorBox error={layers.error} what="list layers" />
        )}
        {layers.data ? (
          <table class="grid compact">
            <thead>
              <tr>
                <th>digest</th>
                <th>kind</th>
                <th class="num">metadata</th>
                <th class="num">data</th>
                <th>images</th>
                <th>in use</th>
                <th>created</th>
              </tr>
            </thead>
            <tbody>
              {layerRows.map((l) => (
                <tr>
                  <td>
                    <Mono title={l.digest}>{shortDigest(l.digest)}</Mono>
                  </td>
                  <td>{l.kind || "–"}</td>
                  <td class="num">{bytes(l.size)}</td>
                  <td class="num">{l.data ? bytes(l.data.size) : "–"}</td>
                  <td class="small">{l.images.join(", ") || <span class="muted">none (GC candidate)</span>}</td>
                  <td>{l.in_use ? "yes" : "no"}</td>
                  <td title={dateTime(l.created_at)}>{ago(l.created_at)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        ) : null}
      </Section>
    </div>
  );
}
