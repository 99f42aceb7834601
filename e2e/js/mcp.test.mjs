// The official MCP TypeScript client (@modelcontextprotocol/sdk, unmodified)
// against space's MCP server over both transports: `space mcp` on stdio
// (SPACE_BIN, configured like any CLI command through SPACE_URL and
// SPACE_API_KEY) and streamable HTTP at ${SPACE_URL}/mcp with the API key as
// bearer. Real sandboxes on SPACE_RUNTIME. The client checks every result's
// structuredContent against the tool's outputSchema, so these tests also hold
// the schemas to what the tools really return.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Client } from '@modelcontextprotocol/sdk/client/index.js'
import { StdioClientTransport, getDefaultEnvironment } from '@modelcontextprotocol/sdk/client/stdio.js'
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js'

const { SPACE_URL, SPACE_API_KEY, SPACE_BIN } = process.env
const RUNTIME = process.env.SPACE_RUNTIME || 'native'

const transports = {
  stdio: () => new StdioClientTransport({
    command: SPACE_BIN,
    args: ['mcp'],
    env: { ...getDefaultEnvironment(), SPACE_URL, SPACE_API_KEY },
    stderr: 'inherit',
  }),
  http: () => new StreamableHTTPClientTransport(new URL(`${SPACE_URL}/mcp`), {
    requestInit: { headers: { Authorization: `Bearer ${SPACE_API_KEY}` } },
  }),
}

const clients = []
const made = []
after(async () => {
  // Whatever a failed test left behind goes, through the REST API.
  for (const id of made) {
    await fetch(`${SPACE_URL}/v1/sandboxes/${id}?force=true`, {
      method: 'DELETE', headers: { Authorization: `Bearer ${SPACE_API_KEY}` },
    }).catch(() => {})
  }
  for (const c of clients) await c.close().catch(() => {})
})

async function connect (name) {
  const client = new Client({ name: 'space-e2e-js', version: '1.0.0' })
  await client.connect(transports[name]())
  clients.push(client)
  return client
}

// call returns a successful tool's structured output.
async function call (client, name, args) {
  const res = await client.callTool({ name, arguments: args }, undefined, { timeout: 180_000 })
  assert.ok(!res.isError, `${name} ${JSON.stringify(args)} failed: ${text(res)}`)
  assert.ok(res.structuredContent, `${name} returned no structured content`)
  return res.structuredContent
}

// callErr returns the message of a tool that must fail as a tool error.
async function callErr (client, name, args) {
  const res = await client.callTool({ name, arguments: args })
  assert.equal(res.isError, true, `${name} ${JSON.stringify(args)} should fail, got ${text(res)}`)
  return text(res)
}

const text = (res) => res.content.filter(c => c.type === 'text').map(c => c.text).join('')

