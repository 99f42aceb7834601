// The front-door driver of e2e/frontdoor_test.go: the real npm clients
// (E2B's SDK `e2b` and the MCP TypeScript SDK, unmodified) making one call
// at a time for the Go test, which holds the matrix and checks each row's
// refusal, the audit record and the sandbox afterwards.
//
// Protocol: one JSON request per line on stdin, {id, door, op, sandbox,
// ...args}; one JSON answer per line on stdout, {id, ok, status, message,
// class}. status is the HTTP status the client saw (from the SDK's error,
// or the status of an envd Connect error's code); message is what
// the client would show its caller (an MCP tool error's text). Nothing
// here judges a result. Not a *.test.mjs: TestNodeSuites does not run it.
import readline from 'node:readline'
import { Sandbox } from 'e2b'
import { Client } from '@modelcontextprotocol/sdk/client/index.js'
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js'

const { SPACE_URL, SPACE_API_KEY } = process.env

let mcp
async function mcpClient () {
  if (!mcp) {
    const c = new Client({ name: 'space-frontdoor', version: '1.0.0' })
    await c.connect(new StreamableHTTPClientTransport(new URL(`${SPACE_URL}/mcp`), {
      requestInit: { headers: { Authorization: `Bearer ${SPACE_API_KEY}` } }
    }))
    mcp = c
  }
  return mcp
}

// Sandboxes the Go test created through REST, reached as any E2B program
// reaches an existing sandbox.
const sandboxes = new Map()
async function e2b (id) {
  if (!sandboxes.has(id)) sandboxes.set(id, await Sandbox.connect(id, { timeoutMs: 10 * 60_000 }))
  return sandboxes.get(id)
}

const root = { user: 'root' } // so the sandbox's kernel would allow what the policy must refuse

const ops = {
  mcp: {
    async tool (req) {
      const res = await (await mcpClient()).callTool({ name: req.tool, arguments: req.arguments }, undefined, { timeout: 120_000 })
      const text = res.content.filter(c => c.type === 'text').map(c => c.text).join('')
      return { ok: !res.isError, message: text }
    }
  },
  e2b: {
    async write (req) { await (await e2b(req.sandbox)).files.write(req.path, req.data, root) },
    async writeMany (req) { await (await e2b(req.sandbox)).files.write(req.files, root) },
    async makeDir (req) { await (await e2b(req.sandbox)).files.makeDir(req.path, root) },
    async rename (req) { await (await e2b(req.sandbox)).files.rename(req.from, req.to, root) },
    async remove (req) { await (await e2b(req.sandbox)).files.remove(req.path, root) },
    async run (req) { await (await e2b(req.sandbox)).commands.run(req.cmd, root) },
    async read (req) { await (await e2b(req.sandbox)).files.read(req.path, root) },
    async stat (req) { await (await e2b(req.sandbox)).files.getInfo(req.path, root) },
    async list (req) { await (await e2b(req.sandbox)).files.list(req.path, root) },
    async watch (req) {
      const handle = await (await e2b(req.sandbox)).files.watchDir(req.path, () => {}, root)
      await handle.stop()
    },
    // A signed download URL, fetched as a browser would.
    async downloadUrl (req) {
      const url = await (await e2b(req.sandbox)).downloadUrl(req.path, root)
      const res = await fetch(url)
      const body = await res.text()
      let message = body
      try { message = JSON.parse(body).message ?? body } catch {}
      return { ok: res.ok, status: res.status, message }
    },
    async setTimeout (req) { await (await e2b(req.sandbox)).setTimeout(req.ms) },
    // Sandbox.connect itself, not the cached handle: it wakes a paused one.
    async connect (req) { await Sandbox.connect(req.sandbox) },
    // A signed upload URL, POSTed with plain fetch as a browser would.
    async uploadUrl (req) {
      const url = await (await e2b(req.sandbox)).uploadUrl(req.path, root)
      const form = new FormData()
      form.append('file', new Blob([req.data]), 'ignored')
      const res = await fetch(url, { method: 'POST', body: form })
      const body = await res.text()
      let message = body
      try { message = JSON.parse(body).message ?? body } catch {}
      return { ok: res.ok, status: res.status, message }
    },
    async kill (req) {
      const killed = await Sandbox.kill(req.sandbox)
      if (!killed) return { ok: false, status: 404, message: 'Sandbox.kill returned false (not found)' }
    },
    async pause (req) {
      const paused = await (await e2b(req.sandbox)).pause()
      if (!paused) return { ok: false, status: 409, message: 'pause returned false (already paused)' }
    },
    async fork (req) {
      const kids = await (await e2b(req.sandbox)).fork({ count: 1 })
      const bad = kids.find(k => k instanceof Error)
      if (bad) throw bad
      return { ok: true, message: 'forked ' + kids.map(k => k.sandboxId).join(',') }
    }
  }
}

// The HTTP statuses of the Connect codes envd answers with, for the
// errors the SDK makes of them ("7: [permission_denied] …").
const connectStatus = { invalid_argument: 400, unauthenticated: 401, permission_denied: 403, not_found: 404, failed_precondition: 412, internal: 500, unavailable: 503 }

function failure (err) {
  const message = String(err?.message ?? err)
  let status = err?.statusCode
  const http = /^(\d{3}): /.exec(message)
  if (!status && http) status = Number(http[1])
  const rpc = /^\d+: \[([a-z_]+)\] /.exec(message)
  if (!status && rpc) status = connectStatus[rpc[1]]
  return { ok: false, status: status ?? 0, message, class: err?.constructor?.name ?? typeof err }
}

const rl = readline.createInterface({ input: process.stdin })
for await (const line of rl) {
  if (!line.trim()) continue
  const req = JSON.parse(line)
  let out
  try {
    const fn = ops[req.door]?.[req.op]
    if (!fn) throw new Error(`no op ${req.door}.${req.op}`)
    out = { ok: true, ...(await fn(req)) }
  } catch (err) {
    out = failure(err)
  }
  process.stdout.write(JSON.stringify({ id: req.id, ...out }) + '\n')
}
if (mcp) await mcp.close().catch(() => {})
