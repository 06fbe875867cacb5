// Sandbox lifecycle through the control API: create, getInfo, list, setTimeout,
// connect, kill, isRunning, the timeout itself.
import { after, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, SandboxNotFoundError, FileNotFoundError } from 'e2b'

import {
  LONG_TEST_TIMEOUT, Sandboxes, TEMPLATE, TEST_TIMEOUT, compareVersions, rejection, show,
  uniq, waitFor,
} from './helpers.mjs'

const sandboxes = new Sandboxes()
after(() => sandboxes.cleanup())

const SLACK_MS = 10_000 // clock reading and rounding (the API works in whole seconds)

function assertEndsAround(info, expectedEndMs, what) {
  const end = info.endAt.getTime()
  assert.ok(Math.abs(end - expectedEndMs) <= SLACK_MS,
    `${what}: endAt ${info.endAt.toISOString()} is not within ${SLACK_MS} ms of ` +
    `${new Date(expectedEndMs).toISOString()}`)
}

async function listAll(opts) {
  const paginator = Sandbox.list(opts)
  const all = []
  let pages = 0
  while (paginator.hasNext) {
    all.push(...(await paginator.nextItems()))
    assert.ok(++pages < 100, 'more than 100 pages: the x-next-token never ends')
  }
  return all
}

test('create with timeoutMs and metadata; getInfo reports them', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('create')
  const t0 = Date.now()
  const sbx = await sandboxes.create({ timeoutMs: 120_000, metadata: { suite: 'e2b', run: tag } })
  try {
    assert.equal(typeof sbx.sandboxId, 'string')
    assert.ok(sbx.sandboxId.length > 0, 'empty sandboxId')

    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, TEMPLATE)
    assert.equal(info.state, 'running')
    assert.equal(info.metadata.suite, 'e2b')
    assert.equal(info.metadata.run, tag)
    assert.ok(info.startedAt instanceof Date && !Number.isNaN(info.startedAt.getTime()),
      `startedAt ${info.startedAt}`)
    assert.ok(Math.abs(info.startedAt.getTime() - t0) <= SLACK_MS,
      `startedAt ${info.startedAt.toISOString()} is far from now`)
    assertEndsAround(info, t0 + 120_000, 'create timeoutMs 120000')
    assert.match(info.envdVersion, /^\d+\.\d+\.\d+/, `envdVersion ${info.envdVersion}`)
    // Below 0.4.0 the SDK would force user "user" on every call.
    assert.ok(compareVersions(info.envdVersion, '0.4.0') >= 0, `envdVersion ${info.envdVersion}`)
    assert.ok(Number.isFinite(info.cpuCount), `cpuCount ${info.cpuCount}`)
    assert.ok(Number.isFinite(info.memoryMB), `memoryMB ${info.memoryMB}`)

    // The static form answers the same.
    const again = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal(again.metadata.run, tag)

    // And the sandbox works: envd is reachable through E2B_SANDBOX_URL.
    assert.equal(await sbx.isRunning(), true)
    const r = await sbx.commands.run('echo ready')
    assert.equal(r.stdout, 'ready\n')
  } finally {
    await sandboxes.kill(sbx)
  }
})

test('create with envs: the default environment of every command', { timeout: TEST_TIMEOUT }, async () => {
  const sbx = await sandboxes.create({ envs: { E2B_T_ONE: 'one', E2B_T_TWO: 'two' } })
  try {
    const r = await sbx.commands.run('echo "$E2B_T_ONE $E2B_T_TWO"')
    assert.equal(r.stdout, 'one two\n')
    // A command's own envs override the sandbox's.
    const o = await sbx.commands.run('echo "$E2B_T_ONE $E2B_T_TWO"', { envs: { E2B_T_TWO: 'over' } })
    assert.equal(o.stdout, 'one over\n')
  } finally {
    await sandboxes.kill(sbx)
  }
})

