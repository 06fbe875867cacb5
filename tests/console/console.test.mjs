// The web console (/ui, docs/console.md) in a real browser: Debian's chromium
// driven by playwright-core, against a running `dsec up`. Run by
// tests/test_console.py, which makes the tenants and keys and passes them in
// the environment:
//
//   DSEC_URL            the platform (http://127.0.0.1:PORT)
//   DSEC_ADMIN_TOKEN    the platform's token
//   DSEC_TENANT_A/B     two user tenants; DSEC_KEY_A/B a key of each
//   DSEC_IMAGE          the debian test image (python3 inside)
//   DSEC_TRAJECTORY_ID  the id of the trajectory the helper makes (tenant A)
//   DSEC_SHOTS          where the screenshots go (NN-name.png)
//   DSEC_PORT_SERVER    tests/port_server.py
//   DSEC_CHROMIUM_PROFILE  an empty directory for chromium's profile (optional)
//
// SDK actions while the browser is open go through sdk_helper.py (python3,
// PYTHONPATH=sdk/python). The steps share one browser and one sandbox and
// run in order; a step whose prerequisite failed is skipped, not failed
// again. Every wait has a timeout; nothing sleeps a fixed time.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set (tests/test_console.py sets it)`);
  return v;
};
const URL_ = env("DSEC_URL").replace(/\/$/, "");
const ADMIN = env("DSEC_ADMIN_TOKEN");
const TENANT_A = env("DSEC_TENANT_A");
const KEY_A = env("DSEC_KEY_A");
const KEY_B = env("DSEC_KEY_B");
const IMAGE = env("DSEC_IMAGE");
const TRAJ = env("DSEC_TRAJECTORY_ID");
const SHOTS = env("DSEC_SHOTS");
const PORT_SERVER = env("DSEC_PORT_SERVER");

const XSS = "<img src=x onerror=window.__xss=1>";
const WEIRD = `<b>x<\\b>&"'.txt`; // a file name with markup and quotes, no "/"
const CHROMIUM_ARGS = [
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--host-resolver-rules=MAP *.localhost 127.0.0.1",
];
const WAIT = 15_000; // default for one element or condition

// ----- shared state ----------------------------------------------------------------

let ctx; // the browser context (a fresh user data dir)
let userDir;
let ownDir;
let page; // the console, signed in as tenant A
let portPage; // the exposed port's page, with its WebSocket open
const pages = []; // every console page opened (for the __xss check)
const pageErrors = []; // uncaught exceptions in any page
const xRequests = []; // requests for the XSS payload's image (must stay empty)
const st = {}; // what the steps found: sandbox, trajectory, ...

// ----- helpers ---------------------------------------------------------------------

function helper(cmd, args, key = KEY_A) {
  const out = execFileSync("python3", [path.join(HERE, "sdk_helper.py"), cmd, JSON.stringify(args)], {
    env: { ...process.env, DSEC_KEY: key },
    encoding: "utf8",
    timeout: 180_000,
    stdio: ["ignore", "pipe", "pipe"],
  });
  return JSON.parse(out.trim().split("\n").pop());
}

// The viewport (1280x800), or only `el` when given.
async function shot(p, name, el) {
  await (el || p).screenshot({ path: path.join(SHOTS, name + ".png") });
}

// The steps run in order; `needs` names what earlier steps must have found.
function step(name, needs, fn, timeout = 120_000) {
  test(name, { timeout }, async (t) => {
    const missing = needs.filter((k) => st[k] === undefined);
    if (missing.length) {
      t.skip(`needs ${missing.join(", ")} from an earlier step that failed`);
      return;
    }
    try {
      await fn(t);
    } catch (e) {
      const tag = name.split(" ")[0];
      for (const p of [page, portPage].filter((p) => p && !p.isClosed())) {
        await shot(p, `${tag}-FAILED-${p === page ? "console" : "port"}`).catch(() => {});
      }
      throw e;
    }
  });
}

async function openConsole(key) {
  const p = await ctx.newPage();
  p.setDefaultTimeout(WAIT);
  pages.push(p);
  await p.goto(URL_ + "/ui");
  await p.getByTestId("login-key").fill(key);
  await p.getByTestId("login-submit").click();
  await p.getByTestId("whoami").waitFor();
  return p;
}

