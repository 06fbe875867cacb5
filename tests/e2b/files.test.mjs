// sandbox.files: write/read (text, bytes, blob, stream; multipart, octet-stream,
// gzip; 50 MB), list, makeDir, rename, remove, exists, getInfo, watchDir.
import { after, before, test } from 'node:test'
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { FileNotFoundError, FilesystemEventType, FileType, TimeoutError } from 'e2b'

import {
  LONG_TEST_TIMEOUT, Sandboxes, TEST_TIMEOUT, compareVersions, rejection, show, sleep, uniq,
  waitFor,
} from './helpers.mjs'

const sandboxes = new Sandboxes()
let sbx
let envdVersion
let root // a fresh directory per file run
before(async () => {
  sbx = await sandboxes.create({ timeoutMs: 600_000 })
  envdVersion = (await sbx.getInfo()).envdVersion
  root = `/tmp/${uniq('files')}`
})
after(() => sandboxes.cleanup())

const sha256 = (bytes) => createHash('sha256').update(bytes).digest('hex')

/** Skips the test `t` unless the reported envd version reaches `gate`. */
function needsEnvd(t, gate, what) {
  if (compareVersions(envdVersion, gate) < 0) {
    t.skip(`envd ${envdVersion} < ${gate}: the SDK does not use ${what}`)
    return false
  }
  return true
}

test('write and read text', { timeout: TEST_TIMEOUT }, async () => {
  const path = `${root}/text/hello.txt` // parents are created
  const info = await sbx.files.write(path, 'hello wörld\n')
  assert.equal(info.path, path)
  assert.equal(info.name, 'hello.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(await sbx.files.read(path), 'hello wörld\n')
  const r = await sbx.commands.run(`cat ${path}`)
  assert.equal(r.stdout, 'hello wörld\n')

  // Overwrite, shorter.
  await sbx.files.write(path, 'short')
  assert.equal(await sbx.files.read(path), 'short')

  // Empty.
  await sbx.files.write(`${root}/text/empty`, '')
  assert.equal(await sbx.files.read(`${root}/text/empty`), '')
  const bytes = await sbx.files.read(`${root}/text/empty`, { format: 'bytes' })
  assert.equal(bytes.length, 0)
})

test('read a file the sandbox wrote, as text, bytes, blob and stream', { timeout: TEST_TIMEOUT }, async () => {
  const path = `${root}/made-inside.bin`
  await sbx.commands.run(`printf 'a\\x00b\\xff\\n' > ${path}`)
  const bytes = await sbx.files.read(path, { format: 'bytes' })
  assert.ok(bytes instanceof Uint8Array, `got ${bytes?.constructor?.name}`)
  assert.deepEqual([...bytes], [0x61, 0x00, 0x62, 0xff, 0x0a])

  const blob = await sbx.files.read(path, { format: 'blob' })
  assert.deepEqual([...new Uint8Array(await blob.arrayBuffer())], [0x61, 0x00, 0x62, 0xff, 0x0a])

  const stream = await sbx.files.read(path, { format: 'stream' })
  const parts = []
  for await (const chunk of stream) parts.push(Buffer.from(chunk))
  assert.deepEqual([...Buffer.concat(parts)], [0x61, 0x00, 0x62, 0xff, 0x0a])

  const text = await sbx.files.read(path, { format: 'text' })
  assert.equal(text.length, 5)
  assert.equal(text[0], 'a')
})

test('write binary data (ArrayBuffer, Blob) and read it back as bytes', { timeout: TEST_TIMEOUT }, async () => {
  const data = randomBytes(70_000)
  const ab = data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength)
  await sbx.files.write(`${root}/ab.bin`, ab)
  await sbx.files.write(`${root}/blob.bin`, new Blob([data]))
  for (const name of ['ab.bin', 'blob.bin']) {
    const back = await sbx.files.read(`${root}/${name}`, { format: 'bytes' })
    assert.ok(Buffer.from(back).equals(data), `${name} differs`)
  }
  const r = await sbx.commands.run(`sha256sum ${root}/ab.bin ${root}/blob.bin`)
  const sums = r.stdout.trim().split('\n').map((l) => l.split(/\s+/)[0])
  assert.deepEqual(sums, [sha256(data), sha256(data)])
})

