// Detached channels (docs/protocol.md section 3.1) against a real daemon: a Channel that goes
// on across a dropped connection (resume), attach by name with takeover, and the list.
import assert from "node:assert/strict";
import { createServer, connect, type Server, type Socket } from "node:net";
import { after, before, describe, it } from "node:test";

import { createSandboxdRunner, SandboxdClient, type ChannelGap, type Lease } from "../src/index.js";
import { bwrapLease, clientFor, Daemon, eventually } from "./helpers.js";

/** A TCP relay on loopback to the daemon whose connections the test can cut. */
class Relay {
  private readonly sockets = new Set<Socket>();
  private constructor(private readonly server: Server) {}

  static async start(target: URL): Promise<Relay> {
    const server = createServer();
    const relay = new Relay(server);
    server.on("connection", (inbound) => {
      const outbound = connect(Number(target.port), target.hostname);
      for (const s of [inbound, outbound]) {
        relay.sockets.add(s);
        s.on("close", () => relay.sockets.delete(s));
        s.on("error", () => {});
      }
      inbound.pipe(outbound);
      outbound.pipe(inbound);
      inbound.on("close", () => outbound.destroy());
      outbound.on("close", () => inbound.destroy());
    });
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    return relay;
  }

  get url(): string {
    const address = this.server.address();
    if (!address || typeof address === "string") throw new Error("relay not listening");
    return `ws://127.0.0.1:${address.port}/v1/ws`;
  }

  /** Cuts every connection through the relay (new ones are relayed again). */
  cut(): void {
    for (const s of this.sockets) s.destroy();
  }

  close(): void {
    this.cut();
    this.server.close();
  }
}

function numbered(from: number, to: number): string {
  let s = "";
  for (let i = from; i <= to; i++) s += `${i}\n`;
  return s;
}

describe("detached channels", () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;
  let relay: Relay;

  before(async () => {
    daemon = await Daemon.start({});
    client = await clientFor(daemon);
    lease = await bwrapLease(client);
    relay = await Relay.start(new URL(daemon.url.replace(/^ws/, "http")));
  });

  /** A client that reaches the daemon through the relay and reconnects quickly after a cut. */
  const relayClient = () =>
    new SandboxdClient({ url: relay.url, token: daemon.token, reconnect: { retries: 20, initialDelayMs: 50, maxDelayMs: 500 } });

  after(async () => {
    relay?.close();
    if (lease) await client.leaseRelease({ leaseId: lease.id }).catch(() => {});
    client?.close();
    await daemon?.dispose();
  });

  it("a resumed channel goes on across a dropped connection, nothing lost or repeated", async () => {
    const viaRelay = relayClient();
    try {
      const channel = await viaRelay.open(
        {
          lease,
          command: ["sh", "-c", "seq 1 20000; read go; seq 20001 40000"],
          detach: { retainBytes: 1 << 20 },
          name: "resumed",
        },
        { resume: true },
      );
      assert.match(channel.handle ?? "", /^dch_[0-9a-f]{24}$/);
      assert.equal(channel.name, "resumed");
      const resumed = new Promise((resolve) => channel.once("resumed", resolve));
      let out = "";
      let cut = false;
      channel.setEncoding("utf8");
      channel.on("data", (chunk: string) => {
        out += chunk;
        if (!cut && out.length >= 10_000) {
          cut = true;
          relay.cut();
        }
      });
      // The whole first part may reach the client before the cut takes effect, so the resume is
      // awaited on its own rather than assumed to have happened by the time the output is in.
      await eventually(() => out.endsWith("\n20000\n"), 60_000, "the first part, across the drop");
      await resumed;
      channel.write("go\n");
      const exit = await channel.exit;
      assert.equal(exit.exitCode, 0);
      assert.equal(out, numbered(1, 40000));
      assert.deepEqual(channel.offsets, { stdout: out.length, stderr: 0 });
    } finally {
      viaRelay.close();
    }
  });

  it("createSandboxdRunner's duplex channel goes on across a dropped connection", async () => {
    const viaRelay = relayClient();
    try {
      const runner = createSandboxdRunner({ client: viaRelay, lease });
      const channel = await runner.openDuplexChannel({ command: ["sh", "-c", "read a; echo got $a; read b; echo got $b; exit 4"] });
      let out = "";
      channel.onData((chunk) => (out += Buffer.from(chunk).toString()));
      const exited = new Promise<{ exitCode: number | null; transportClosed?: boolean }>((resolve) => channel.onExit(resolve));
      channel.write(Buffer.from("one\n"));
      await eventually(() => out === "got one\n", 30_000, "the first answer");
      const resumed = new Promise((resolve) => channel.channel.once("resumed", resolve));
      relay.cut();
      await resumed;
      channel.write(Buffer.from("two\n"));
      assert.deepEqual(await exited, { exitCode: 4, transportClosed: false });
      assert.equal(out, "got one\ngot two\n");
    } finally {
      viaRelay.close();
    }
  });

  it("attaches by name from another client with takeover; the list shows it", async () => {
    const first = await client.open({ lease, command: ["cat"], detach: {}, name: "shared" });
    const other = await clientFor(daemon);
    try {
      await assert.rejects(other.attach({ leaseId: lease.id, name: "shared" }), { reason: "CHANNEL_ATTACHED" });
      first.write("one\n");
      const second = await other.attach({ leaseId: lease.id, name: "shared", takeover: true });
      const firstExit = await first.exit;
      assert.equal(firstExit.outcome, "takenOver");
      second.setEncoding("utf8");
      let got = "";
      second.on("data", (chunk: string) => (got += chunk));
      second.write("two\n");
      await eventually(() => got === "one\ntwo\n", 30_000, "the replay and the live echo");
      const listed = await other.listChannels({ leaseId: lease.id });
      const entry = listed.channels.find((c) => c.name === "shared");
      assert.ok(entry);
      assert.equal(entry.state, "running");
      assert.equal(entry.attached, true);
      assert.equal(entry.command, "cat");
      await second.stop();
      assert.equal((await second.exit).outcome, "stopped");
    } finally {
      other.close();
    }
  });

  it("a gap event says where the kept output starts", async () => {
    const opened = await client.open({
      lease,
      command: ["sh", "-c", "seq 1 20000; read x"],
      detach: { retainBytes: 4096 },
      outputWindow: 1024,
    });
    const total = numbered(1, 20000).length;
    // Attached, the command goes at this host's pace; let go of, it runs on and is kept.
    await opened.close();
    await eventually(
      async () => (await client.listChannels({ leaseId: lease.id })).channels.some((c) => c.handle === opened.handle && c.offsets.stdout === total),
      30_000,
      "the command's output kept",
    );
    const again = await client.attach({ leaseId: lease.id, handle: opened.handle ?? "", offsets: { stdout: 0 } });
    const gaps: ChannelGap[] = [];
    again.on("gap", (gap: ChannelGap) => gaps.push(gap));
    let got = "";
    again.setEncoding("utf8");
    again.on("data", (chunk: string) => (got += chunk));
    await eventually(() => got.length === 4096, 30_000, "the kept bytes");
    assert.deepEqual(again.gaps.map((g) => [g.stream, g.firstKept]), [["stdout", total - 4096]]);
    await eventually(() => gaps.length === 1, 10_000, "the gap event");
    assert.equal(got, numbered(1, 20000).slice(total - 4096));
    assert.deepEqual(again.offsets, { stdout: total, stderr: 0 });
    await again.stop();
  });
});
