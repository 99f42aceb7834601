// E2B's SDK, unmodified, against space's envd filesystem service and
// /files: every files.* call on a real sandbox, signed upload/download URLs
// with plain fetch, and the E2B user's permissions.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { gzipSync } from 'node:zlib'
import { Sandbox, FileType, NotFoundError, FileNotFoundError, SandboxError, InvalidArgumentError } from 'e2b'

// withSandbox runs fn with a fresh sandbox and kills it afterwards.
async function withSandbox (fn) {
  const sbx = await Sandbox.create({ timeoutMs: 5 * 60 * 1000 })
  try {
    await fn(sbx)
  } finally {
    await sbx.kill()
  }
}

const decoder = new TextDecoder()

async function streamText (stream) {
  const chunks = []
  for await (const c of stream) chunks.push(c)
  return decoder.decode(Buffer.concat(chunks.map((c) => Buffer.from(c))))
}

test('write and read text, bytes, Blob, streams and several files', async () => {
  await withSandbox(async (sbx) => {
    const info = await sbx.files.write('/tmp/a/b/hello.txt', 'hello, space')
    assert.equal(info.path, '/tmp/a/b/hello.txt')
    assert.equal(info.name, 'hello.txt')
    assert.equal(info.type, 'file')
    assert.equal(await sbx.files.read('/tmp/a/b/hello.txt'), 'hello, space')

    // A relative path is relative to the user's home.
    const rel = await sbx.files.write('notes/rel.txt', 'relative')
    assert.equal(rel.path, '/home/user/notes/rel.txt')
    assert.equal(await sbx.files.read('/home/user/notes/rel.txt'), 'relative')

    const bytes = new Uint8Array(256 * 1024)
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 7) & 0xff
    await sbx.files.write('/tmp/bytes.bin', bytes)
    const back = await sbx.files.read('/tmp/bytes.bin', { format: 'bytes' })
    assert.ok(back instanceof Uint8Array)
    assert.equal(back.length, bytes.length)
    assert.deepEqual(Buffer.from(back), Buffer.from(bytes))

    await sbx.files.write('/tmp/blob.txt', new Blob(['from a blob']))
    const blob = await sbx.files.read('/tmp/blob.txt', { format: 'blob' })
    assert.equal(await blob.text(), 'from a blob')

    // A ReadableStream goes up as application/octet-stream.
    const parts = ['streamed ', 'in ', 'three parts']
    const stream = new ReadableStream({
      start (c) { for (const p of parts) c.enqueue(new TextEncoder().encode(p)); c.close() }
    })
    await sbx.files.write('/tmp/stream.txt', stream)
    assert.equal(await streamText(await sbx.files.read('/tmp/stream.txt', { format: 'stream' })), parts.join(''))

    // gzip both ways.
    await sbx.files.write('/tmp/gz.txt', 'zipped '.repeat(1000), { gzip: true })
    assert.equal(await sbx.files.read('/tmp/gz.txt', { gzip: true }), 'zipped '.repeat(1000))

    // An empty file reads as empty in every format.
    await sbx.files.write('/tmp/empty', '')
    assert.equal(await sbx.files.read('/tmp/empty'), '')
    assert.equal((await sbx.files.read('/tmp/empty', { format: 'bytes' })).length, 0)

    // Several files in one multipart request.
    const many = await sbx.files.write([
      { path: '/tmp/many/one.txt', data: 'one' },
      { path: '/tmp/many/sub/two.txt', data: new TextEncoder().encode('two') },
      { path: 'many-three.txt', data: new Blob(['three']) }
    ])
    assert.deepEqual(many.map((w) => w.path), ['/tmp/many/one.txt', '/tmp/many/sub/two.txt', '/home/user/many-three.txt'])
    assert.equal(await sbx.files.read('/tmp/many/sub/two.txt'), 'two')
    assert.equal(await sbx.files.read('~/many-three.txt'), 'three')

    // Overwriting replaces.
    await sbx.files.write('/tmp/a/b/hello.txt', 'again')
    assert.equal(await sbx.files.read('/tmp/a/b/hello.txt'), 'again')

    // The files are really there for a command, too.
    const r = await sbx.commands.run('cat /tmp/a/b/hello.txt /tmp/many/one.txt')
    assert.equal(r.stdout, 'againone')
  })
})

