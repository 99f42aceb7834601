// The E2B side of bench/e2b_test.go (TestE2BBench): the same work the Go
// side does with space's own SDK, through E2B's SDK, unmodified. Prints one
// JSON object of samples in milliseconds. Iterations: BENCH_N (default 50).
import { Sandbox } from 'e2b'
import { performance } from 'node:perf_hooks'

const n = Number(process.env.BENCH_N || 50)
const nCreate = Number(process.env.BENCH_N_CREATE || Math.max(5, Math.floor(n / 5)))
const out = { create_first_output: [], run_true: [], file_1mib: [] }

for (let i = 0; i < nCreate; i++) {
  const t0 = performance.now()
  const sbx = await Sandbox.create({ timeoutMs: 600_000 })
  await sbx.commands.run('true')
  out.create_first_output.push(performance.now() - t0)
  await sbx.kill()
}

const sbx = await Sandbox.create({ timeoutMs: 600_000 })
await sbx.commands.run('true')
for (let i = 0; i < n; i++) {
  const t0 = performance.now()
  await sbx.commands.run('true')
  out.run_true.push(performance.now() - t0)
}
const mib = new Uint8Array(1 << 20).map((_, i) => i & 0xff)
for (let i = 0; i < n; i++) {
  const t0 = performance.now()
  await sbx.files.write('/tmp/bench.bin', mib)
  const back = await sbx.files.read('/tmp/bench.bin', { format: 'bytes' })
  out.file_1mib.push(performance.now() - t0)
  if (back.length !== mib.length) throw new Error(`read ${back.length} bytes`)
}
await sbx.kill()
console.log(JSON.stringify(out))
