#!/usr/bin/env node
// bench/node_client_stream.mjs: the stream scenario through the TypeScript host client
// (clients/node, compiled to clients/node/dist): `head -c N /dev/zero` in a channel, read as a
// Node stream, with the same output window as the C++ client's stream scenario (16 MiB).
// Prints one JSON object, {"node_client_stream_mb_s": median, "details": {...}} (MB = 10^6 B).
//   node bench/node_client_stream.mjs --url URL --token-file FILE [--bytes N] [--runs N] [--window N]
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const { SandboxdClient } = await import(join(here, "../clients/node/dist/index.js"));

const args = new Map();
for (let i = 2; i < process.argv.length; i += 2) args.set(process.argv[i].replace(/^--/, ""), process.argv[i + 1]);
const need = (k) => {
  if (!args.has(k)) throw new Error(`--${k} is required`);
  return args.get(k);
};
const bytes = Number(args.get("bytes") ?? 1 << 30);
const runs = Number(args.get("runs") ?? 3);
const window = Number(args.get("window") ?? 16 << 20);

const client = new SandboxdClient({ url: need("url"), token: readFileSync(need("token-file"), "utf8").trim() });
await client.connect();
const lease = await client.leaseAcquire({ companyId: "bench", environmentId: "bench", provider: "bwrap" });

async function once(n) {
  const cpu0 = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  const channel = await client.open({ lease, command: ["head", "-c", String(n), "/dev/zero"], stdin: false, outputWindow: window });
  let got = 0;
  for await (const chunk of channel) got += chunk.length;
  const exit = await channel.exit;
  const secs = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(cpu0);
  if (got !== n || exit.exitCode !== 0) throw new Error(`stream: got ${got} of ${n} bytes, exit ${JSON.stringify(exit)}`);
  return { mb_s: n / 1e6 / secs, seconds: secs, client_cpu_s: (cpu.user + cpu.system) / 1e6 };
}

await once(Math.min(bytes, 32 << 20)); // warm-up
const results = [];
for (let i = 0; i < runs; i++) results.push(await once(bytes));
await client.leaseRelease({ leaseId: lease.id });
client.close();
const sorted = results.map((r) => r.mb_s).sort((a, b) => a - b);
const median = sorted[Math.floor(sorted.length / 2)];
console.log(JSON.stringify({
  node_client_stream_mb_s: median,
  details: { node_client_stream_mb_s: { median_mb_s: median, runs: results, bytes, output_window: window, node: process.version } },
}));
