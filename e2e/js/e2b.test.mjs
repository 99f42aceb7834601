// E2B's JS SDK (the npm package `e2b`, unmodified) against a real space
// server with real sandboxes, configured only through E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY and E2B_DOMAIN (set by e2e/node_test.go).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import {
  Sandbox, CommandExitError, NotFoundError, SandboxNotFoundError, AuthenticationError, TimeoutError,
} from 'e2b'

const made = []
async function create (opts = {}) {
  const sbx = await Sandbox.create({ timeoutMs: 10 * 60_000, ...opts })
  made.push(sbx.sandboxId)
  return sbx
}
after(async () => {
  for (const id of made) await Sandbox.kill(id).catch(() => {})
})

test('create, run, metadata, list, getInfo, kill', async () => {
  const sbx = await create({ metadata: { suite: 'e2b-js', n: '1' }, envs: { GREETING: 'hello' } })
  assert.match(sbx.sandboxId, /^sb-/)
  const r = await sbx.commands.run('echo $GREETING from $(whoami) in $PWD; echo err >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello from user in /home/user\n')
  assert.equal(r.stderr, 'err\n')

  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: 'e2b-js', n: '1' })
  assert.ok(info.endAt > info.startedAt)

  const page = await Sandbox.list({ query: { metadata: { suite: 'e2b-js', n: '1' } } }).nextItems()
  assert.deepEqual(page.map(s => s.sandboxId), [sbx.sandboxId])
  const none = await Sandbox.list({ query: { metadata: { suite: 'nope' } } }).nextItems()
  assert.deepEqual(none, [])

  assert.equal(await sbx.isRunning(), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
})

test('commands: exit codes, streaming callbacks, cwd, envs, user, timeout', async () => {
  const sbx = await create()
  await assert.rejects(sbx.commands.run('echo out; echo bad >&2; exit 7'), (err) => {
    assert.ok(err instanceof CommandExitError, `got ${err}`)
    assert.equal(err.exitCode, 7)
    assert.equal(err.stdout, 'out\n')
    assert.equal(err.stderr, 'bad\n')
    return true
  })
  const chunks = []
  const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.1; done', {
    onStdout: (d) => chunks.push(d),
  })
  assert.equal(chunks.join(''), 'line1\nline2\nline3\n')
  assert.equal(r.stdout, 'line1\nline2\nline3\n')
  assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await sbx.commands.run('echo $A-$B', { envs: { A: '1', B: 'two' } })).stdout, '1-two\n')
  assert.equal((await sbx.commands.run('id -un; echo $HOME', { user: 'root' })).stdout, 'root\n/root\n')
  assert.equal((await sbx.commands.run('id -u')).stdout, '1000\n')
  await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1500 }), TimeoutError)
})

test('background commands: list, stdin, connect after the first stream ends, kill', async () => {
  const sbx = await create()
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  assert.ok(h.pid > 0)
  const listed = await sbx.commands.list()
  assert.ok(listed.some(p => p.pid === h.pid && p.cmd === '/bin/bash'), JSON.stringify(listed))
  await sbx.commands.sendStdin(h.pid, 'ping\n')
  // Drop the first stream; a second client connects and sees the whole
  // output from the replay buffer, then more.
  await h.disconnect()
  const seen = []
  const h2 = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  await sbx.commands.sendStdin(h.pid, 'pong\n')
  for (let i = 0; i < 50 && seen.join('') !== 'ping\npong\n'; i++) await new Promise(r => setTimeout(r, 100))
  assert.equal(seen.join(''), 'ping\npong\n')
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(h2.wait(), (err) => err instanceof CommandExitError)
  assert.equal(await sbx.commands.kill(h.pid), false)
  assert.ok(!(await sbx.commands.list()).some(p => p.pid === h.pid))
  await assert.rejects(sbx.commands.connect(999999), NotFoundError)
})

test('a background server reached through getHost (host-routed ingress)', async () => {
  const sbx = await create()
  await sbx.files?.write?.('/tmp/www/hello.txt', 'hi from the sandbox').catch(() => {})
  await sbx.commands.run('mkdir -p /tmp/www && echo -n hi from the sandbox > /tmp/www/hello.txt')
  const srv = await sbx.commands.run('cd /tmp/www && exec python3 -m http.server 8000 --bind 0.0.0.0', { background: true })
  const host = sbx.getHost(8000)
  assert.equal(host, `8000-${sbx.sandboxId}.${process.env.E2B_DOMAIN}`)
  const url = new URL(process.env.SPACE_URL)
  let body = ''
  for (let i = 0; i < 100; i++) {
    body = await new Promise((resolve) => {
      const req = http.get({ host: url.hostname, port: url.port, path: '/hello.txt', headers: { Host: host } }, (res) => {
        let b = ''
        res.on('data', (d) => { b += d })
        res.on('end', () => resolve(res.statusCode === 200 ? b : ''))
      })
      req.on('error', () => resolve(''))
    })
    if (body) break
    await new Promise(r => setTimeout(r, 100))
  }
  assert.equal(body, 'hi from the sandbox')
  await srv.kill()
})

