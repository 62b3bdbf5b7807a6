// Two nodes sharing one SQLite registry: an open through a node that does not own the lease,
// forwarded in proxy mode and followed by the client in redirect mode; a dead owner.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, describe, it } from "node:test";

import { ERROR_CODES, SandboxdClient, SandboxdError, type Lease } from "../src/index.js";
import { collect, Daemon, eventually } from "./helpers.js";

const HOST = "host-secret";

async function cluster(mode: "proxy" | "redirect") {
  const dir = mkdtempSync(join(process.env.TMPDIR || tmpdir(), "sandboxd-node-cluster."));
  const config = {
    registry: { kind: "sqlite", path: join(dir, "registry.db") },
    auth: {
      tokens: [
        { name: "host", token: HOST, role: "host", tenants: ["*"] },
        { name: "peer", token: "peer-secret", role: "peer", tenants: ["*"] },
      ],
    },
    routing: { mode, nodeTtlMs: 3000, heartbeatMs: 300 },
  };
  const a = await Daemon.start({ nodeId: "node-a", config });
  const b = await Daemon.start({ nodeId: "node-b", config });
  return {
    a,
    b,
    async dispose() {
      await b.dispose();
      await a.dispose();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

async function echo(client: SandboxdClient, lease: Lease, text: string) {
  const channel = await client.open({ lease, command: ["cat"] });
  const out = collect(channel);
  channel.end(text);
  assert.equal((await out).toString(), text);
  assert.equal((await channel.exit).exitCode, 0);
  return channel;
}

describe("routing", () => {
  const disposers: (() => Promise<void>)[] = [];
  after(async () => {
    for (const d of disposers.reverse()) await d();
  });

  it("proxy mode: an open through a node that is not the owner is forwarded", async () => {
    const c = await cluster("proxy");
    disposers.push(() => c.dispose());
    const onA = new SandboxdClient({ url: c.a.url, token: HOST });
    const onB = new SandboxdClient({ url: c.b.url, token: HOST });
    const lease = await onA.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
    assert.equal(lease.ownerNodeId, "node-a");
    const channel = await echo(onB, lease, "through the proxy\n");
    assert.equal(channel.routed, true);
    assert.equal(channel.ownerNodeId, "node-a");
    assert.equal((await onB.leaseRelease({ leaseId: lease.id })).status, "released");
    onA.close();
    onB.close();
  });

  it("redirect mode: the client follows OWNER_ELSEWHERE to the owner once", async () => {
    const c = await cluster("redirect");
    disposers.push(() => c.dispose());
    const onA = new SandboxdClient({ url: c.a.url, token: HOST });
    const lease = await onA.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
    // Not followed: the error, with where the owner is.
    const strict = new SandboxdClient({ url: c.b.url, token: HOST, followRedirects: false });
    try {
      await strict.open({ lease, command: ["true"] });
      assert.fail("the open should be redirected");
    } catch (error) {
      assert.ok(error instanceof SandboxdError);
      assert.equal(error.reason, "OWNER_ELSEWHERE");
      assert.equal(error.code, ERROR_CODES.OWNER_ELSEWHERE);
      assert.equal(error.data.ownerNodeId, "node-a");
      assert.equal(error.data.ownerUrl, c.a.url);
    }
    strict.close();
    // Followed: the channel runs on the owner's connection, not routed.
    const onB = new SandboxdClient({ url: c.b.url, token: HOST });
    const channel = await echo(onB, lease, "redirected\n");
    assert.equal(channel.routed, false);
    assert.equal(channel.ownerNodeId, "node-a");
    // Lease calls that the owner answers are followed too.
    assert.equal((await onB.leaseRelease({ leaseId: lease.id })).status, "released");
    onA.close();
    onB.close();
  });

  it("a dead owner is OWNER_UNAVAILABLE; its channels end transportClosed", async () => {
    const c = await cluster("proxy");
    disposers.push(() => c.dispose());
    const onA = new SandboxdClient({ url: c.a.url, token: HOST, reconnect: false });
    const onB = new SandboxdClient({ url: c.b.url, token: HOST });
    const lease = await onA.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
    const direct = await onA.open({ lease, command: ["sleep", "600"] });
    const routed = await onB.open({ lease, command: ["sleep", "600"] });
    direct.resume();
    routed.resume();
    await c.a.kill9();
    const [d, r] = await Promise.all([direct.exit, routed.exit]);
    assert.equal(d.outcome, "transportClosed");
    assert.equal(d.exitCode, null);
    assert.equal(r.outcome, "transportClosed");
    await assert.rejects(onA.leaseGet({ leaseId: lease.id }), { reason: "TRANSPORT_CLOSED", code: 0 });
    await eventually(async () => (await onB.nodeList()).nodes.some((n) => n.nodeId === "node-a" && !n.alive), 10_000, "node-a to be dead");
    // Fail closed: OWNER_UNAVAILABLE, or LEASE_NOT_ACTIVE once node-b's sweeper has already
    // recorded the dead owner's lease pending_cleanup (it runs every heartbeat).
    await assert.rejects(onB.open({ lease, command: ["true"] }), (e: unknown) => {
      const err = e as { reason?: string; code?: number };
      return (
        (err.reason === "OWNER_UNAVAILABLE" && err.code === ERROR_CODES.OWNER_UNAVAILABLE) ||
        (err.reason === "LEASE_NOT_ACTIVE" && err.code === ERROR_CODES.LEASE_NOT_ACTIVE)
      );
    });
    // node-a back on its state: the lease is torn down by its recorded provider.
    await c.a.relaunch();
    assert.notEqual((await onB.leaseRelease({ leaseId: lease.id })).status, "active");
    onA.close();
    onB.close();
  });
});

describe("timeouts", () => {
  it("a node that does not answer: TIMEOUT for a request and for a connect", async () => {
    const daemon = await Daemon.start();
    try {
      const client = new SandboxdClient({ url: daemon.url, token: daemon.token, connectTimeoutMs: 500, requestTimeoutMs: 500, reconnect: false });
      await client.connect();
      process.kill(daemon.pid, "SIGSTOP");
      try {
        await assert.rejects(client.nodeList(), { reason: "TIMEOUT", code: 0 });
        const late = new SandboxdClient({ url: daemon.url, token: daemon.token, connectTimeoutMs: 500, reconnect: false });
        await assert.rejects(late.connect(), { reason: "TIMEOUT" });
        late.close();
      } finally {
        process.kill(daemon.pid, "SIGCONT");
      }
      // The node answers again on the same connection.
      assert.ok((await client.nodeList({ timeoutMs: 10_000 })).nodes.length >= 1);
      client.close();
    } finally {
      await daemon.dispose();
    }
  });
});

describe("reconnect", () => {
  it("a lease call made while the node restarts is made again once it is back; an open is not", async () => {
    // A restarted node registers again once its old membership has expired (nodeTtlMs).
    const daemon = await Daemon.start({ config: { routing: { nodeTtlMs: 3000, heartbeatMs: 300 } } });
    try {
      const client = new SandboxdClient({ url: daemon.url, token: daemon.token, reconnect: { retries: 20, initialDelayMs: 100, maxDelayMs: 1000 } });
      const lease = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
      const channel = await client.open({ lease, command: ["sleep", "600"] });
      channel.resume();
      await daemon.kill9();
      assert.equal((await channel.exit).outcome, "transportClosed");
      await assert.rejects(client.open({ lease, command: ["true"] }), { reason: "TRANSPORT_CLOSED" });
      const got = client.leaseGet({ leaseId: lease.id }).then(
        (value) => value,
        (error: unknown) => error,
      );
      await daemon.relaunch();
      const answer = await got;
      assert.ok(!(answer instanceof Error), `leaseGet: ${String(answer)}`);
      assert.equal((answer as Lease).id, lease.id);
      await client.leaseRelease({ leaseId: lease.id });
      client.close();
    } finally {
      await daemon.dispose();
    }
  });
});