test('list finds the sandbox, by metadata too', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('list')
  // A value that needs encoding: the SDK triple-encodes metadata queries.
  const odd = 'a b&c=d/%é'
  const sbx = await sandboxes.create({ metadata: { run: tag, odd } })
  try {
    const all = await listAll()
    const mine = all.find((s) => s.sandboxId === sbx.sandboxId)
    assert.ok(mine, `Sandbox.list() did not return ${sbx.sandboxId}`)
    assert.equal(mine.state, 'running')
    assert.equal(mine.templateId, TEMPLATE)
    assert.equal(mine.metadata.run, tag)
    assert.equal(mine.metadata.odd, odd)
    assert.ok(!Number.isNaN(mine.startedAt.getTime()) && !Number.isNaN(mine.endAt.getTime()))

    const byTag = await listAll({ query: { metadata: { run: tag } } })
    assert.deepEqual(byTag.map((s) => s.sandboxId), [sbx.sandboxId])

    const byOdd = await listAll({ query: { metadata: { run: tag, odd } } })
    assert.deepEqual(byOdd.map((s) => s.sandboxId), [sbx.sandboxId])

    // Pairs are ANDed: a wrong second pair matches nothing.
    const none = await listAll({ query: { metadata: { run: tag, odd: 'other' } } })
    assert.deepEqual(none, [])

    const running = await listAll({ query: { metadata: { run: tag }, state: ['running'] } })
    assert.deepEqual(running.map((s) => s.sandboxId), [sbx.sandboxId])
    const paused = await listAll({ query: { metadata: { run: tag }, state: ['paused'] } })
    assert.deepEqual(paused, [])
  } finally {
    await sandboxes.kill(sbx)
  }
})

test('list pages with limit and x-next-token', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('page')
  const a = await sandboxes.create({ metadata: { run: tag } })
  const b = await sandboxes.create({ metadata: { run: tag } })
  try {
    const paginator = Sandbox.list({ query: { metadata: { run: tag } }, limit: 1 })
    const first = await paginator.nextItems()
    assert.equal(first.length, 1, `first page: ${show(first)}`)
    assert.equal(paginator.hasNext, true, 'no x-next-token after a full first page')
    const seen = [...first]
    while (paginator.hasNext) {
      const page = await paginator.nextItems()
      assert.ok(page.length <= 1, `a page over the limit: ${show(page)}`)
      seen.push(...page)
      assert.ok(seen.length <= 3, `too many items: ${show(seen)}`)
    }
    assert.deepEqual(seen.map((s) => s.sandboxId).sort(), [a.sandboxId, b.sandboxId].sort())
  } finally {
    await Promise.all([sandboxes.kill(a), sandboxes.kill(b)])
  }
})

test('setTimeout sets the end time from now, shorter or longer', { timeout: TEST_TIMEOUT }, async () => {
  const sbx = await sandboxes.create({ timeoutMs: 120_000 })
  try {
    let t = Date.now()
    await sbx.setTimeout(30_000)
    assertEndsAround(await sbx.getInfo(), t + 30_000, 'setTimeout(30000)')

    t = Date.now()
    await Sandbox.setTimeout(sbx.sandboxId, 200_000)
    assertEndsAround(await sbx.getInfo(), t + 200_000, 'Sandbox.setTimeout(id, 200000)')
    assert.equal(await sbx.isRunning(), true)
  } finally {
    await sandboxes.kill(sbx)
  }
})