test('pty: create, input, resize, output, kill', async () => {
  const sbx = await create()
  let out = ''
  const dec = new TextDecoder()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d) } })
  assert.ok(term.pid > 0)
  await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; echo tty-$((6*7))\n'))
  for (let i = 0; i < 100 && !(out.includes('30 100') && out.includes('tty-42')); i++) await new Promise(r => setTimeout(r, 100))
  assert.ok(out.includes('30 100'), out)
  assert.ok(out.includes('tty-42'), out)
  assert.equal(await sbx.pty.kill(term.pid), true)
  await assert.rejects(term.wait())
})

test('pause is suspend; connect wakes it with its processes and files', async () => {
  const sbx = await create()
  await sbx.commands.run('echo kept > /home/user/state.txt')
  const bg = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await sbx.pause(), true)
  assert.equal((await sbx.getInfo()).state, 'paused')
  assert.equal(await Sandbox.pause(sbx.sandboxId), false) // already paused
  const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
  assert.ok(paused.some(s => s.sandboxId === sbx.sandboxId))
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.getInfo()).state, 'running')
  assert.equal((await again.commands.run('cat /home/user/state.txt')).stdout, 'kept\n')
  assert.ok((await again.commands.list()).some(p => p.pid === bg.pid), 'the background process survived suspend')
})

test('setTimeout moves the deadline; a passed deadline kills the sandbox', async () => {
  const sbx = await create()
  const before = (await sbx.getInfo()).endAt
  await sbx.setTimeout(20 * 60_000)
  const later = (await sbx.getInfo()).endAt
  assert.ok(later > before)
  await sbx.setTimeout(1000)
  let gone = false
  for (let i = 0; i < 60 && !gone; i++) {
    await new Promise(r => setTimeout(r, 500))
    gone = !(await Sandbox.list().nextItems()).some(s => s.sandboxId === sbx.sandboxId)
  }
  assert.ok(gone, 'the sandbox was deleted at its deadline')
})

test('list paginates', async () => {
  const tag = `page-${Date.now()}`
  const ids = []
  for (const s of await Promise.all([0, 1, 2].map(() => create({ metadata: { page: tag } })))) ids.push(s.sandboxId)
  const p = Sandbox.list({ query: { metadata: { page: tag } }, limit: 2 })
  const first = await p.nextItems()
  assert.equal(first.length, 2)
  assert.equal(p.hasNext, true)
  const second = await p.nextItems()
  assert.equal(second.length, 1)
  assert.equal(p.hasNext, false)
  assert.deepEqual([...first, ...second].map(s => s.sandboxId).sort(), ids.sort())
})

test('updateNetwork and getInfo report the policy; unsupported options are refused by name', async () => {
  const sbx = await create({ network: { allowOut: ['example.com'], denyOut: ['0.0.0.0/0'] } })
  let info = await sbx.getInfo()
  assert.deepEqual(info.network.allowOut, ['example.com'])
  await Sandbox.updateNetwork(sbx.sandboxId, { allowOut: ['pypi.org', '0.0.0.0/0'] })
  info = await sbx.getInfo()
  assert.deepEqual(info.network.allowOut.sort(), ['0.0.0.0/0', 'pypi.org'])
  await assert.rejects(create({ network: { maskRequestHost: 'x.example.com' } }), /maskRequestHost/)
})

test('errors: wrong key is AuthenticationError, unknown sandbox NotFound, unknown template named', async () => {
  await assert.rejects(Sandbox.create({ apiKey: 'sk_wrong_wrong_wrong' }), AuthenticationError)
  await assert.rejects(Sandbox.connect('sb-doesnotexist0000'), SandboxNotFoundError)
  await assert.rejects(Sandbox.create('code-interpreter-v1'), /template "code-interpreter-v1" not found/)
  const sbx = await create()
  const bad = await Sandbox.connect(sbx.sandboxId)
  bad.envdAccessToken = 'ea_wrong'
  await assert.rejects(bad.commands.run('true'), AuthenticationError)
  // Raw HTTP: E2B's error shape for what is not served, 413 for an
  // oversized body, 401 without a key.
  const api = process.env.E2B_API_URL
  const key = { 'X-API-KEY': process.env.E2B_API_KEY, 'Content-Type': 'application/json' }
  let res = await fetch(`${api}/volumes`, { headers: key })
  assert.equal(res.status, 404)
  const body = await res.json()
  assert.equal(body.code, 404)
  assert.match(body.message, /not part of the E2B API this server implements/)
  res = await fetch(`${api}/v2/sandboxes`, { method: 'POST', headers: key, body: JSON.stringify({ templateID: 'base', metadata: { pad: 'x'.repeat(2 << 20) } }) })
  assert.equal(res.status, 413)
  assert.equal((await res.json()).code, 413)
  res = await fetch(`${api}/v2/sandboxes`)
  assert.equal(res.status, 401)
  res = await fetch(`${api}/v2/sandboxes`, { method: 'POST', headers: key, body: JSON.stringify({ templateID: 'base', mcp: { x: {} } }) })
  assert.equal(res.status, 422)
  assert.match((await res.json()).message, /mcp/)
})