async function noXss(p) {
  if (p.isClosed()) return;
  assert.equal(await p.evaluate(() => typeof window.__xss), "undefined", `window.__xss was set on ${p.url()}`);
  assert.equal(await p.locator('img[src="x"]').count(), 0, `an <img src=x> element on ${p.url()}`);
}

const sha256 = (b) => createHash("sha256").update(b).digest("hex");

// ----- the browser -----------------------------------------------------------------

before(async () => {
  fs.mkdirSync(SHOTS, { recursive: true });
  // A fresh profile: the one test_console.py made (and removes), else our own.
  userDir = process.env.DSEC_CHROMIUM_PROFILE || fs.mkdtempSync(path.join(os.tmpdir(), "dsec-console-chromium-"));
  ownDir = !process.env.DSEC_CHROMIUM_PROFILE;
  ctx = await chromium.launchPersistentContext(userDir, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: CHROMIUM_ARGS,
    viewport: { width: 1280, height: 800 },
    acceptDownloads: true,
    timeout: 60_000,
  });
  ctx.on("page", (p) => p.on("pageerror", (e) => pageErrors.push(`${p.url()}: ${e.message}`)));
  ctx.on("request", (r) => {
    if (/\/x(\?|$)/.test(new URL(r.url()).pathname + new URL(r.url()).search)) xRequests.push(r.url());
  });
});

after(async () => {
  await ctx?.close().catch(() => {});
  if (userDir && ownDir) fs.rmSync(userDir, { recursive: true, force: true });
});

// ----- the steps -------------------------------------------------------------------

