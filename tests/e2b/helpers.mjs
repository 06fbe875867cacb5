// Shared setup for the E2B compatibility tests (not a test file itself).
//
// Configuration comes only from the environment, set by tests/test_e2b.py:
//   E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY  read by the e2b SDK itself;
//   DSEC_E2B_TEMPLATE                          the template (a dsec image ref).
import { randomBytes } from 'node:crypto'
import { Sandbox } from 'e2b'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'DSEC_E2B_TEMPLATE']) {
  if (!process.env[name]) {
    throw new Error(`${name} is not set: run these tests through tests/test_e2b.py ` +
      '(or set E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and DSEC_E2B_TEMPLATE)')
  }
}
if ((process.env.E2B_DEBUG ?? '').toLowerCase() === 'true') {
  // Debug mode skips the control API entirely: nothing here would test dsec.
  throw new Error('E2B_DEBUG=true bypasses the server; unset it')
}

export const TEMPLATE = process.env.DSEC_E2B_TEMPLATE

// Timeouts for a slow 2-core VM.
export const TEST_TIMEOUT = 60_000
export const LONG_TEST_TIMEOUT = 180_000

/** A short random tag, for unique metadata values and paths. */
export function uniq(prefix = 'e2b') {
  return `${prefix}-${randomBytes(6).toString('hex')}`
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

/**
 * Polls `fn` (sync or async) until it returns a truthy value, which it
 * returns; throws with `what` and the last value/error after `timeoutMs`.
 */
export async function waitFor(fn, { timeoutMs = 15_000, intervalMs = 100, what = 'condition' } = {}) {
  const deadline = Date.now() + timeoutMs
  let last
  for (;;) {
    try {
      const v = await fn()
      if (v) return v
      last = v
    } catch (e) {
      last = e
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}; last: ` +
        (last instanceof Error ? `${last.name}: ${last.message}` : JSON.stringify(last)))
    }
    await sleep(intervalMs)
  }
}

/**
 * Creates sandboxes and kills whatever is left of them at cleanup()
 * (an `after` hook of each file). Tests also kill in `finally` themselves.
 */
export class Sandboxes {
  constructor() {
    this.ids = new Set()
  }

  async create(opts = {}) {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, ...opts })
    this.ids.add(sbx.sandboxId)
    return sbx
  }

  track(id) {
    this.ids.add(id)
  }

  async kill(sbx) {
    const id = typeof sbx === 'string' ? sbx : sbx.sandboxId
    this.ids.delete(id)
    return Sandbox.kill(id)
  }

  async cleanup() {
    const ids = [...this.ids]
    this.ids.clear()
    await Promise.all(ids.map((id) => Sandbox.kill(id).catch(() => undefined)))
  }
}

/**
 * Runs `fn` and returns the error it rejects with; fails if it resolves.
 * (assert.rejects returns nothing, and we want to look at the error.)
 */
export async function rejection(fn, what = 'the call') {
  try {
    const v = await fn()
    throw Object.assign(new Error(`${what} resolved (to ${show(v)}) instead of rejecting`),
      { resolvedInstead: true })
  } catch (e) {
    if (e && e.resolvedInstead) throw e
    return e
  }
}

/** An error's class and message, for assertion messages. */
export function show(v) {
  if (v instanceof Error) return `${v.constructor?.name ?? v.name}: ${v.message}`
  try {
    return JSON.stringify(v)
  } catch {
    return String(v)
  }
}

/** Strict semver-ish comparison of 'a.b.c' strings: -1, 0, 1. */
export function compareVersions(a, b) {
  const pa = a.split(/[.+-]/).slice(0, 3).map(Number)
  const pb = b.split(/[.+-]/).slice(0, 3).map(Number)
  for (let i = 0; i < 3; i++) {
    if (pa[i] !== pb[i]) return pa[i] < pb[i] ? -1 : 1
  }
  return 0
}
