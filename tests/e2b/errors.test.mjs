// How failures reach the SDK: each must surface as the SDK error class an E2B
// user catches (the control API's {code,message} bodies, envd's Connect codes).
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import {
  AuthenticationError, FileNotFoundError, NotFoundError, Sandbox, SandboxError,
  SandboxNotFoundError,
} from 'e2b'

import { Sandboxes, TEMPLATE, TEST_TIMEOUT, rejection, show, uniq } from './helpers.mjs'

const sandboxes = new Sandboxes()
let sbx
before(async () => {
  sbx = await sandboxes.create({ timeoutMs: 600_000 })
})
after(() => sandboxes.cleanup())

const NO_SUCH_SANDBOX = 'sb-0000000000000000'
const UNKNOWN_PID = 987_654
const BAD_KEY = 'e2b_0000000000000000000000000000000000000000'

test('create from an unknown template: SandboxError 404', { timeout: TEST_TIMEOUT }, async () => {
  const err = await rejection(() => Sandbox.create('no-such-template-xyz'), 'create(no-such-template-xyz)')
  // A 404 on create goes through the generic mapping: SandboxError "404: <message>".
  assert.ok(err instanceof SandboxError, show(err))
  assert.ok(!(err instanceof AuthenticationError), show(err))
  assert.equal(err.statusCode, 404, show(err))
  assert.match(err.message, /^404: ./, show(err))
  // Nothing was left behind.
  const left = []
  const paginator = Sandbox.list()
  while (paginator.hasNext) left.push(...(await paginator.nextItems()))
  assert.ok(!left.some((s) => s.templateId === 'no-such-template-xyz'), show(left))
})

test('a bad API key: AuthenticationError on every control-API call', { timeout: TEST_TIMEOUT }, async () => {
  const opts = { apiKey: BAD_KEY }
  const calls = [
    ['create', () => Sandbox.create(TEMPLATE, opts)],
    ['list', () => Sandbox.list(opts).nextItems()],
    ['getInfo', () => Sandbox.getInfo(sbx.sandboxId, opts)],
    ['connect', () => Sandbox.connect(sbx.sandboxId, opts)],
    ['setTimeout', () => Sandbox.setTimeout(sbx.sandboxId, 60_000, opts)],
    ['kill', () => Sandbox.kill(sbx.sandboxId, opts)],
  ]
  for (const [what, call] of calls) {
    const err = await rejection(call, `${what} with a bad API key`)
    assert.ok(err instanceof AuthenticationError, `${what}: ${show(err)}`)
    // AuthenticationError is not a SandboxError (the SDK's choice; 401 maps here).
    assert.ok(!(err instanceof SandboxError), `${what}: ${show(err)}`)
  }
  // The bad key harmed nothing.
  assert.equal((await sbx.getInfo()).state, 'running')
})

test('an unknown sandbox: SandboxNotFoundError, and kill gives false', { timeout: TEST_TIMEOUT }, async () => {
  for (const [what, call] of [
    ['connect', () => Sandbox.connect(NO_SUCH_SANDBOX)],
    ['getInfo', () => Sandbox.getInfo(NO_SUCH_SANDBOX)],
    ['setTimeout', () => Sandbox.setTimeout(NO_SUCH_SANDBOX, 60_000)],
  ]) {
    const err = await rejection(call, `${what}(${NO_SUCH_SANDBOX})`)
    assert.ok(err instanceof SandboxNotFoundError, `${what}: ${show(err)}`)
    assert.ok(err instanceof NotFoundError, `${what}: ${show(err)}`)
  }
  assert.equal(await Sandbox.kill(NO_SUCH_SANDBOX), false)
})

test('a killed sandbox: gone for the control API and for envd', { timeout: TEST_TIMEOUT }, async () => {
  const victim = await sandboxes.create()
  assert.equal(await sandboxes.kill(victim), true)
  const c = await rejection(() => Sandbox.connect(victim.sandboxId), 'connect to a killed sandbox')
  assert.ok(c instanceof SandboxNotFoundError, show(c))
  // envd behind the gateway answers 502 for it: isRunning() false, a command
  // stream "probably not running anymore" (SandboxNotFoundError), and other
  // calls some SandboxError (TimeoutError for a 502).
  assert.equal(await victim.isRunning(), false)
  const run = await rejection(() => victim.commands.run('true'), 'commands.run in a killed sandbox')
  assert.ok(run instanceof SandboxNotFoundError, show(run))
  for (const [what, call] of [
    ['files.read', () => victim.files.read('/etc/hostname')],
    ['files.write', () => victim.files.write('/tmp/x', 'x')],
    ['files.list', () => victim.files.list('/')],
    ['commands.list', () => victim.commands.list()],
  ]) {
    const err = await rejection(call, `${what} in a killed sandbox`)
    assert.ok(err instanceof SandboxError, `${what}: ${show(err)}`)
  }
})

test('files: a missing path is FileNotFoundError', { timeout: TEST_TIMEOUT }, async () => {
  const missing = `/tmp/${uniq('missing')}/nothing.txt`
  const err = await rejection(() => sbx.files.read(missing), 'files.read of a missing path')
  assert.ok(err instanceof FileNotFoundError, show(err))
  assert.ok(err instanceof NotFoundError, show(err))
  const info = await rejection(() => sbx.files.getInfo(missing), 'files.getInfo of a missing path')
  assert.ok(info instanceof FileNotFoundError, show(info))
  const watch = await rejection(() => sbx.files.watchDir(`/tmp/${uniq('missing')}`, () => {}),
    'files.watchDir of a missing directory')
  assert.ok(watch instanceof FileNotFoundError, show(watch))
  assert.equal(await sbx.files.exists(missing), false)
})

test('processes: an unknown pid is NotFoundError, kill gives false', { timeout: TEST_TIMEOUT }, async () => {
  for (const [what, call] of [
    ['commands.connect', () => sbx.commands.connect(UNKNOWN_PID)],
    ['commands.sendStdin', () => sbx.commands.sendStdin(UNKNOWN_PID, 'x')],
    ['commands.closeStdin', () => sbx.commands.closeStdin(UNKNOWN_PID)],
    ['pty.connect', () => sbx.pty.connect(UNKNOWN_PID, { onData: () => {} })],
    ['pty.sendInput', () => sbx.pty.sendInput(UNKNOWN_PID, new Uint8Array([0x0a]))],
    ['pty.resize', () => sbx.pty.resize(UNKNOWN_PID, { cols: 80, rows: 24 })],
  ]) {
    const err = await rejection(call, `${what}(${UNKNOWN_PID})`)
    assert.ok(err instanceof NotFoundError, `${what}: ${show(err)}`)
  }
  assert.equal(await sbx.commands.kill(UNKNOWN_PID), false)
  assert.equal(await sbx.pty.kill(UNKNOWN_PID), false)
})

test('an unknown user: AuthenticationError', { timeout: TEST_TIMEOUT }, async () => {
  const user = 'no-such-user-xyz'
  const run = await rejection(() => sbx.commands.run('true', { user }), 'commands.run as an unknown user')
  assert.ok(run instanceof AuthenticationError, show(run))
  const read = await rejection(() => sbx.files.read('/etc/hostname', { user }), 'files.read as an unknown user')
  assert.ok(read instanceof AuthenticationError, show(read))
  const list = await rejection(() => sbx.files.list('/', { user }), 'files.list as an unknown user')
  assert.ok(list instanceof AuthenticationError, show(list))
})
