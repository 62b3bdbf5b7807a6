// What the client's tests share: a daemon per test file, a connected client, a lease.
import { createHash, randomBytes } from "node:crypto";

import { SandboxdClient, type Channel, type Lease } from "../src/index.js";
import { Daemon } from "./daemon.js";

export { Daemon, eventually } from "./daemon.js";

export async function clientFor(daemon: Daemon, extra: Partial<ConstructorParameters<typeof SandboxdClient>[0]> = {}) {
  const client = new SandboxdClient({ url: daemon.url, token: daemon.token, ...extra });
  await client.connect();
  return client;
}

export async function bwrapLease(client: SandboxdClient, companyId = "acme"): Promise<Lease> {
  return client.leaseAcquire({ companyId, environmentId: "dev", provider: "bwrap" });
}

/** Everything a readable gives until it ends. */
export async function collect(stream: NodeJS.ReadableStream): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const chunk of stream) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

export function sha256(data: Buffer | Uint8Array): string {
  return createHash("sha256").update(data).digest("hex");
}

/** A deterministic pseudo-random buffer (every byte value occurs). */
export function bytes(n: number): Buffer {
  return randomBytes(n);
}

/** Writes `data` to the channel in chunks, honouring backpressure, then ends stdin. */
export async function writeAll(channel: Channel, data: Buffer, chunk = 1 << 20): Promise<{ sawBackpressure: boolean }> {
  let sawBackpressure = false;
  for (let at = 0; at < data.length; at += chunk) {
    const ok = channel.write(data.subarray(at, at + chunk));
    if (!ok) {
      sawBackpressure = true;
      await new Promise((resolve) => channel.once("drain", resolve));
    }
  }
  await channel.closeStdin();
  return { sawBackpressure };
}
