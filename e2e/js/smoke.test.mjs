// The harness itself: the server answers and the environment is complete.
import { test } from 'node:test'
import assert from 'node:assert/strict'

test('server answers /healthz and the env names it', async () => {
  for (const k of ['SPACE_URL', 'SPACE_API_KEY', 'SPACE_BIN', 'E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'E2B_DOMAIN']) {
    assert.ok(process.env[k], `${k} is set`)
  }
  const res = await fetch(`${process.env.SPACE_URL}/healthz`)
  assert.equal(res.status, 200)
  assert.deepEqual(await res.json(), { ok: true })
})
