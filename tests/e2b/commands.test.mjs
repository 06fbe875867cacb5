// sandbox.commands: run (foreground and background), exit codes, envs, cwd,
// users, timeouts, stdin, kill, list, connect.
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { CommandExitError, SandboxError, TimeoutError } from 'e2b'

import { Sandboxes, TEST_TIMEOUT, rejection, show, sleep, uniq, waitFor } from './helpers.mjs'

const sandboxes = new Sandboxes()
let sbx
before(async () => {
  sbx = await sandboxes.create({ timeoutMs: 600_000 })
})
after(() => sandboxes.cleanup())

const UNKNOWN_PID = 987_654 // above any pid a fresh sandbox hands out

/** The listed process whose command line contains `tag`, if any. */
async function listed(tag) {
  const procs = await sbx.commands.list()
  return procs.find((p) => p.args.join(' ').includes(tag))
}

test('run: exit 0 with stdout and stderr apart', { timeout: TEST_TIMEOUT }, async () => {
  const r = await sbx.commands.run('echo out; echo err >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'out\n')
  assert.equal(r.stderr, 'err\n')
})

test('run: a non-zero exit raises CommandExitError', { timeout: TEST_TIMEOUT }, async () => {
  const err = await rejection(() => sbx.commands.run('echo partial; echo boom >&2; exit 1'))
  assert.ok(err instanceof CommandExitError, show(err))
  assert.ok(err instanceof SandboxError, 'CommandExitError extends SandboxError')
  assert.equal(err.exitCode, 1)
  assert.equal(err.stdout, 'partial\n')
  assert.equal(err.stderr, 'boom\n')

  const err3 = await rejection(() => sbx.commands.run('exit 3'))
  assert.ok(err3 instanceof CommandExitError, show(err3))
  assert.equal(err3.exitCode, 3)
  assert.equal(err3.stdout, '')
})

test('run: the command line goes to bash -l -c as is', { timeout: TEST_TIMEOUT }, async () => {
  const r = await sbx.commands.run(`x='a  b'; printf '[%s]' "$x" $x; echo; echo "$0" | grep -c bash`)
  assert.equal(r.stdout, '[a  b][a][b]\n1\n')
  const u = await sbx.commands.run("printf 'h\\xc3\\xa9llo \\xe2\\x82\\xac\\n'")
  assert.equal(u.stdout, 'héllo €\n')
})

test('run: envs and cwd', { timeout: TEST_TIMEOUT }, async () => {
  const r = await sbx.commands.run('echo "$E2B_FOO|$E2B_BAR"; pwd', {
    envs: { E2B_FOO: 'bar baz', E2B_BAR: 'x=y' },
    cwd: '/tmp',
  })
  assert.equal(r.stdout, 'bar baz|x=y\n/tmp\n')
  const etc = await sbx.commands.run('pwd', { cwd: '/etc' })
  assert.equal(etc.stdout, '/etc\n')
})

test('run: user root and nobody', { timeout: TEST_TIMEOUT }, async () => {
  const root = await sbx.commands.run('whoami; id -u; echo "$HOME"; pwd', { user: 'root' })
  // Without cwd a command starts in its user's home directory.
  assert.equal(root.stdout, 'root\n0\n/root\n/root\n')

  const f = `/tmp/${uniq('owned')}`
  const nobody = await sbx.commands.run(`whoami; id -u; touch ${f}; stat -c %U ${f}`,
    { user: 'nobody', cwd: '/tmp' })
  assert.equal(nobody.stdout, 'nobody\n65534\nnobody\n')

  // nobody cannot write where only root may.
  const err = await rejection(() => sbx.commands.run('touch /root/e2b-denied',
    { user: 'nobody', cwd: '/tmp' }))
  assert.ok(err instanceof CommandExitError, show(err))
  assert.notEqual(err.exitCode, 0)
})

test('run: stdin is closed unless asked for', { timeout: TEST_TIMEOUT }, async () => {
  // `cat` reads EOF at once and exits; it would hang on an open pipe.
  const r = await sbx.commands.run('cat; echo done', { timeoutMs: 20_000 })
  assert.equal(r.stdout, 'done\n')
})

test('run: big output arrives whole', { timeout: TEST_TIMEOUT }, async () => {
  const r = await sbx.commands.run('seq 1 200000; seq 1 1000 >&2')
  const lines = r.stdout.split('\n')
  assert.equal(lines.length, 200_001)
  assert.equal(lines[0], '1')
  assert.equal(lines[199_999], '200000')
  assert.equal(r.stderr.split('\n').length, 1001)
})

test('run: concurrent commands', { timeout: TEST_TIMEOUT }, async () => {
  const rs = await Promise.all([1, 2, 3, 4, 5].map((i) =>
    sbx.commands.run(`sleep 0.$i; echo ${i}`)))
  assert.deepEqual(rs.map((r) => r.stdout), ['1\n', '2\n', '3\n', '4\n', '5\n'])
})

test('run: timeoutMs that expires raises TimeoutError and ends the command', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('timeout')
  const t0 = Date.now()
  const err = await rejection(() => sbx.commands.run(`sleep 30 # ${tag}`, { timeoutMs: 2_000 }))
  assert.ok(err instanceof TimeoutError, show(err))
  assert.ok(Date.now() - t0 < 20_000, `took ${Date.now() - t0} ms`)
  await waitFor(async () => !(await listed(tag)),
    { what: 'the timed-out command to be gone from commands.list()' })
})