test('a 50 MB binary file goes in and comes back unchanged', { timeout: LONG_TEST_TIMEOUT }, async () => {
  const data = randomBytes(50 * 1024 * 1024)
  const want = sha256(data)
  const path = `${root}/big/50mb.bin`
  const info = await sbx.files.write(path, new Blob([data]), { requestTimeoutMs: 150_000 })
  assert.equal(info.path, path)
  const r = await sbx.commands.run(`stat -c %s ${path}; sha256sum ${path}`, { timeoutMs: 120_000 })
  const [size, sum] = r.stdout.trim().split('\n')
  assert.equal(Number(size), data.length)
  assert.equal(sum.split(/\s+/)[0], want)
  assert.equal((await sbx.files.getInfo(path)).size, data.length)

  const back = await sbx.files.read(path, { format: 'bytes', requestTimeoutMs: 150_000 })
  assert.equal(back.length, data.length)
  assert.equal(sha256(back), want)
  await sbx.files.remove(path)
})

test('write with octet-stream, a ReadableStream, and gzip', { timeout: LONG_TEST_TIMEOUT }, async (t) => {
  if (!needsEnvd(t, '0.5.7', 'octet-stream uploads')) return
  const data = randomBytes(5 * 1024 * 1024)
  const want = sha256(data)

  await sbx.files.write(`${root}/octet.bin`, new Blob([data]), { useOctetStream: true })

  // A ReadableStream is streamed (chunked, octet-stream).
  const chunkSize = 256 * 1024
  let off = 0
  const stream = new ReadableStream({
    pull(controller) {
      if (off >= data.length) return controller.close()
      controller.enqueue(new Uint8Array(data.subarray(off, off + chunkSize)))
      off += chunkSize
    },
  })
  const info = await sbx.files.write(`${root}/streamed.bin`, stream)
  assert.equal(info.path, `${root}/streamed.bin`)

  // gzip: Content-Encoding: gzip on the upload, the file is stored decoded.
  await sbx.files.write(`${root}/gzipped.bin`, new Blob([data]), { gzip: true })
  await sbx.files.write(`${root}/gzipped.txt`, 'compressible '.repeat(10_000), { gzip: true })

  for (const name of ['octet.bin', 'streamed.bin', 'gzipped.bin']) {
    const back = await sbx.files.read(`${root}/${name}`, { format: 'bytes' })
    assert.equal(sha256(back), want, `${name} differs`)
  }
  assert.equal(await sbx.files.read(`${root}/gzipped.txt`, { gzip: true }), 'compressible '.repeat(10_000))
})

test('write several files at once', { timeout: TEST_TIMEOUT }, async () => {
  const infos = await sbx.files.write([
    { path: `${root}/multi/one.txt`, data: 'one' },
    { path: `${root}/multi/sub/two.txt`, data: 'two' },
  ])
  assert.ok(Array.isArray(infos), show(infos))
  assert.deepEqual(infos.map((i) => i.path).sort(), [`${root}/multi/one.txt`, `${root}/multi/sub/two.txt`])
  assert.equal(await sbx.files.read(`${root}/multi/one.txt`), 'one')
  assert.equal(await sbx.files.read(`${root}/multi/sub/two.txt`), 'two')
})

test('write and read as a given user', { timeout: TEST_TIMEOUT }, async () => {
  const path = `/tmp/${uniq('owned-by-nobody')}.txt` // /tmp: nobody may write there
  await sbx.files.write(path, 'mine', { user: 'nobody' })
  const info = await sbx.files.getInfo(path)
  assert.equal(info.owner, 'nobody')
  assert.equal(await sbx.files.read(path, { user: 'nobody' }), 'mine')
  const rootFile = `${root}/owned-by-root.txt`
  await sbx.files.write(rootFile, 'root', { user: 'root' })
  assert.equal((await sbx.files.getInfo(rootFile)).owner, 'root')
})

test('write with metadata', { timeout: TEST_TIMEOUT }, async (t) => {
  if (!needsEnvd(t, '0.6.2', 'X-Metadata-* headers')) return
  const path = `${root}/with-metadata.txt`
  const info = await sbx.files.write(path, 'x', { metadata: { Owner: 'alice', purpose: 'test run' } })
  assert.deepEqual(info.metadata, { owner: 'alice', purpose: 'test run' })
  const stat = await sbx.files.getInfo(path)
  assert.deepEqual(stat.metadata, { owner: 'alice', purpose: 'test run' })
})

