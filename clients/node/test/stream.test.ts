// Channels as Node streams against a real daemon: bytes both ways, exits, PTY, execute.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { after, before, describe, it } from "node:test";

import { SandboxdClient, type Lease } from "../src/index.js";
import { repoRoot } from "./daemon.js";
import { bwrapLease, bytes, clientFor, collect, Daemon, eventually, sha256, writeAll } from "./helpers.js";

describe("channels as streams", () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;

  before(async () => {
    daemon = await Daemon.start({ audit: true });
    client = await clientFor(daemon);
    lease = await bwrapLease(client);
  });

  after(async () => {
    if (lease) await client.leaseRelease({ leaseId: lease.id }).catch(() => {});
    client?.close();
    await daemon?.dispose();
  });

  it("echoes stdin to stdout and exits 0 after the last byte", async () => {
    const channel = await client.open({ lease, command: ["cat"] });
    assert.equal(channel.routed, false);
    const out = collect(channel);
    channel.end("hello, sandbox\n");
    assert.equal((await out).toString(), "hello, sandbox\n");
    const exit = await channel.exit;
    assert.equal(exit.outcome, "exited");
    assert.equal(exit.exitCode, 0);
    assert.equal(exit.stdoutBytes, 15);
    assert.equal(exit.stdinBytes, 15);
  });

  it("moves 64 MiB both ways byte for byte (sha256 inside and outside the sandbox)", async () => {
    const data = bytes(64 << 20);
    // In: the sandbox hashes what it read.
    const hasher = await client.open({ lease, command: ["sha256sum"] });
    const hashOut = collect(hasher);
    await writeAll(hasher, data);
    assert.equal((await hashOut).toString().split(" ")[0], sha256(data));
    assert.equal((await hasher.exit).exitCode, 0);
    // Both ways: cat gives back exactly what it got, while both directions flow at once.
    const cat = await client.open({ lease, command: ["cat"] });
    const [, echoed] = await Promise.all([writeAll(cat, data), collect(cat)]);
    assert.equal(echoed.length, data.length);
    assert.equal(sha256(echoed), sha256(data));
    const exit = await cat.exit;
    assert.equal(exit.exitCode, 0);
    assert.equal(exit.stdoutBytes, data.length);
    assert.equal(exit.stdinBytes, data.length);
  });

  it("resolves exit only after all output, for 200 short channels in a row", async () => {
    for (let i = 0; i < 200; i++) {
      const channel = await client.open({ lease, command: ["sh", "-c", `printf 'out-${i}'; printf 'err-${i}' >&2`], stdin: false });
      let out = "";
      let err = "";
      channel.on("data", (c: Buffer) => (out += c.toString()));
      channel.stderr.on("data", (c: Buffer) => (err += c.toString()));
      const exit = await channel.exit;
      // The exit's counters say whether the node sent the bytes (a client or a node fault).
      assert.equal(out, `out-${i}`, `channel ${i}: stdout when exit resolved: ${JSON.stringify(exit)}`);
      assert.equal(err, `err-${i}`, `channel ${i}: stderr when exit resolved: ${JSON.stringify(exit)}`);
      assert.equal(exit.exitCode, 0);
      assert.equal(exit.outcome, "exited");
    }
  });

  it("never stalls a consumer that reads small pieces in paused mode", async () => {
    const total = 8 << 20;
    const channel = await client.open({ lease, command: ["head", "-c", String(total), "/dev/zero"], outputWindow: 256 * 1024 });
    let received = 0;
    await new Promise<void>((resolve) => {
      channel.on("readable", () => {
        let chunk: Buffer | null;
        while ((chunk = channel.read(1000) as Buffer | null) !== null) received += chunk.length;
      });
      channel.on("end", resolve);
    });
    assert.equal(received, total);
    assert.equal((await channel.exit).stdoutBytes, total);
  });

  it("keeps stdin within the window: write returns false and drain follows", async () => {
    // The command reads nothing until its stdin window is full and the client has waited.
    const channel = await client.open({ lease, command: ["sh", "-c", "sleep 1; exec wc -c"] });
    const out = collect(channel);
    const data = bytes(channel.stdinWindow * 4);
    const { sawBackpressure } = await writeAll(channel, data, 256 * 1024);
    assert.ok(sawBackpressure, "write() returned false at least once");
    assert.equal((await out).toString().trim(), String(data.length));
    const exit = await channel.exit;
    assert.equal(exit.outcome, "exited");
    assert.equal(exit.stdinBytes, data.length);
  });

  it("runs under a PTY: resize reaches stty, signal and exit codes are real", async () => {
    const channel = await client.open({ lease, command: ["sh"], pty: { cols: 80, rows: 24 } });
    let screen = "";
    channel.on("data", (c: Buffer) => (screen += c.toString()));
    const waitFor = async (text: string) => {
      const deadline = Date.now() + 10_000;
      while (!screen.includes(text)) {
        if (Date.now() > deadline) throw new Error(`no ${JSON.stringify(text)} on the terminal: ${JSON.stringify(screen)}`);
        await new Promise((r) => setTimeout(r, 10));
      }
    };
    channel.write("stty size\n");
    await waitFor("24 80");
    await channel.resize(132, 50);
    channel.write("stty size\n");
    await waitFor("50 132");
    channel.write("exit 7\n");
    const exit = await channel.exit;
    assert.equal(exit.exitCode, 7);
    assert.equal(exit.outcome, "exited");
  });

  it("stops a command: exit says stopped; close makes the exit itself", async () => {
    const stopped = await client.open({ lease, command: ["sleep", "600"] });
    stopped.resume();
    await stopped.stop();
    const exit = await stopped.exit;
    assert.equal(exit.outcome, "stopped");
    const closed = await client.open({ lease, command: ["sleep", "600"] });
    await closed.close();
    const made = await closed.exit;
    assert.deepEqual(
      { outcome: made.outcome, exitCode: made.exitCode, stdoutBytes: made.stdoutBytes, durationMs: made.durationMs },
      { outcome: "stopped", exitCode: null, stdoutBytes: null, durationMs: null },
    );
  });

  it("signals the command", async () => {
    const channel = await client.open({ lease, command: ["sh", "-c", "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.05; done"] });
    let out = "";
    const ready = new Promise<void>((resolve) =>
      channel.on("data", (c: Buffer) => {
        out += c.toString();
        if (out.includes("ready")) resolve();
      }),
    );
    await ready;
    await channel.signal("TERM");
    const exit = await channel.exit;
    assert.equal(exit.exitCode, 3);
    assert.match(out, /got-term/);
  });

  it("executes a command with its log streamed before the answer", async () => {
    const logs: string[] = [];
    const result = await client.leaseExecute(
      { leaseId: lease.id, command: "sh", args: ["-c", "echo one; echo two >&2; exit 5"] },
      { onLog: (log) => logs.push(`${log.stream}:${log.chunk}`) },
    );
    assert.equal(result.exitCode, 5);
    assert.equal(result.stdout, "one\n");
    assert.equal(result.stderr, "two\n");
    assert.deepEqual(logs.sort(), ["stderr:two\n", "stdout:one\n"]);
  });

  it("runs the README's example (clients/node/examples/hello.mjs) as it is", async () => {
    const { stdout } = await promisify(execFile)(process.execPath, [join(repoRoot, "clients/node/examples/hello.mjs")], {
      env: { ...process.env, SANDBOXD_URL: daemon.url, SANDBOXD_TOKEN: daemon.token },
      timeout: 60_000,
    });
    assert.equal(stdout, "line 1\nline 2\nline 3\nexit 0 (exited)\n");
  });

  it("aborts a call with its AbortSignal", async () => {
    const controller = new AbortController();
    controller.abort();
    await assert.rejects(client.leaseGet({ leaseId: lease.id }, { signal: controller.signal }), { reason: "ABORTED", code: 0 });
    const got = await client.leaseGet({ leaseId: lease.id });
    assert.equal(got.id, lease.id);
    // Before any connection exists.
    const fresh = new SandboxdClient({ url: daemon.url, token: daemon.token });
    await assert.rejects(fresh.leaseGet({ leaseId: lease.id }, { signal: controller.signal }), { reason: "ABORTED" });
    fresh.close();
  });

  it("closes on the node an open that was aborted before its answer", async () => {
    const channelsOnNode = async () => (await client.nodeList()).nodes.find((n) => n.nodeId === daemon.nodeId)?.channels;
    assert.equal(await channelsOnNode(), 0);
    const controller = new AbortController();
    const ended = () => daemon.audit().filter((l) => l.event === "channel.ended").length;
    const endedBefore = ended();
    const opening = client.open({ lease, command: ["sleep", "600"] }, { signal: controller.signal });
    // Aborted once the request is on the wire (a macrotask later), before its answer.
    setImmediate(() => controller.abort());
    await assert.rejects(opening, { reason: "ABORTED" });
    // The open did happen on the node (its audit says so), and the client closed its channel
    // when the answer came: it ended as `stopped` (a close), not by its timeout or a drop.
    await eventually(() => ended() > endedBefore, 10_000, "the aborted open's channel to end");
    const last = daemon.audit().filter((l) => l.event === "channel.ended").at(-1);
    assert.equal(last?.outcome, "stopped");
    await eventually(async () => (await channelsOnNode()) === 0, 10_000, "no channel left on the node");
  });
});