test('run: the server enforces timeoutMs without a client', { timeout: TEST_TIMEOUT }, async () => {
  // Disconnected, the SDK no longer aborts anything: envd itself must kill
  // the process when Connect-Timeout-Ms passes.
  const tag = uniq('servertimeout')
  const h = await sbx.commands.run(`sleep 30 # ${tag}`, { background: true, timeoutMs: 3_000 })
  await h.disconnect()
  assert.ok(await listed(tag), 'the command is not listed right after it started')
  await waitFor(async () => !(await listed(tag)),
    { timeoutMs: 15_000, what: 'the server to kill the command after its 3 s timeoutMs' })
})

test('background: onStdout/onStderr get the chunks in order, as they come', { timeout: TEST_TIMEOUT }, async () => {
  const out = []
  const errs = []
  const h = await sbx.commands.run(
    'for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.4; done',
    { background: true, onStdout: (d) => out.push(d), onStderr: (d) => errs.push(d) })
  assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
  await waitFor(() => out.length > 0, { what: 'the first stdout chunk' })
  const firstAt = Date.now()
  const r = await h.wait()
  const doneAt = Date.now()
  assert.equal(r.exitCode, 0)
  assert.equal(out.join(''), 'out1\nout2\nout3\nout4\nout5\n')
  assert.equal(errs.join(''), 'err1\nerr2\nerr3\nerr4\nerr5\n')
  assert.equal(r.stdout, out.join(''))
  assert.equal(r.stderr, errs.join(''))
  assert.equal(h.stdout, r.stdout)
  assert.equal(h.exitCode, 0)
  // The first line was delivered while the loop still ran (~2 s), not at its end.
  assert.ok(doneAt - firstAt >= 1_000,
    `output is not streamed: first chunk ${doneAt - firstAt} ms before the end`)
})

test('stdin: sendStdin then closeStdin, cat echoes back', { timeout: TEST_TIMEOUT }, async () => {
  const chunks = []
  const h = await sbx.commands.run('cat', {
    background: true, stdin: true, timeoutMs: 30_000, onStdout: (d) => chunks.push(d),
  })
  await h.sendStdin('hello\n')
  await waitFor(() => chunks.join('') === 'hello\n', { what: 'cat to echo hello' })
  await sbx.commands.sendStdin(h.pid, new TextEncoder().encode('wörld\n'))
  await waitFor(() => chunks.join('') === 'hello\nwörld\n', { what: 'cat to echo wörld' })
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\nwörld\n')
})

test('stdin: handle.closeStdin gives EOF', { timeout: TEST_TIMEOUT }, async () => {
  const h = await sbx.commands.run('wc -c', { background: true, stdin: true, timeoutMs: 30_000 })
  await h.sendStdin('12345')
  await h.sendStdin(new Uint8Array([0x36, 0x37]))
  await h.closeStdin()
  const r = await h.wait()
  assert.equal(r.stdout.trim(), '7')
})

