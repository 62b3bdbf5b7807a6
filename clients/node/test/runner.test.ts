// The paperclip runner: checked by the compiler against adapter-utils' published types, and
// driven through adapter-utils' own createCommandManagedRuntimeClient against a real daemon.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import {
  createCommandManagedRuntimeClient,
  type CommandManagedDuplexChannel,
  type CommandManagedRuntimeRunner,
} from "@paperclipai/adapter-utils/command-managed-runtime";

import { createSandboxdRunner, type Lease, type SandboxdClient } from "../src/index.js";
import { bwrapLease, clientFor, Daemon } from "./helpers.js";

describe("paperclip runner", () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;
  let runner: CommandManagedRuntimeRunner;

  before(async () => {
    daemon = await Daemon.start();
    client = await clientFor(daemon);
    lease = await bwrapLease(client);
    // The compile-time check: createSandboxdRunner's result is a CommandManagedRuntimeRunner.
    runner = createSandboxdRunner({ client, lease });
  });

  after(async () => {
    client?.close();
    await daemon?.dispose();
  });

  it("has no file sync (adapter-utils falls back to its shell transport)", () => {
    assert.equal(runner.syncIn, undefined);
    assert.equal(runner.syncOut, undefined);
  });

  it("execute streams onLog and gives the real exit code", async () => {
    const logs: string[] = [];
    const result = await runner.execute({
      command: "sh",
      args: ["-c", "echo first; echo second >&2; exit 42"],
      onLog: async (stream, chunk) => {
        logs.push(`${stream}:${chunk}`);
      },
    });
    assert.equal(result.exitCode, 42);
    assert.equal(result.timedOut, false);
    assert.equal(result.stdout, "first\n");
    assert.equal(result.stderr, "second\n");
    assert.deepEqual([...logs].sort(), ["stderr:second\n", "stdout:first\n"]);
  });

  it("serves adapter-utils' createCommandManagedRuntimeClient: files in and out of the sandbox", async () => {
    const files = createCommandManagedRuntimeClient({ runner, commandCwd: "/workspace", timeoutMs: 30_000, shellCommand: "sh" });
    await files.makeDir("/workspace/project/src");
    const body = Buffer.from(Array.from({ length: 70_000 }, (_, i) => i % 251));
    const copy = new Uint8Array(body);
    await files.writeFile("/workspace/project/src/data.bin", copy.buffer);
    const back = Buffer.from((await files.readFile("/workspace/project/src/data.bin")) as Uint8Array);
    assert.ok(back.equals(body), "the file came back byte for byte");
    const listed = await files.listFiles("/workspace/project/src");
    assert.ok(listed.some((name) => name.endsWith("data.bin")), `listFiles: ${JSON.stringify(listed)}`);
    await files.run("test -s /workspace/project/src/data.bin", { timeoutMs: 10_000 });
    await files.remove("/workspace/project");
    await assert.rejects(files.run("test -e /workspace/project", { timeoutMs: 10_000 }));
  });

  it("openDuplexChannel: write, onData, onExit with the real code; transportClosed only when the transport closed", async () => {
    const open = runner.openDuplexChannel;
    assert.ok(open, "the runner opens duplex channels");
    const channel: CommandManagedDuplexChannel = await open.call(runner, { command: ["sh", "-c", "read line; echo got:$line; exit 9"] });
    let out = "";
    channel.onData((chunk) => (out += Buffer.from(chunk).toString()));
    const exited = new Promise<{ exitCode: number | null; transportClosed?: boolean }>((resolve) => channel.onExit(resolve));
    channel.write(new TextEncoder().encode("hello\n"));
    const exit = await exited;
    assert.deepEqual(exit, { exitCode: 9, transportClosed: false });
    assert.equal(out, "got:hello\n");
    await channel.close();

    const stopped = await open.call(runner, { command: ["sleep", "600"] });
    const stoppedExit = new Promise<{ exitCode: number | null; transportClosed?: boolean }>((resolve) => stopped.onExit(resolve));
    stopped.stop();
    stopped.stop();
    assert.deepEqual(await stoppedExit, { exitCode: null, transportClosed: false });

    const dropped = await open.call(runner, { command: ["sleep", "600"] });
    const droppedExit = new Promise<{ exitCode: number | null; transportClosed?: boolean }>((resolve) => dropped.onExit(resolve));
    client.close();
    assert.deepEqual(await droppedExit, { exitCode: null, transportClosed: true });
  });
});