step("01 login: a bad key is refused, tenant A's key opens the sandboxes page", [], async () => {
  page = await ctx.newPage();
  page.setDefaultTimeout(WAIT);
  pages.push(page);
  await page.goto(URL_ + "/ui");
  assert.match(page.url(), /\/ui\/$/, "/ui redirects to /ui/");
  await page.getByTestId("login-key").waitFor();
  await page.getByTestId("login-key").fill("dsk_not_a_key_" + randomBytes(8).toString("hex"));
  await page.getByTestId("login-submit").click();
  const err = page.getByTestId("login-error");
  await err.waitFor();
  assert.match(await err.textContent(), /not valid/i);
  await shot(page, "01-login", page.locator(".login-card"));
  await page.getByTestId("login-key").fill(KEY_A);
  await page.getByTestId("login-submit").click();
  await page.getByTestId("sb-table").waitFor();
  assert.match(await page.getByTestId("whoami").textContent(), new RegExp(TENANT_A));
  assert.match(page.url(), /#\/sandboxes/);
  assert.equal(await page.evaluate(() => localStorage.length), 0, "nothing in localStorage");
  assert.equal((await ctx.cookies(URL_)).length, 0, "the console sets no cookie");
  st.login = true;
});

step("02 sandboxes: an SDK-made sandbox appears live; its HTML label is text; label filter", ["login"], async () => {
  await page.evaluate(() => (window.__marker = 1));
  const t0 = Date.now();
  const { id } = helper("create", { image: IMAGE, labels: { xss: XSS, "console-test": "live" } });
  st.sandbox = id;
  const row = page.getByTestId("sb-row-" + id);
  await row.waitFor({ timeout: 10_000 });
  const seenAfter = Date.now() - t0;
  assert.equal(await page.evaluate(() => window.__marker), 1, "the page was not reloaded");
  // The label as literal text, and no element made of it.
  const xssLabel = row.locator(".label", { hasText: "xss=" });
  assert.equal(await xssLabel.textContent(), "xss=" + XSS);
  assert.equal(await row.locator("img").count(), 0);
  await row.getByText("running").waitFor(); // the state follows without a reload too
  // The label filter, typed: a match keeps the row, another value hides it.
  const filter = page.getByTestId("filter-labels");
  await filter.fill("console-test=none");
  await filter.press("Enter");
  await page.getByText("No sandbox matches.").waitFor();
  assert.equal(await row.count(), 0);
  await filter.fill("console-test=live");
  await filter.press("Enter");
  await row.waitFor();
  assert.match(decodeURIComponent(page.url()), /label=console-test=live/);
  assert.equal(await page.locator('tr[data-testid^="sb-row-"]').count(), 1);
  // A click on a label filters by it: here the one with markup and spaces,
  // which must reach the server intact (?label=xss=<img …>).
  await page.locator(".chip.clear").click();
  await page.waitForFunction(() => !location.hash.includes("label="));
  await row.locator(".label", { hasText: "xss=" }).click();
  await page.waitForFunction(() => location.hash.includes("label=xss"));
  await row.waitFor();
  await page.waitForFunction(() => document.querySelectorAll('tr[data-testid^="sb-row-"]').length === 1);
  assert.equal(await page.getByTestId("filter-labels").inputValue(), "xss=" + XSS);
  // Focus and leave the filter box (a blur applies it): the picked label,
  // whose value has spaces, must stay one label.
  await page.getByTestId("filter-labels").focus();
  await page.getByTestId("filter-search").focus();
  assert.equal(decodeURIComponent(page.url()).match(/label=/g).length, 1, page.url());
  // Still there after a few polls (a filter that broke would empty it).
  await page.waitForResponse((r) => r.url().includes("/v1/sandboxes?label=") && r.status() === 200);
  await page.waitForResponse((r) => r.url().includes("/v1/sandboxes?label=") && r.status() === 200);
  assert.equal(await row.count(), 1);
  await shot(page, "02-sandboxes");
  await noXss(page);
  await page.locator(".chip.clear").click();
  console.log(`# the new sandbox's row appeared ${seenAfter} ms after the create call`);
});

step("03 sandbox page: spec, policy and phases, audit, the stats chart", ["sandbox"], async () => {
  await page.goto(`${URL_}/ui/#/sandboxes`);
  await page.getByTestId("sb-row-" + st.sandbox).locator("a").first().click();
  await page.getByTestId("sb-id").waitFor();
  assert.equal(await page.getByTestId("sb-id").textContent(), st.sandbox);
  const spec = page.getByTestId("sb-spec");
  await spec.getByText(IMAGE).waitFor();
  assert.ok((await spec.textContent()).includes("xss=" + XSS), "the spec shows the label as text");
  assert.equal(await spec.locator("img").count(), 0);
  const policy = page.getByTestId("sb-policy");
  assert.match(await policy.textContent(), /policy/);
  assert.ok((await policy.locator("strong").textContent()).length > 0, "a policy name");
  const audit = page.getByTestId("sb-audit");
  await audit.getByText("syscalls refused").waitFor();
  // The page samples the record every 5 s: two samples within 15 s.
  const chart = page.getByTestId("chart-memory");
  await page.waitForFunction(
    () => Number(document.querySelector('[data-testid="chart-memory"]')?.dataset.points) >= 2,
    null,
    { timeout: 20_000 },
  );
  assert.equal(await chart.locator("canvas").count(), 1);
  assert.equal(await chart.getByText("collecting samples").count(), 0);
  await shot(page, "03-sandbox");
  await page.getByTestId("sb-stats").scrollIntoViewIfNeeded();
  await shot(page, "03-sandbox-stats");
  await noXss(page);
  st.overview = true;
});

step("04 terminal: a command typed in xterm runs and its output shows", ["sandbox"], async () => {
  await page.getByTestId("tab-terminal").click();
  await page.getByTestId("terminal-status").getByText("connected").waitFor({ timeout: 20_000 });
  const term = page.getByTestId("terminal");
  // The shell's prompt first, so the keys reach a shell that reads them.
  await page.waitForFunction(
    () => (document.querySelector('[data-testid="terminal"] .xterm-rows')?.textContent || "").trim().length > 0,
  );
  await term.click();
  await page.keyboard.type("echo hi-$((6*7))");
  await page.keyboard.press("Enter");
  await page.waitForFunction(() =>
    (document.querySelector('[data-testid="terminal"] .xterm-rows')?.textContent || "").includes("hi-42"),
  );
  await shot(page, "04-terminal");
  await noXss(page);
});

step("05 files: upload 5 MB and a name with markup; the name is text; download matches", ["sandbox"], async () => {
  await page.goto(`${URL_}/ui/#/sandboxes/${st.sandbox}/files?path=/tmp`);
  const files = page.getByTestId("files");
  await files.waitFor();
  await page.getByTestId("files-path").getByText("tmp").waitFor();
  const big = randomBytes(5 * 1024 * 1024);
  await page.getByTestId("file-upload").setInputFiles([
    { name: "big.bin", mimeType: "application/octet-stream", buffer: big },
    { name: WEIRD, mimeType: "text/plain", buffer: Buffer.from("weird name\n") },
  ]);
  const bigRow = files.locator('tr[data-testid="file-row"][data-name="big.bin"]');
  const weirdRow = files.locator(`tr[data-testid="file-row"]`).filter({ has: page.getByText(WEIRD, { exact: true }) });
  await bigRow.waitFor({ timeout: 30_000 });
  await weirdRow.waitFor();
  assert.equal(await weirdRow.getAttribute("data-name"), WEIRD);
  assert.equal(await weirdRow.locator("td.name").textContent(), WEIRD);
  assert.equal(await files.locator("b").count(), 0, "no <b> element made of the file name");
  assert.equal(await page.locator("b").count(), 0, "no <b> element anywhere");
  assert.match(await bigRow.textContent(), /5(\.0+)? MiB/);
  const [download] = await Promise.all([
    page.waitForEvent("download", { timeout: 30_000 }),
    bigRow.getByTestId("file-download").click(),
  ]);
  assert.equal(download.suggestedFilename(), "big.bin");
  const got = fs.readFileSync(await download.path());
  assert.equal(got.length, big.length);
  assert.equal(sha256(got), sha256(big), "the download's sha256 is the upload's");
  await download.delete();
  await shot(page, "05-files");
  await noXss(page);
});

step("06 trajectory: steps in order, replayed vs executed, checkpoint; Recover shows the new sandbox", ["login"], async () => {
  const made = helper("trajectory", { image: IMAGE, trajectory_id: TRAJ });
  assert.equal(made.trajectory_id, TRAJ);
  await page.getByTestId("nav-trajectories").click();
  const row = page.getByTestId("traj-row-" + TRAJ);
  await row.waitFor();
  assert.equal(await row.locator("td.num").textContent(), String(made.steps));
  await row.locator("a").click();
  await page.getByTestId("traj-steps").waitFor();
  const order = await page
    .locator('[data-testid="traj-steps"] tr[data-testid^="step-row-"]')
    .evaluateAll((rows) => rows.map((r) => [r.dataset.testid.slice(9), r.querySelector(".badge").textContent]));
  assert.deepEqual(order, [
    ["0", "exec"],
    ["1", "exec"],
    ["2", "write"],
    ["3", "checkpoint"],
    ["4", "exec"],
    ["5", "exec"],
  ]);
  await page.getByTestId("traj-checkpoint-" + made.checkpoint_step).waitFor();
  // Replays (…/info): steps 0 and 1 were asked twice more and answered from the log.
  const ran = (n) => page.getByTestId("step-ran-" + n);
  await ran(0).getByText("replayed ×2").waitFor();
  assert.match(await ran(1).textContent(), /^executed\s*replayed ×2$/);
  assert.equal((await ran(4).textContent()).trim(), "executed");
  assert.equal(await page.getByTestId("traj-recoveries").count(), 0, "no recovery yet");
  await shot(page, "06-trajectory");

  await page.getByTestId("recover-button").click();
  const result = page.getByTestId("recover-result");
  await result.waitFor({ timeout: 120_000 });
  const newId = (await page.getByTestId("recover-sandbox").textContent()).trim();
  assert.match(newId, /^sb-/);
  assert.notEqual(newId, made.sandbox);
  assert.match(await result.textContent(), /From checkpoint step 3 .*2 step\(s\) re-executed, 0 diverged/);
  st.recovered = newId;
  // The stored recovery, from …/info, and the steps marked by it; also after a reload.
  for (const reload of [false, true]) {
    if (reload) {
      await page.reload();
      await page.getByTestId("traj-steps").waitFor();
    }
    const rec = page.getByTestId("recovery-row-0");
    await rec.waitFor();
    const text = await rec.textContent();
    assert.ok(text.includes(made.sandbox) && text.includes(newId), text);
    assert.match(text, /checkpoint step 3/);
    assert.equal(await page.getByTestId("traj-recoveries").locator("tbody tr").count(), 1);
    assert.ok((await page.getByTestId("traj-sandbox").textContent()).includes(newId));
    assert.equal((await ran(2).textContent()).trim(), "in checkpoint");
    assert.equal((await ran(4).textContent()).trim(), "re-executed");
    assert.equal((await ran(5).textContent()).trim(), "re-executed");
    assert.match(await ran(0).textContent(), /^in checkpoint\s*replayed ×2$/);
  }
  await shot(page, "06-trajectory-recovered");
  // The new sandbox, opened from the trajectory.
  await page.getByTestId("traj-sandbox").locator("a").click();
  await page.getByTestId("sb-id").getByText(newId).waitFor();
  await page.locator(".page-head .badge", { hasText: "running" }).waitFor({ timeout: 30_000 });
  await noXss(page);
});

step("07 exposed port: its page through the host form, a WebSocket echo; the console's ports panel", ["sandbox"], async () => {
  const ex = helper("serve", { id: st.sandbox, ports: [8000, 8001], expose: 8000, script: PORT_SERVER });
  assert.match(ex.url, new RegExp(`^http://8000-${st.sandbox}\\.localhost:\\d+/\\?dsec_token=dpt_`));
  portPage = await ctx.newPage();
  portPage.setDefaultTimeout(WAIT);
  const resp = await portPage.goto(ex.url);
  assert.equal(resp.status(), 200);
  const redirect = resp.request().redirectedFrom();
  assert.ok(redirect, "the URL with the token redirects");
  assert.equal((await redirect.response()).status(), 302);
  assert.ok(!portPage.url().includes("dsec_token"), "the token left the address bar: " + portPage.url());
  assert.equal(await portPage.locator("#hello").textContent(), "hello from the sandbox");
  const cookies = await ctx.cookies(portPage.url());
  assert.ok(cookies.some((c) => c.name === "dsec_port" && c.httpOnly), JSON.stringify(cookies));
  assert.equal((await ctx.cookies(URL_)).length, 0, "no cookie on the console's origin");
  const echo = await portPage.evaluate(
    () =>
      new Promise((resolve, reject) => {
        const ws = new WebSocket("ws://" + location.host + "/ws");
        window.__ws = ws;
        window.__wsClosed = null;
        ws.onclose = (e) => (window.__wsClosed = { code: e.code, at: Date.now() });
        ws.onopen = () => ws.send("ping through the platform");
        ws.onmessage = (m) => resolve(m.data);
        ws.onerror = () => reject(new Error("WebSocket error"));
        setTimeout(() => reject(new Error("no echo within 10 s")), 10_000);
      }),
  );
  assert.equal(echo, "ping through the platform");
  await shot(portPage, "07-port-page");
  st.ws = true;

  // The console's ports panel: expose 8001, follow its link.
  await page.goto(`${URL_}/ui/#/sandboxes/${st.sandbox}/ports`);
  await page.getByTestId("port-row-8000").waitFor();
  await page.getByTestId("port-input").fill("8001");
  await page.getByTestId("port-expose").click();
  const link = page.getByTestId("port-link-8001");
  await link.waitFor();
  const href = await link.getAttribute("href");
  assert.match(href, new RegExp(`^http://8001-${st.sandbox}\\.localhost:\\d+/\\?dsec_token=dpt_`));
  assert.ok(!(await link.textContent()).includes("dpt_"), "the token is in the link, not its text");
  assert.equal(await link.getAttribute("rel"), "noopener noreferrer");
  await shot(page, "07-ports");
  const [opened] = await Promise.all([ctx.waitForEvent("page"), link.click()]);
  await opened.locator("#hello").waitFor();
  assert.ok(opened.url().startsWith(`http://8001-${st.sandbox}.localhost:`), opened.url());
  assert.equal(await opened.evaluate(() => window.opener), null, "no opener");
  await opened.close();
  await noXss(page);
});

step("08 stop from the console: the open WebSocket closes within 5 s", ["sandbox", "ws"], async () => {
  await page.goto(`${URL_}/ui/#/sandboxes/${st.sandbox}`);
  await page.getByTestId("sb-stop").waitFor();
  assert.equal(await portPage.evaluate(() => window.__wsClosed), null, "the WebSocket is open");
  page.once("dialog", (d) => d.accept());
  const t0 = Date.now();
  await page.getByTestId("sb-stop").click();
  await portPage.waitForFunction(() => window.__wsClosed !== null, null, { timeout: 5_000 });
  const closed = await portPage.evaluate(() => window.__wsClosed);
  const took = closed.at - t0;
  assert.ok(took <= 5_000, `closed after ${took} ms`);
  await page.locator(".page-head .badge", { hasText: /stopp/ }).waitFor({ timeout: 30_000 });
  await shot(page, "08-stopped");
  console.log(`# the WebSocket closed ${took} ms after the click on Stop (code ${closed.code})`);
});

step("09 no script ran from any label or name; tenant B sees none of A's", ["login"], async () => {
  for (const p of pages) await noXss(p);
  assert.deepEqual(xRequests, [], "the XSS payload's image was requested");
  const b = await openConsole(KEY_B);
  await b.getByTestId("sb-table").waitFor();
  await b.getByText("No sandbox matches.").waitFor();
  for (const id of [st.sandbox, st.recovered].filter(Boolean)) {
    assert.equal(await b.getByTestId("sb-row-" + id).count(), 0);
  }
  await shot(b, "09-tenant-b");
  if (st.sandbox) {
    await b.goto(`${URL_}/ui/#/sandboxes/${st.sandbox}`);
    await b.getByTestId("error").first().waitFor();
    assert.match(await b.getByTestId("error").first().textContent(), /404|not found/i);
  }
  await b.goto(`${URL_}/ui/#/trajectories`);
  await b.getByTestId("traj-table").waitFor();
  assert.equal(await b.getByTestId("traj-row-" + TRAJ).count(), 0);
  await b.goto(`${URL_}/ui/#/trajectories/${TRAJ}`);
  await b.getByTestId("error").first().waitFor();
  assert.match(await b.getByTestId("error").first().textContent(), /404|not found/i);
  assert.equal(await b.getByTestId("traj-steps").count(), 0);
  await b.goto(`${URL_}/ui/#/nodes`);
  await b.getByTestId("admin-only").first().waitFor();
  await noXss(b);
  await b.close();
});

step("10 admin: nodes, images and layers, the rates charts", [], async () => {
  const a = await openConsole(ADMIN);
  await a.getByTestId("nav-nodes").click();
  const nodes = a.getByTestId("nodes-table").first();
  await nodes.waitFor();
  assert.ok((await nodes.locator('tr[data-testid^="node-row-"]').count()) >= 1);
  await nodes.locator(".badge", { hasText: "up" }).first().waitFor();
  await shot(a, "10-nodes");
  await a.getByTestId("nav-images").click();
  await a.getByTestId("image-row-" + IMAGE).waitFor();
  await a.getByTestId("image-row-" + IMAGE).click(); // its detail: logical vs stored bytes
  const layers = a.getByTestId("layers");
  await layers.locator("tbody tr").first().waitFor();
  assert.equal(await layers.getByTestId("admin-only").count(), 0);
  await shot(a, "10-images");
  await a.getByTestId("nav-rates").click();
  await a.getByTestId("chart-creates").waitFor();
  // The platform samples its metrics every 10 s; the page asks every 10 s.
  await a.waitForFunction(
    () =>
      ["chart-creates", "chart-inflight", "chart-errors", "chart-sandboxes", "chart-refusals", "chart-nodes"].every(
        (id) => Number(document.querySelector(`[data-testid="${id}"]`)?.dataset.points) >= 2,
      ),
    null,
    { timeout: 45_000 },
  );
  assert.match(await a.getByTestId("rates-source").textContent(), /platform's last hour/);
  await shot(a, "10-rates");
  await noXss(a);
  await a.close();
});

test("no uncaught exception in any page", () => {
  assert.deepEqual(pageErrors, []);
});