test('list with depth 1 and 2', { timeout: TEST_TIMEOUT }, async () => {
  const dir = `${root}/tree`
  await sbx.files.write(`${dir}/a.txt`, 'aaaa')
  await sbx.files.write(`${dir}/sub/b.txt`, 'bb')
  await sbx.files.write(`${dir}/sub/deeper/c.txt`, 'c')

  const one = await sbx.files.list(dir)
  assert.deepEqual(one.map((e) => e.name).sort(), ['a.txt', 'sub'])
  const a = one.find((e) => e.name === 'a.txt')
  assert.equal(a.type, FileType.FILE)
  assert.equal(a.path, `${dir}/a.txt`)
  assert.equal(a.size, 4)
  assert.equal(one.find((e) => e.name === 'sub').type, FileType.DIR)

  const two = await sbx.files.list(dir, { depth: 2 })
  assert.deepEqual(two.map((e) => e.path).sort(),
    [`${dir}/a.txt`, `${dir}/sub`, `${dir}/sub/b.txt`, `${dir}/sub/deeper`])
  const deeper = two.find((e) => e.path === `${dir}/sub/deeper`)
  assert.equal(deeper.type, FileType.DIR)
  assert.equal(deeper.name, 'deeper')
  assert.equal(two.find((e) => e.path === `${dir}/sub/b.txt`).name, 'b.txt')

  const three = await sbx.files.list(dir, { depth: 3 })
  assert.ok(three.some((e) => e.path === `${dir}/sub/deeper/c.txt`), show(three.map((e) => e.path)))
})

test('makeDir: true, then false when it exists', { timeout: TEST_TIMEOUT }, async () => {
  const dir = `${root}/made/x/y` // parents are created
  assert.equal(await sbx.files.makeDir(dir), true)
  assert.equal(await sbx.files.makeDir(dir), false)
  const info = await sbx.files.getInfo(dir)
  assert.equal(info.type, FileType.DIR)
  assert.equal(info.name, 'y')
  assert.equal(info.path, dir)
  assert.equal((await sbx.files.getInfo(`${root}/made/x`)).type, FileType.DIR)
})

test('exists, getInfo', { timeout: TEST_TIMEOUT }, async () => {
  const path = `${root}/info/f.txt`
  const t0 = Date.now()
  await sbx.files.write(path, '0123456789')
  assert.equal(await sbx.files.exists(path), true)
  assert.equal(await sbx.files.exists(`${root}/info`), true)
  assert.equal(await sbx.files.exists(`${root}/info/nope`), false)
  assert.equal(await sbx.files.exists(`/no-such-dir-${uniq()}/x`), false)

  const f = await sbx.files.getInfo(path)
  assert.equal(f.type, FileType.FILE)
  assert.equal(f.name, 'f.txt')
  assert.equal(f.path, path)
  assert.equal(f.size, 10)
  assert.equal(typeof f.size, 'number')
  assert.equal(typeof f.mode, 'number')
  assert.match(f.permissions, /^-[rwx-]{9}$/)
  assert.ok(f.modifiedTime instanceof Date, `modifiedTime ${f.modifiedTime}`)
  assert.ok(Math.abs(f.modifiedTime.getTime() - t0) < 60_000, `modifiedTime ${f.modifiedTime.toISOString()}`)
  assert.equal(typeof f.owner, 'string')
  assert.equal(typeof f.group, 'string')

  await sbx.commands.run(`chmod 640 ${path}`, { user: 'root' })
  const m = await sbx.files.getInfo(path)
  assert.equal(m.mode & 0o777, 0o640)
  assert.equal(m.permissions, '-rw-r-----')

  const d = await sbx.files.getInfo(`${root}/info`)
  assert.equal(d.type, FileType.DIR)
  assert.equal(d.name, 'info')
  assert.equal(d.path, `${root}/info`)
  assert.match(d.permissions, /^d[rwx-]{9}$/)
})

test('rename a file and a directory', { timeout: TEST_TIMEOUT }, async () => {
  await sbx.files.write(`${root}/mv/old.txt`, 'moving')
  const moved = await sbx.files.rename(`${root}/mv/old.txt`, `${root}/mv/new.txt`)
  assert.equal(moved.path, `${root}/mv/new.txt`)
  assert.equal(moved.name, 'new.txt')
  assert.equal(moved.type, FileType.FILE)
  assert.equal(await sbx.files.exists(`${root}/mv/old.txt`), false)
  assert.equal(await sbx.files.read(`${root}/mv/new.txt`), 'moving')

  const dir = await sbx.files.rename(`${root}/mv`, `${root}/mv2`)
  assert.equal(dir.type, FileType.DIR)
  assert.equal(dir.path, `${root}/mv2`)
  assert.equal(await sbx.files.read(`${root}/mv2/new.txt`), 'moving')
})