test('many sandboxes at once', async () => {
  const n = 8
  const sbxs = await Promise.all(Array.from({ length: n }, () => create()))
  const outs = await Promise.all(sbxs.map((s, i) => s.commands.run(`echo ${i}`)))
  assert.deepEqual(outs.map(o => o.stdout), Array.from({ length: n }, (_, i) => `${i}\n`))
  await Promise.all(sbxs.map(s => s.kill()))
})

test('getMetrics is a current sample of the sandbox', async () => {
  const sbx = await create()
  await sbx.commands.run('head -c 32M /dev/zero > /home/user/fill')
  const [m] = await sbx.getMetrics()
  assert.ok(m.timestamp instanceof Date)
  assert.ok(m.cpuCount >= 1, JSON.stringify(m))
  assert.ok(m.memUsed > 0 && m.memTotal >= m.memUsed, JSON.stringify(m))
  assert.ok(m.diskUsed >= 30 << 20, `disk used ${m.diskUsed}`)
})

test('fork copies a running sandbox: memory, disk and a fresh identity', async () => {
  const sbx = await create()
  await sbx.commands.run('echo parent-file > /home/user/f.txt')
  const children = await sbx.fork({ count: 2 })
  assert.equal(children.length, 2)
  for (const c of children) {
    assert.ok(!(c instanceof Error), String(c))
    made.push(c.sandboxId)
    assert.notEqual(c.sandboxId, sbx.sandboxId)
    assert.equal((await c.commands.run('cat /home/user/f.txt')).stdout, 'parent-file\n')
    const info = await c.getInfo()
    assert.equal(info.state, 'running')
  }
  const names = await Promise.all([sbx, ...children].map(async s => (await s.commands.run('hostname')).stdout))
  assert.equal(new Set(names).size, 3, `hostnames ${names}`)
})

test('lifecycle onTimeout pause: the deadline suspends instead of killing', async () => {
  const sbx = await create({ lifecycle: { onTimeout: 'pause' } })
  await sbx.commands.run('echo still-here > /home/user/k.txt')
  assert.equal((await sbx.getInfo()).lifecycle.onTimeout, 'pause')
  await sbx.setTimeout(1000)
  let state = ''
  for (let i = 0; i < 60 && state !== 'paused'; i++) {
    await new Promise(r => setTimeout(r, 500))
    state = (await sbx.getInfo()).state
  }
  assert.equal(state, 'paused')
  const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
  assert.equal((await back.commands.run('cat /home/user/k.txt')).stdout, 'still-here\n')
})

test('snapshots: the filesystem as a template the sandbox runs on past; create from it, list, delete', async () => {
  const sbx = await create()
  await sbx.commands.run('echo snap > /home/user/s.txt')
  const bg = await sbx.commands.run('sleep 600', { background: true })
  const name = `snap-${Date.now()}`
  const snap = await sbx.createSnapshot({ name })
  assert.equal(snap.snapshotId, `${name}:latest`)
  assert.deepEqual(snap.names, [snap.snapshotId])
  assert.ok((await sbx.commands.list()).some(p => p.pid === bg.pid), 'the sandbox ran on through its snapshot')
  const listed = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
  assert.deepEqual(listed.map(s => s.snapshotId), [snap.snapshotId])
  const fromSnap = await create({ template: snap.snapshotId })
  assert.equal((await fromSnap.commands.run('cat /home/user/s.txt; id -un')).stdout, 'snap\nuser\n')
  await fromSnap.kill()
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  assert.deepEqual(await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems(), [])

  // A runtime that cannot fork is refused, saying so.
  const auth = { Authorization: `Bearer ${process.env.SPACE_API_KEY}`, 'Content-Type': 'application/json' }
  const res = await fetch(`${process.env.SPACE_URL}/v1/sandboxes`, { method: 'POST', headers: auth, body: JSON.stringify({ runtime: 'native' }) })
  assert.equal(res.status, 202)
  const nat = (await res.json()).sandbox.id
  made.push(nat)
  let st = ''
  for (let i = 0; i < 100 && st !== 'running'; i++) {
    st = (await (await fetch(`${process.env.SPACE_URL}/v1/sandboxes/${nat}`, { headers: auth })).json()).state
    if (st !== 'running') await new Promise(r => setTimeout(r, 100))
  }
  await assert.rejects(Sandbox.createSnapshot(nat), (err) => {
    assert.match(err.message, /forking/)
    assert.equal(err.statusCode, 422)
    return true
  })
})