test('kill: handle.kill and commands.kill; false for an unknown pid', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('kill')
  const h = await sbx.commands.run(`sleep 60 # ${tag}`, { background: true })
  assert.ok(await listed(tag))
  assert.equal(await h.kill(), true)
  const err = await rejection(() => h.wait(), 'wait() of a killed command')
  assert.ok(err instanceof CommandExitError, show(err))
  assert.notEqual(err.exitCode, 0)
  await waitFor(async () => !(await listed(tag)), { what: 'the killed command to leave the list' })
  assert.equal(await sbx.commands.kill(h.pid), false, 'kill of an ended command')

  const h2 = await sbx.commands.run(`sleep 60 # ${tag}-2`, { background: true })
  assert.equal(await sbx.commands.kill(h2.pid), true)
  const err2 = await rejection(() => h2.wait(), 'wait() of a killed command')
  assert.ok(err2 instanceof CommandExitError, show(err2))

  assert.equal(await sbx.commands.kill(UNKNOWN_PID), false)
})

test('list: a running background command, with its pid, cmd, args, cwd and envs', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('list')
  const cmd = `sleep 60 # ${tag}`
  const h = await sbx.commands.run(cmd, { background: true, cwd: '/tmp', envs: { E2B_LISTED: 'yes' } })
  try {
    const procs = await sbx.commands.list()
    const p = procs.find((x) => x.pid === h.pid)
    assert.ok(p, `pid ${h.pid} not in ${show(procs)}`)
    assert.equal(p.cmd, '/bin/bash')
    assert.deepEqual(p.args, ['-l', '-c', cmd])
    assert.equal(p.cwd, '/tmp')
    assert.equal(p.envs.E2B_LISTED, 'yes')
  } finally {
    await h.kill()
    await h.wait().catch(() => undefined)
  }
  await waitFor(async () => !(await sbx.commands.list()).some((x) => x.pid === h.pid),
    { what: 'the killed command to leave the list' })
})

test('disconnect leaves the command running', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('disconnect')
  const h = await sbx.commands.run(`sleep 60 # ${tag}`, { background: true })
  await h.disconnect()
  await sleep(1_000)
  assert.ok(await listed(tag), 'the command ended when its client disconnected')
  assert.equal(await sbx.commands.kill(h.pid), true)
})

test('connect: output made after connecting, then the exit', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('connect')
  const go = `/tmp/${tag}.go`
  const early = []
  const h = await sbx.commands.run(
    `echo before-connect; while [ ! -e ${go} ]; do sleep 0.1; done; echo after-connect; echo err-after >&2; exit 7`,
    { background: true, onStdout: (d) => early.push(d) })
  await waitFor(() => early.join('').includes('before-connect'), { what: 'before-connect' })
  await h.disconnect()

  const out = []
  const errs = []
  const c = await sbx.commands.connect(h.pid, {
    onStdout: (d) => out.push(d), onStderr: (d) => errs.push(d),
  })
  assert.equal(c.pid, h.pid)
  await sbx.files.write(go, 'go')
  const err = await rejection(() => c.wait(), 'wait() of a command exiting 7')
  assert.ok(err instanceof CommandExitError, show(err))
  assert.equal(err.exitCode, 7)
  // Connect does not replay what was printed before it.
  assert.equal(out.join(''), 'after-connect\n')
  assert.equal(errs.join(''), 'err-after\n')
  assert.equal(err.stdout, 'after-connect\n')
  assert.equal(err.stderr, 'err-after\n')
})

test('connect: two clients of one command both see its output', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('twoclients')
  const go = `/tmp/${tag}.go`
  const h = await sbx.commands.run(
    `while [ ! -e ${go} ]; do sleep 0.1; done; echo shared`, { background: true })
  const c = await sbx.commands.connect(h.pid)
  await sbx.commands.run(`touch ${go}`)
  const [r1, r2] = await Promise.all([h.wait(), c.wait()])
  assert.equal(r1.stdout, 'shared\n')
  assert.equal(r2.stdout, 'shared\n')
  assert.equal(r2.exitCode, 0)
})
