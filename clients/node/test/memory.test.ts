// A consumer that stops reading holds the command back through the node: neither the daemon
// nor the client buffers more than the channel's window.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { setFlagsFromString } from "node:v8";
import { runInNewContext } from "node:vm";

import type { Lease, SandboxdClient } from "../src/index.js";
import { bwrapLease, clientFor, Daemon } from "./helpers.js";

const MiB = 1 << 20;

// What is live, not what waits for the collector: a full collection before each sample.
setFlagsFromString("--expose-gc");
const gc = runInNewContext("gc") as () => void;

function clientMemory(): number {
  gc();
  const m = process.memoryUsage();
  return m.heapUsed + m.arrayBuffers;
}

describe("memory under a slow consumer", () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;

  before(async () => {
    // AddressSanitizer's quarantine would hold freed buffers and hide what is really live.
    const asan = process.env.ASAN_OPTIONS ? `${process.env.ASAN_OPTIONS}:` : "";
    daemon = await Daemon.start({ env: { ASAN_OPTIONS: `${asan}quarantine_size_mb=0:thread_local_quarantine_size_kb=0` } });
    client = await clientFor(daemon);
    lease = await bwrapLease(client);
    // Warm up: the first channel costs what every later one reuses.
    const warm = await client.open({ lease, command: ["head", "-c", String(16 * MiB), "/dev/zero"] });
    warm.resume();
    await warm.exit;
  });

  after(async () => {
    client?.close();
    await daemon?.dispose();
  });

  it("256 MiB to a consumer that pauses for 2 s: daemon VmHWM < window + 16 MiB, client < 32 MiB", async () => {
    const total = 256 * MiB;
    daemon.resetPeakRss();
    const daemonBase = daemon.peakRss();
    const clientBase = clientMemory();
    let clientPeak = clientBase;
    const channel = await client.open({ lease, command: ["head", "-c", String(total), "/dev/zero"] });
    clientPeak = Math.max(clientPeak, clientMemory());
    // Nobody reads for 2 s (a consumer's pause, not a synchronisation): the client holds at
    // most the window, the command blocks in the sandbox.
    await new Promise((r) => setTimeout(r, 2000));
    assert.ok(channel.readableLength <= channel.outputWindow, `held ${channel.readableLength} > window ${channel.outputWindow}`);
    clientPeak = Math.max(clientPeak, clientMemory());
    let received = 0;
    let sampled = 0;
    for await (const chunk of channel) {
      received += (chunk as Buffer).length;
      if (received - sampled >= 8 * MiB) {
        sampled = received;
        clientPeak = Math.max(clientPeak, clientMemory());
      }
    }
    const exit = await channel.exit;
    assert.equal(received, total);
    assert.equal(exit.stdoutBytes, total);
    const daemonGrowth = daemon.peakRss() - daemonBase;
    const clientGrowth = clientPeak - clientBase;
    console.log(`daemon VmHWM growth ${(daemonGrowth / MiB).toFixed(1)} MiB (window ${channel.outputWindow / MiB} MiB); client heap+buffers growth ${(clientGrowth / MiB).toFixed(1)} MiB`);
    assert.ok(daemonGrowth < channel.outputWindow + 16 * MiB, `daemon grew by ${daemonGrowth} bytes`);
    assert.ok(clientGrowth < 32 * MiB, `client grew by ${clientGrowth} bytes`);
  });
});