test('remove a file and a directory with its contents', { timeout: TEST_TIMEOUT }, async () => {
  await sbx.files.write(`${root}/rm/a.txt`, 'a')
  await sbx.files.write(`${root}/rm/sub/b.txt`, 'b')
  await sbx.files.remove(`${root}/rm/a.txt`)
  assert.equal(await sbx.files.exists(`${root}/rm/a.txt`), false)
  assert.equal(await sbx.files.exists(`${root}/rm/sub/b.txt`), true)
  await sbx.files.remove(`${root}/rm`)
  assert.equal(await sbx.files.exists(`${root}/rm`), false)
})

test('a missing file: FileNotFoundError', { timeout: TEST_TIMEOUT }, async () => {
  const missing = `${root}/missing-${uniq()}`
  for (const [what, call] of [
    ['read', () => sbx.files.read(missing)],
    ['read bytes', () => sbx.files.read(missing, { format: 'bytes' })],
    ['getInfo', () => sbx.files.getInfo(missing)],
    ['list', () => sbx.files.list(missing)],
    ['rename', () => sbx.files.rename(missing, `${missing}-2`)],
  ]) {
    const err = await rejection(call, `files.${what} of a missing path`)
    assert.ok(err instanceof FileNotFoundError, `${what}: ${show(err)}`)
  }
})

test('watchDir sees a file written afterwards; stop() ends it', { timeout: TEST_TIMEOUT }, async () => {
  const dir = `${root}/watched`
  await sbx.files.makeDir(dir)
  const events = []
  let exited = false
  const handle = await sbx.files.watchDir(dir, (e) => events.push(e), {
    timeoutMs: 30_000, onExit: () => { exited = true },
  })
  try {
    await sbx.files.write(`${dir}/new.txt`, 'hello')
    await waitFor(() => events.some((e) => e.name === 'new.txt'), { what: 'an event for new.txt' })
    const e = events.find((x) => x.name === 'new.txt')
    assert.ok([FilesystemEventType.CREATE, FilesystemEventType.WRITE].includes(e.type), show(e))

    await sbx.commands.run(`rm ${dir}/new.txt`)
    await waitFor(() => events.some((x) => x.name === 'new.txt' && x.type === FilesystemEventType.REMOVE),
      { what: 'a remove event for new.txt' })

    // Not recursive: a file in a subdirectory is not reported.
    await sbx.files.makeDir(`${dir}/sub`)
    await sbx.files.write(`${dir}/sub/inner.txt`, 'x')
    await sleep(1_000)
    assert.ok(!events.some((x) => x.name.includes('inner.txt')), show(events))
  } finally {
    await handle.stop()
  }
  const n = events.length
  await sbx.files.write(`${dir}/after-stop.txt`, 'x')
  await sleep(1_000)
  assert.ok(!events.slice(n).some((x) => x.name === 'after-stop.txt'), 'an event after stop()')
  await waitFor(() => exited, { timeoutMs: 5_000, what: 'onExit after stop()' })
})

test('watchDir recursive, with entries', { timeout: TEST_TIMEOUT }, async (t) => {
  if (!needsEnvd(t, '0.6.3', 'includeEntry')) return
  const dir = `${root}/watched-rec`
  await sbx.files.makeDir(`${dir}/sub`)
  const events = []
  const handle = await sbx.files.watchDir(dir, (e) => events.push(e), {
    recursive: true, includeEntry: true, timeoutMs: 30_000,
  })
  try {
    await sbx.files.write(`${dir}/sub/deep.txt`, 'deep')
    await waitFor(() => events.some((e) => e.name === 'sub/deep.txt' && e.entry),
      { what: 'an event with an entry for sub/deep.txt' })
    const e = events.find((x) => x.name === 'sub/deep.txt' && x.entry)
    assert.equal(e.entry.path, `${dir}/sub/deep.txt`)
    assert.equal(e.entry.name, 'deep.txt')
    assert.equal(e.entry.type, FileType.FILE)
  } finally {
    await handle.stop()
  }
})

test('watchDir ends with a TimeoutError when its timeoutMs passes', { timeout: TEST_TIMEOUT }, async () => {
  const dir = `${root}/watched-timeout`
  await sbx.files.makeDir(dir)
  let exitErr = 'not called'
  const handle = await sbx.files.watchDir(dir, () => {}, {
    timeoutMs: 2_000, onExit: (err) => { exitErr = err },
  })
  try {
    await waitFor(() => exitErr !== 'not called', { timeoutMs: 15_000, what: 'onExit' })
    assert.ok(exitErr instanceof TimeoutError, show(exitErr))
  } finally {
    await handle.stop()
  }
})
