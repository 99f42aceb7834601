// E2B's JS SDK (unmodified) against a cluster replica: run by
// e2e/TestClusterReplicasAndNodes with E2B_API_URL, E2B_SANDBOX_URL,
// E2B_DOMAIN and E2B_API_KEY pointing at the replica (REPLICA_URL). Not a
// *.test.mjs file: TestNodeSuites runs those against a single server.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { Sandbox, SandboxNotFoundError } from 'e2b'

const made = []
after(async () => {
  for (const id of made) await Sandbox.kill(id).catch(() => {})
})

function getVia (replica, host, path) {
  return new Promise((resolve) => {
    const req = http.get({ host: replica.hostname, port: replica.port, path, headers: { Host: host } }, (res) => {
      let b = ''
      res.on('data', (d) => { b += d })
      res.on('end', () => resolve(res.statusCode === 200 ? b : ''))
    })
    req.on('error', () => resolve(''))
  })
}

test('E2B through a cluster replica: create, commands, files, list, connect, host-routed port, kill', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 10 * 60_000, metadata: { suite: 'e2b-cluster' }, envs: { GREETING: 'hello' } })
  made.push(sbx.sandboxId)
  console.log(`sandbox ${sbx.sandboxId}`)

  const r = await sbx.commands.run('echo $GREETING from $(whoami); echo err >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello from user\n')
  assert.equal(r.stderr, 'err\n')
  const chunks = []
  const streamed = await sbx.commands.run('for i in 1 2 3; do echo l$i; sleep 0.1; done', { onStdout: (d) => chunks.push(d) })
  assert.equal(streamed.stdout, 'l1\nl2\nl3\n')
  assert.equal(chunks.join(''), 'l1\nl2\nl3\n')

  await sbx.files.write('/tmp/cluster/c.txt', 'cluster-file')
  assert.equal(await sbx.files.read('/tmp/cluster/c.txt'), 'cluster-file')
  const entries = await sbx.files.list('/tmp/cluster')
  assert.deepEqual(entries.map(e => e.name), ['c.txt'])

  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: 'e2b-cluster' })
  const page = await Sandbox.list({ query: { metadata: { suite: 'e2b-cluster' } } }).nextItems()
  assert.deepEqual(page.map(s => s.sandboxId), [sbx.sandboxId])
  await sbx.setTimeout(5 * 60_000)

  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.commands.run('cat /tmp/cluster/c.txt')).stdout, 'cluster-file')

  await sbx.commands.run('mkdir -p /tmp/www && echo -n via the replica > /tmp/www/hello.txt')
  await sbx.commands.run('cd /tmp/www && exec python3 -m http.server 8000 --bind 0.0.0.0', { background: true })
  const host = sbx.getHost(8000)
  assert.equal(host, `8000-${sbx.sandboxId}.${process.env.E2B_DOMAIN}`)
  const replica = new URL(process.env.REPLICA_URL)
  let body = ''
  for (let i = 0; i < 100 && !body; i++) {
    body = await getVia(replica, host, '/hello.txt')
    if (!body) await new Promise(resolve => setTimeout(resolve, 100))
  }
  assert.equal(body, 'via the replica')

  assert.equal(await Sandbox.kill(sbx.sandboxId), true)
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
})