test('list with depth, exists, getInfo, makeDir, rename, remove and not-found errors', async () => {
  await withSandbox(async (sbx) => {
    await sbx.files.write([
      { path: '/tmp/tree/a.txt', data: 'aaaa' },
      { path: '/tmp/tree/d/b.txt', data: 'b' },
      { path: '/tmp/tree/d/e/c.txt', data: 'c' }
    ])
    const one = await sbx.files.list('/tmp/tree')
    assert.deepEqual(one.map((e) => [e.name, e.type]), [['a.txt', FileType.FILE], ['d', FileType.DIR]])
    const two = await sbx.files.list('/tmp/tree', { depth: 2 })
    assert.deepEqual(two.map((e) => e.path), ['/tmp/tree/a.txt', '/tmp/tree/d', '/tmp/tree/d/b.txt', '/tmp/tree/d/e'])
    const three = await sbx.files.list('/tmp/tree', { depth: 3 })
    assert.equal(three.length, 5)
    assert.ok(three.some((e) => e.path === '/tmp/tree/d/e/c.txt'))
    await assert.rejects(sbx.files.list('/tmp/tree/a.txt'), InvalidArgumentError)
    await assert.rejects(sbx.files.list('/tmp/nope'), NotFoundError)

    assert.equal(await sbx.files.exists('/tmp/tree/a.txt'), true)
    assert.equal(await sbx.files.exists('/tmp/tree/d'), true)
    assert.equal(await sbx.files.exists('/tmp/tree/missing'), false)

    const fi = await sbx.files.getInfo('/tmp/tree/a.txt')
    assert.equal(fi.type, FileType.FILE)
    assert.equal(fi.name, 'a.txt')
    assert.equal(fi.path, '/tmp/tree/a.txt')
    assert.equal(fi.size, 4)
    assert.equal(fi.permissions, '-rw-r--r--')
    assert.equal(fi.mode, 0o644)
    assert.equal(fi.owner, 'user')
    assert.equal(fi.group, 'user')
    assert.ok(fi.modifiedTime instanceof Date)
    assert.ok(Math.abs(fi.modifiedTime.getTime() - Date.now()) < 5 * 60 * 1000, `modifiedTime ${fi.modifiedTime} is now`)
    const di = await sbx.files.getInfo('/tmp/tree/d')
    assert.equal(di.type, FileType.DIR)
    assert.equal(di.permissions, 'drwxr-xr-x')
    const root = await sbx.files.getInfo('/root', { user: 'root' })
    assert.equal(root.owner, 'root')
    await sbx.commands.run('ln -s /tmp/tree/a.txt /tmp/tree/link', { user: 'root' })
    const li = await sbx.files.getInfo('/tmp/tree/link')
    assert.equal(li.type, FileType.SYMLINK)
    assert.equal(li.symlinkTarget, '/tmp/tree/a.txt')
    await assert.rejects(sbx.files.getInfo('/tmp/tree/missing'), NotFoundError)

    assert.equal(await sbx.files.makeDir('/tmp/made/deep/er'), true)
    assert.equal(await sbx.files.makeDir('/tmp/made/deep/er'), false)
    assert.equal((await sbx.files.getInfo('/tmp/made/deep/er')).type, FileType.DIR)
    await assert.rejects(sbx.files.makeDir('/tmp/tree/a.txt'), InvalidArgumentError)

    const moved = await sbx.files.rename('/tmp/tree/a.txt', '/tmp/moved/here.txt')
    assert.equal(moved.path, '/tmp/moved/here.txt')
    assert.equal(moved.type, FileType.FILE)
    assert.equal(moved.size, 4)
    assert.equal(await sbx.files.exists('/tmp/tree/a.txt'), false)
    assert.equal(await sbx.files.read('/tmp/moved/here.txt'), 'aaaa')
    await assert.rejects(sbx.files.rename('/tmp/tree/gone', '/tmp/x'), NotFoundError)

    await sbx.files.remove('/tmp/moved/here.txt')
    assert.equal(await sbx.files.exists('/tmp/moved/here.txt'), false)
    await sbx.files.remove('/tmp/tree') // a whole tree
    assert.equal(await sbx.files.exists('/tmp/tree'), false)
    await assert.rejects(sbx.files.remove('/tmp/tree'), NotFoundError)

    // A missing file: the SDK's FileNotFoundError (a NotFoundError).
    const err = await sbx.files.read('/tmp/does-not-exist').then(() => null, (e) => e)
    assert.ok(err instanceof FileNotFoundError, `got ${err}`)
    assert.ok(err instanceof NotFoundError)
    assert.match(err.message, /does-not-exist/)
    // A directory is not a file.
    await assert.rejects(sbx.files.read('/tmp'), InvalidArgumentError)
  })
})