for (const name of Object.keys(transports)) {
  test(`MCP over ${name}: tools, commands, background output, files, resources, errors`, async () => {
    const client = await connect(name)
    assert.equal(client.getServerVersion().name, 'space')

    const { tools } = await client.listTools()
    const names = tools.map(t => t.name).sort()
    for (const want of ['sandbox_create', 'sandbox_list', 'sandbox_get', 'sandbox_delete', 'sandbox_suspend',
      'sandbox_wake', 'sandbox_fork', 'command_run', 'command_start', 'command_output', 'command_list',
      'command_kill', 'file_read', 'file_write', 'file_list', 'port_expose']) {
      assert.ok(names.includes(want), `tool ${want} missing from ${names}`)
    }
    for (const t of tools) {
      assert.ok(t.description.length > 40, `${t.name} has a description a model can use`)
      assert.equal(t.inputSchema.type, 'object')
      assert.equal(t.outputSchema.type, 'object')
    }

    const sb = await call(client, 'sandbox_create', { runtime: RUNTIME, labels: { suite: `mcp-js-${name}` } })
    made.push(sb.id)
    assert.match(sb.id, /^sb-/)
    assert.equal(sb.state, 'running')
    assert.equal(sb.runtime, RUNTIME)
    assert.ok(sb.isolation)

    const run = await call(client, 'command_run', { id: sb.id, cmd: 'echo hi; exit 3' })
    assert.equal(run.exit_code, 3)
    assert.equal(run.stdout, 'hi\n')
    assert.equal(run.stderr, '')

    const argv = await call(client, 'command_run', { id: sb.id, cmd: ['sh', '-c', 'cat; echo " in $PWD"'], stdin: 'piped', cwd: '/tmp' })
    assert.equal(argv.stdout, 'piped in /tmp\n')

    // 200 KiB printed: 64 KiB returned, the rest counted.
    const big = await call(client, 'command_run', { id: sb.id, cmd: "head -c 204800 /dev/zero | tr '\\0' x" })
    assert.equal(big.stdout_truncated, true)
    assert.equal(big.stdout.length, 65536)
    assert.equal(big.stdout_omitted_bytes, 204800 - 65536)

    // A background command, its output read later by offset.
    const bg = await call(client, 'command_start', { id: sb.id, cmd: "sh -c 'sleep 0.5; echo later'" })
    assert.ok(bg.command_id)
    let out = ''
    let since = 0
    let o
    for (let i = 0; i < 30; i++) {
      o = await call(client, 'command_output', { id: sb.id, command_id: bg.command_id, since_stdout: since, wait_seconds: 5 })
      out += o.stdout
      since = o.next_stdout
      if (!o.running) break
    }
    assert.equal(out, 'later\n')
    assert.equal(o.running, false)
    assert.equal(o.exit_code, 0)
    assert.equal(since, 6)

    const { commands } = await call(client, 'command_list', { id: sb.id })
    assert.ok(commands.some(c => c.command_id === bg.command_id && c.state === 'exited'), JSON.stringify(commands))

    // Files.
    const w = await call(client, 'file_write', { id: sb.id, path: '/tmp/js/notes.txt', content: 'line one\nline two\n' })
    assert.equal(w.size, 18)
    const r = await call(client, 'file_read', { id: sb.id, path: '/tmp/js/notes.txt', offset: 5, limit: 3 })
    assert.equal(r.content, 'one')
    assert.equal(r.eof, false)
    assert.equal(r.next_offset, 8)
    const whole = await call(client, 'file_read', { id: sb.id, path: '/tmp/js/notes.txt' })
    assert.equal(whole.content, 'line one\nline two\n')
    assert.equal(whole.eof, true)
    const { entries } = await call(client, 'file_list', { id: sb.id, path: '/tmp/js' })
    assert.deepEqual(entries.map(e => [e.path, e.type, e.size]), [['/tmp/js/notes.txt', 'file', 18]])

    // Resources: the sandbox's state and a command's output.
    const { resources } = await client.listResources()
    assert.ok(resources.some(r => r.uri === `space://sandboxes/${sb.id}`))
    const state = await client.readResource({ uri: `space://sandboxes/${sb.id}` })
    assert.equal(JSON.parse(state.contents[0].text).id, sb.id)
    const output = await client.readResource({ uri: `space://sandboxes/${sb.id}/commands/${bg.command_id}/output` })
    assert.match(output.contents[0].text, /later/)

    // Errors are tool results a model can read, not protocol failures.
    assert.match(await callErr(client, 'command_run', { id: 'sb-doesnotexist0000', cmd: 'true' }), /not found.*sandbox_list/s)
    assert.match(await callErr(client, 'command_run', { id: sb.id, cmd: 42 }), /cmd/)
    assert.match(await callErr(client, 'file_read', { id: sb.id, path: '/tmp/js/missing' }), /not found/)

    const del = await call(client, 'sandbox_delete', { id: sb.id })
    assert.equal(del.deleted, true)
    assert.match(await callErr(client, 'sandbox_get', { id: sb.id }), /not found/)
  })
}

test('MCP over HTTP needs the API key', async () => {
  const body = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list', params: {} })
  const headers = { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream' }
  for (const auth of [undefined, 'Bearer sk_not_the_key_0123456789']) {
    const res = await fetch(`${SPACE_URL}/mcp`, { method: 'POST', body, headers: auth ? { ...headers, Authorization: auth } : headers })
    assert.equal(res.status, 401)
    assert.equal((await res.json()).error.code, 'unauthorized')
  }
  // And a client without it fails to connect.
  const client = new Client({ name: 'no-key', version: '1.0.0' })
  await assert.rejects(client.connect(new StreamableHTTPClientTransport(new URL(`${SPACE_URL}/mcp`))))
})