test('Sandbox.connect gives a working handle on the same sandbox', { timeout: TEST_TIMEOUT }, async () => {
  const sbx = await sandboxes.create({ timeoutMs: 60_000 })
  try {
    const path = `/tmp/${uniq('connect')}.txt`
    await sbx.files.write(path, 'written by the first handle')

    const t = Date.now()
    const other = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 180_000 })
    assert.equal(other.sandboxId, sbx.sandboxId)
    assert.equal(await other.files.read(path), 'written by the first handle')
    const r = await other.commands.run(`cat ${path}`)
    assert.equal(r.stdout, 'written by the first handle')
    // connect extends the timeout when the new one is longer...
    assertEndsAround(await other.getInfo(), t + 180_000, 'connect({timeoutMs: 180000})')
    // ...and never shortens it.
    await Sandbox.connect(sbx.sandboxId, { timeoutMs: 10_000 })
    assertEndsAround(await other.getInfo(), t + 180_000, 'connect({timeoutMs: 10000}) after 180000')

    // The instance method too.
    const same = await sbx.connect()
    assert.equal(same.sandboxId, sbx.sandboxId)
    assert.equal((await same.commands.run('echo again')).stdout, 'again\n')
  } finally {
    await sandboxes.kill(sbx)
  }
})

test('envd traffic goes to the sandbox named by E2b-Sandbox-Id', { timeout: TEST_TIMEOUT }, async () => {
  const [a, b] = await Promise.all([sandboxes.create(), sandboxes.create()])
  try {
    const path = `/tmp/${uniq('whoami')}`
    await a.files.write(path, a.sandboxId)
    assert.equal(await a.files.read(path), a.sandboxId)
    assert.equal(await b.files.exists(path), false, `a file written in ${a.sandboxId} shows in ${b.sandboxId}`)
    await assert.rejects(b.files.read(path), FileNotFoundError)
    await b.commands.run(`echo -n ${b.sandboxId} > ${path}`)
    assert.equal(await a.files.read(path), a.sandboxId)
    assert.equal(await b.files.read(path), b.sandboxId)
  } finally {
    await Promise.all([sandboxes.kill(a), sandboxes.kill(b)])
  }
})

test('kill: true, then false; the sandbox is gone', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('kill')
  const sbx = await sandboxes.create({ metadata: { run: tag } })
  assert.equal(await sbx.isRunning(), true)
  assert.equal(await sbx.kill(), true)
  sandboxes.ids.delete(sbx.sandboxId)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  assert.equal(await sbx.kill(), false)
  // GET /health through the gateway answers 502 for a sandbox that is gone.
  assert.equal(await sbx.isRunning(), false)
  const err = await rejection(() => sbx.getInfo(), 'getInfo of a killed sandbox')
  assert.ok(err instanceof SandboxNotFoundError, show(err))
  const listed = await listAll({ query: { metadata: { run: tag } } })
  assert.deepEqual(listed, [], `a killed sandbox is still listed: ${show(listed)}`)
})

test('a sandbox is killed when its timeout passes', { timeout: TEST_TIMEOUT }, async () => {
  const tag = uniq('ttl')
  const sbx = await sandboxes.create({ timeoutMs: 3_000, metadata: { run: tag } })
  assert.equal(await sbx.isRunning(), true)
  await waitFor(async () => !(await sbx.isRunning()),
    { timeoutMs: 30_000, intervalMs: 500, what: 'the sandbox to stop after its 3 s timeout' })
  const err = await rejection(() => Sandbox.getInfo(sbx.sandboxId), 'getInfo after the timeout')
  assert.ok(err instanceof SandboxNotFoundError, show(err))
  assert.deepEqual(await listAll({ query: { metadata: { run: tag } } }), [])
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  sandboxes.ids.delete(sbx.sandboxId)
})

test('many quick creates and kills', { timeout: LONG_TEST_TIMEOUT }, async () => {
  const made = await Promise.all(Array.from({ length: 4 }, () => sandboxes.create()))
  try {
    const outs = await Promise.all(made.map((s) => s.commands.run('echo ok')))
    assert.deepEqual(outs.map((r) => r.stdout), ['ok\n', 'ok\n', 'ok\n', 'ok\n'])
    assert.equal(new Set(made.map((s) => s.sandboxId)).size, 4, 'duplicate sandbox ids')
  } finally {
    const killed = await Promise.all(made.map((s) => sandboxes.kill(s)))
    assert.deepEqual(killed, [true, true, true, true])
  }
})