test('watchDir reports create, write and remove, and stops', async () => {
  await withSandbox(async (sbx) => {
    await sbx.files.makeDir('/tmp/w')
    const events = []
    let exited = false
    const handle = await sbx.files.watchDir('/tmp/w', (ev) => { events.push(ev) }, { onExit: () => { exited = true } })
    await sbx.files.write('/tmp/w/f.txt', 'first')
    await sbx.commands.run('echo more >> /tmp/w/f.txt')
    await sbx.files.remove('/tmp/w/f.txt')
    const deadline = Date.now() + 10000
    while (!events.some((e) => e.type === 'remove') && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    await handle.stop()
    const types = events.filter((e) => e.name === 'f.txt').map((e) => e.type)
    assert.ok(types.includes('create'), `events ${JSON.stringify(events)}`)
    assert.ok(types.includes('write'), `events ${JSON.stringify(events)}`)
    assert.equal(types.at(-1), 'remove', `events ${JSON.stringify(events)}`)
    assert.ok(types.indexOf('create') < types.indexOf('write'))
    // After stop, nothing more arrives.
    const n = events.length
    await sbx.files.write('/tmp/w/after.txt', 'x')
    await new Promise((resolve) => setTimeout(resolve, 500))
    assert.equal(events.length, n)
    void exited

    // Recursive: changes in a new subdirectory, named relative to the watched one.
    const deep = []
    const rh = await sbx.files.watchDir('/tmp/w', (ev) => { deep.push(ev) }, { recursive: true })
    await sbx.files.write('/tmp/w/sub/deep.txt', 'deep')
    for (const end = Date.now() + 10000; !deep.some((e) => e.name === 'sub/deep.txt') && Date.now() < end;) {
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    await rh.stop()
    assert.ok(deep.some((e) => e.name === 'sub' && e.type === 'create'), `events ${JSON.stringify(deep)}`)
    assert.ok(deep.some((e) => e.name === 'sub/deep.txt' && e.type === 'create'), `events ${JSON.stringify(deep)}`)

    // A missing directory is the SDK's NotFoundError, a file its InvalidArgumentError.
    await assert.rejects(sbx.files.watchDir('/tmp/nope', () => {}), NotFoundError)
    await assert.rejects(sbx.files.watchDir('/tmp/w/after.txt', () => {}), InvalidArgumentError)
  })
})

test('polling watchers: CreateWatcher, GetWatcherEvents, RemoveWatcher (Connect JSON, as E2B\'s other SDKs call them)', async () => {
  await withSandbox(async (sbx) => {
    const call = async (method, body) => {
      const res = await fetch(`${process.env.E2B_SANDBOX_URL}/filesystem.Filesystem/${method}`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': sbx.envdAccessToken },
        body: JSON.stringify(body)
      })
      return { status: res.status, body: await res.json() }
    }
    await sbx.files.makeDir('/tmp/pw')
    const created = await call('CreateWatcher', { path: '/tmp/pw', recursive: true })
    assert.equal(created.status, 200, JSON.stringify(created.body))
    const id = created.body.watcherId
    assert.ok(id)
    await sbx.files.write('/tmp/pw/sub/x.txt', 'x')
    await sbx.files.remove('/tmp/pw/sub/x.txt')
    const seen = []
    for (const end = Date.now() + 10000; !seen.some((e) => e.name === 'sub/x.txt' && e.type === 'EVENT_TYPE_REMOVE') && Date.now() < end;) {
      const got = await call('GetWatcherEvents', { watcherId: id })
      assert.equal(got.status, 200, JSON.stringify(got.body))
      seen.push(...got.body.events)
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    const names = seen.map((e) => `${e.type} ${e.name}`)
    assert.ok(names.includes('EVENT_TYPE_CREATE sub'), names.join(', '))
    assert.ok(names.includes('EVENT_TYPE_CREATE sub/x.txt'), names.join(', '))
    assert.ok(names.includes('EVENT_TYPE_REMOVE sub/x.txt'), names.join(', '))

    // Removal ends it (another sandbox cannot reach it: the unit tests).
    const removed = await call('RemoveWatcher', { watcherId: id })
    assert.equal(removed.status, 200)
    const after = await call('GetWatcherEvents', { watcherId: id })
    assert.equal(after.status, 404)
    assert.equal(after.body.code, 'not_found')

    const missing = await call('CreateWatcher', { path: '/tmp/none' })
    assert.equal(missing.status, 404)
    assert.equal(missing.body.code, 'not_found')
  })
})

test('signed upload and download URLs work with plain fetch, and only as signed', async () => {
  await withSandbox(async (sbx) => {
    const up = await sbx.uploadUrl('/tmp/up/signed.txt')
    assert.match(up, /signature=v1_/)
    const form = new FormData()
    form.append('file', new Blob(['uploaded by url']), 'ignored-name')
    let res = await fetch(up, { method: 'POST', body: form })
    assert.equal(res.status, 200, await res.clone().text())
    const written = await res.json()
    assert.equal(written[0].path, '/tmp/up/signed.txt')

    const down = await sbx.downloadUrl('/tmp/up/signed.txt')
    res = await fetch(down)
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'uploaded by url')

    // An upload URL does not download, and a download URL does not upload.
    res = await fetch(up)
    assert.equal(res.status, 401)
    res = await fetch(down, { method: 'POST', body: form })
    assert.equal(res.status, 401)
    await res.text()

    // Tampered: another path under the same signature.
    const other = new URL(down)
    other.searchParams.set('path', '/etc/shadow')
    res = await fetch(other)
    assert.equal(res.status, 401)
    const body = await res.json()
    assert.equal(body.code, 401)
    assert.match(body.message, /signature/)

    // Expiry: a URL valid for an hour works; one that expired does not.
    const fresh = await sbx.downloadUrl('/tmp/up/signed.txt', { useSignatureExpiration: 3600 })
    assert.match(fresh, /signature_expiration=/)
    res = await fetch(fresh)
    assert.equal(res.status, 200)
    await res.text()
    const expired = await sbx.downloadUrl('/tmp/up/signed.txt', { useSignatureExpiration: -10 })
    res = await fetch(expired)
    assert.equal(res.status, 401)
    assert.match((await res.json()).message, /expired/)

    // No signature at all.
    const bare = new URL(down)
    bare.searchParams.delete('signature')
    res = await fetch(bare)
    assert.equal(res.status, 401)
    await res.text()

    // A missing file through a signed URL: E2B's 404 shape.
    res = await fetch(await sbx.downloadUrl('/tmp/up/none.txt'))
    assert.equal(res.status, 404)
    assert.equal((await res.json()).code, 404)
  })
})

test('files are written and read as the E2B user: root may write /root, user may not', async () => {
  await withSandbox(async (sbx) => {
    const w = await sbx.files.write('/root/secret.txt', 'root only', { user: 'root' })
    assert.equal(w.path, '/root/secret.txt')
    assert.equal(await sbx.files.read('/root/secret.txt', { user: 'root' }), 'root only')
    assert.equal((await sbx.files.getInfo('/root/secret.txt', { user: 'root' })).owner, 'root')
    // Relative paths are relative to root's home for root.
    assert.equal((await sbx.files.write('rel.txt', 'r', { user: 'root' })).path, '/root/rel.txt')

    const err = await sbx.files.write('/root/nope.txt', 'x').then(() => null, (e) => e)
    assert.ok(err instanceof SandboxError, `writing /root as user: got ${err}`)
    assert.match(err.message, /permission denied/)
    await assert.rejects(sbx.files.read('/root/secret.txt'), /permission denied/)
    await assert.rejects(sbx.files.makeDir('/root/sub'), /permission denied/)
    assert.equal(await sbx.files.exists('/root/nope.txt', { user: 'root' }), false)

    // A URL signed for user stays user's whatever header its bearer adds;
    // one signed for root reads as root.
    const asRoot = { Authorization: 'Basic ' + Buffer.from('root:').toString('base64') }
    let res = await fetch(await sbx.downloadUrl('/root/secret.txt'), { headers: asRoot })
    assert.equal(res.status, 403, await res.clone().text())
    assert.match((await res.json()).message, /permission denied/)
    res = await fetch(await sbx.downloadUrl('/root/secret.txt', { user: 'root' }))
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'root only')

    // What user writes is user's.
    await sbx.files.write('/tmp/mine.txt', 'mine')
    const fi = await sbx.files.getInfo('/tmp/mine.txt')
    assert.equal(fi.owner, 'user')
    const r = await sbx.commands.run('stat -c %U:%G /tmp/mine.txt')
    assert.equal(r.stdout.trim(), 'user:user')
  })
})

test('an upload over the server limit is refused with 413', async () => {
  await withSandbox(async (sbx) => {
    const big = new Uint8Array(9 << 20) // the shared test server allows 8 MiB
    const err = await sbx.files.write('/tmp/big.bin', big).then(() => null, (e) => e)
    assert.ok(err instanceof SandboxError, `got ${err}`)
    assert.match(err.message, /413/)
    // A gzip body that inflates past the limit is refused the same way.
    const bomb = gzipSync(Buffer.alloc(9 << 20))
    const res = await fetch(await sbx.uploadUrl('/tmp/bomb.bin'), {
      method: 'POST', body: bomb, headers: { 'Content-Type': 'application/octet-stream', 'Content-Encoding': 'gzip' }
    })
    assert.equal(res.status, 413)
    await res.text()
    assert.equal(await sbx.files.exists('/tmp/big.bin'), false)
  })
})
