// sandbox.pty: create, sendInput, resize, connect, kill, exit.
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { CommandExitError } from 'e2b'

import { Sandboxes, TEST_TIMEOUT, rejection, show, uniq, waitFor } from './helpers.mjs'

const sandboxes = new Sandboxes()
let sbx
before(async () => {
  sbx = await sandboxes.create({ timeoutMs: 600_000 })
})
after(() => sandboxes.cleanup())

const enc = (s) => new TextEncoder().encode(s)

/** Collects a terminal's output (onData) as text. */
class Screen {
  constructor() {
    this.text = ''
    this.chunks = 0
    this.decoder = new TextDecoder()
    this.onData = (data) => {
      assert.ok(data instanceof Uint8Array, `onData got ${data?.constructor?.name}`)
      this.chunks++
      this.text += this.decoder.decode(data, { stream: true })
    }
  }

  /** Waits for `re` in the output after offset `from`; returns its match. */
  async expect(re, from = 0, timeoutMs = 15_000) {
    return waitFor(() => this.text.slice(from).match(re),
      { timeoutMs, what: `${re} in the terminal output (so far: ${JSON.stringify(this.text.slice(-400))})` })
  }
}

/** Types `line` and waits for what `re` matches, in output after the typing. */
async function typeAndExpect(screen, pid, line, re) {
  const from = screen.text.length
  await sbx.pty.sendInput(pid, enc(line))
  return screen.expect(re, from)
}

test('create a terminal, type into it, read its output', { timeout: TEST_TIMEOUT }, async () => {
  const screen = new Screen()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: screen.onData, timeoutMs: 60_000 })
  try {
    assert.ok(Number.isInteger(term.pid) && term.pid > 0, `pid ${term.pid}`)
    // `echo hi` is echoed by the terminal, then printed: "hi" on a line of its own
    // (after \r\n, or after the \r that ends bash's bracketed-paste switch).
    await typeAndExpect(screen, term.pid, 'echo hi\n', /[\r\n]hi\r\n/)
    await typeAndExpect(screen, term.pid, 'stty size\n', /[\r\n]24 80\r\n/)
    // Marked so that the echoed command line itself does not match.
    await typeAndExpect(screen, term.pid, 'echo "T=$TERM L=$LANG"\n', /T=xterm-256color L=C\.UTF-8/)
    await typeAndExpect(screen, term.pid, 'tty\n', /\/dev\/pts\/\d+/)
    await typeAndExpect(screen, term.pid, 'test -t 0 && test -t 1 && test -t 2 && echo "ALL""TTY"\n', /ALLTTY/)
    assert.ok(screen.chunks > 0)
  } finally {
    await sbx.pty.kill(term.pid)
  }
})

test('resize changes what stty size reports', { timeout: TEST_TIMEOUT }, async () => {
  const screen = new Screen()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: screen.onData })
  try {
    await typeAndExpect(screen, term.pid, 'stty size\n', /[\r\n]24 80\r\n/)
    await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
    await typeAndExpect(screen, term.pid, 'stty size\n', /[\r\n]30 100\r\n/)
    await sbx.pty.resize(term.pid, { cols: 132, rows: 50 })
    await typeAndExpect(screen, term.pid, 'stty size\n', /[\r\n]50 132\r\n/)
  } finally {
    await sbx.pty.kill(term.pid)
  }
})

test('^C interrupts the foreground job, the shell goes on', { timeout: TEST_TIMEOUT }, async () => {
  const screen = new Screen()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: screen.onData })
  try {
    await sbx.pty.sendInput(term.pid, enc('sleep 100; echo "NOT""INTERRUPTED"\n'))
    await screen.expect(/sleep 100/)
    await new Promise((r) => setTimeout(r, 500))
    await sbx.pty.sendInput(term.pid, enc('\x03'))
    await typeAndExpect(screen, term.pid, 'echo "STILL""HERE"\n', /STILLHERE/)
    assert.ok(!screen.text.includes('NOTINTERRUPTED'), screen.text)
  } finally {
    await sbx.pty.kill(term.pid)
  }
})

test('exit ends the terminal with its exit code', { timeout: TEST_TIMEOUT }, async () => {
  const screen = new Screen()
  const ok = await sbx.pty.create({ cols: 80, rows: 24, onData: screen.onData })
  await sbx.pty.sendInput(ok.pid, enc('exit 0\n'))
  const r = await ok.wait()
  assert.equal(r.exitCode, 0)

  const bad = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
  await sbx.pty.sendInput(bad.pid, enc('exit 3\n'))
  const err = await rejection(() => bad.wait(), 'wait() of a terminal exiting 3')
  assert.ok(err instanceof CommandExitError, show(err))
  assert.equal(err.exitCode, 3)
})

test('kill: true, the terminal ends, then false', { timeout: TEST_TIMEOUT }, async () => {
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
  const procs = await sbx.commands.list()
  const p = procs.find((x) => x.pid === term.pid)
  assert.ok(p, `the terminal (pid ${term.pid}) is not in commands.list(): ${show(procs)}`)
  assert.equal(p.cmd, '/bin/bash')
  assert.deepEqual(p.args, ['-i', '-l'])

  assert.equal(await sbx.pty.kill(term.pid), true)
  const err = await rejection(() => term.wait(), 'wait() of a killed terminal')
  assert.ok(err instanceof CommandExitError, show(err))
  assert.notEqual(err.exitCode, 0)
  await waitFor(async () => !(await sbx.commands.list()).some((x) => x.pid === term.pid),
    { what: 'the killed terminal to leave commands.list()' })
  assert.equal(await sbx.pty.kill(term.pid), false)
})

test('cwd, envs and user of a terminal', { timeout: TEST_TIMEOUT }, async () => {
  const screen = new Screen()
  const term = await sbx.pty.create({
    cols: 80, rows: 24, onData: screen.onData, cwd: '/tmp', user: 'nobody', envs: { E2B_PTY: 'yes' },
  })
  try {
    await typeAndExpect(screen, term.pid, 'echo "W=$(pwd):$E2B_PTY:$(id -un)"\n', /W=\/tmp:yes:nobody/)
  } finally {
    await sbx.pty.kill(term.pid)
  }
})

test('connect to a terminal and keep typing', { timeout: TEST_TIMEOUT }, async () => {
  const first = new Screen()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: first.onData })
  try {
    await typeAndExpect(first, term.pid, 'echo "ONE""ONE"\n', /ONEONE/)
    await term.disconnect()

    const second = new Screen()
    const again = await sbx.pty.connect(term.pid, { onData: second.onData })
    assert.equal(again.pid, term.pid)
    const tag = uniq('pty')
    await typeAndExpect(second, term.pid, `echo "${tag}-""TWO"\n`, new RegExp(`${tag}-TWO`))
    await sbx.pty.sendInput(term.pid, enc('exit 0\n'))
    const r = await again.wait()
    assert.equal(r.exitCode, 0)
  } finally {
    await sbx.pty.kill(term.pid)
  }
})
