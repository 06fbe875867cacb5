// Formatting helpers: every one returns plain text (rendered as text nodes).

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  let v = n;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)) + " " + units[i];
}

export function num(n: number | null | undefined, digits = 2): string {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  if (Number.isInteger(n)) return n.toLocaleString("en-US");
  return n.toFixed(digits);
}

function toMs(t: string | number | null | undefined): number | null {
  if (t === null || t === undefined || t === "") return null;
  if (typeof t === "number") return t > 1e12 ? t : t * 1000; // seconds or ms
  const ms = Date.parse(t);
  return isNaN(ms) ? null : ms;
}

export function dateTime(t: string | number | null | undefined): string {
  const ms = toMs(t);
  if (ms === null) return "–";
  const d = new Date(ms);
  const p = (x: number) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

export function duration(s: number | null | undefined): string {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.round((s % 86400) / 3600) + " h";
}

export function ago(t: string | number | null | undefined, now = Date.now()): string {
  const ms = toMs(t);
  if (ms === null) return "–";
  const s = (now - ms) / 1000;
  if (s < 0) return "in " + duration(-s);
  if (s < 5) return "just now";
  return duration(s).replace(/ \d+ (s|min|h)$/, "") + " ago";
}

// 0o40755 / 493 -> "rwxr-xr-x"
export function modeString(mode: number | null | undefined): string {
  if (mode === null || mode === undefined) return "–";
  const r = "rwxrwxrwx";
  let s = "";
  for (let i = 0; i < 9; i++) s += mode & (1 << (8 - i)) ? r[i] : "-";
  return s;
}

export function shortDigest(d: string | null | undefined): string {
  if (!d) return "–";
  return d.replace(/^sha256:/, "").slice(0, 12);
}

export function decodeB64(b64: string): Uint8Array {
  const s = atob(b64);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

export function encodeB64(bytes: Uint8Array): string {
  let s = "";
  for (let i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]);
  return btoa(s);
}

// Text of bytes if they are UTF-8, else null.
export function utf8OrNull(b: Uint8Array): string | null {
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(b);
  } catch {
    return null;
  }
}

// A link target the console may render: http(s) URLs and same-origin paths only.
export function safeHref(u: string | null | undefined): string | undefined {
  if (!u) return undefined;
  if (u.startsWith("/") && !u.startsWith("//")) return u;
  try {
    const p = new URL(u);
    return p.protocol === "http:" || p.protocol === "https:" ? p.href : undefined;
  } catch {
    return undefined;
  }
}
