// Every error reason a node gives a host surfaces as a SandboxdError with its code and data
// (docs/protocol.md section 5), and the client's own failures have reasons of their own.
// OWNER_UNAVAILABLE and OWNER_ELSEWHERE are in routing.test.ts, REGISTRY_UNAVAILABLE below with
// a private etcd. ROUTING_LOOP cannot be caused by a host (only a peer link forwards).
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";

import { ERROR_CODES, SandboxdClient, SandboxdError, type Lease, type Reason, type ServerReason } from "../src/index.js";
import { Daemon, eventually, repoRoot } from "./daemon.js";
import { Etcd } from "./etcd.js";

const HOST = "host-secret";
const PEER = "peer-secret";

async function reasonOf(promise: Promise<unknown>, reason: Reason): Promise<SandboxdError> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof SandboxdError, `a SandboxdError, not ${String(error)}`);
    assert.equal(error.reason, reason, `reason (message: ${error.message})`);
    if (reason in ERROR_CODES) assert.equal(error.code, ERROR_CODES[reason as ServerReason]);
    else assert.equal(error.code, 0);
    assert.equal(error.data.reason, reason);
    return error;
  }
  assert.fail(`expected ${reason}, but the call succeeded`);
}

describe("errors", () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;
  const pluginRoot = mkdtempSync(join(process.env.TMPDIR || tmpdir(), "sandboxd-node-plugin."));

  before(async () => {
    daemon = await Daemon.start({
      config: {
        auth: {
          tokens: [
            { name: "host", token: HOST, role: "host", tenants: ["acme"] },
            { name: "peer", token: PEER, role: "peer", tenants: ["*"] },
          ],
        },
        limits: { channelsPerConnection: 2 },
        providers: {
          plugins: [
            // A worker that never starts: its provider is never ready.
            { pluginId: "broken", provider: "broken", command: ["/bin/false"] },
            // The reference worker without duplexChannelOpen: opens are PROVIDER_ERROR.
            {
              pluginId: "process-ref",
              provider: "process",
              command: [join(repoRoot, "plugins/process/worker")],
              env: { PROCESS_PLUGIN_ROOT: pluginRoot, PROCESS_PLUGIN_TEST_HOOKS: "1", PROCESS_PLUGIN_TEST_NO_CHANNELS: "1" },
            },
          ],
        },
      },
    });
    client = new SandboxdClient({ url: daemon.url, token: HOST });
    await client.connect();
    lease = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
  });

  after(async () => {
    client?.close();
    await daemon?.dispose();
    rmSync(pluginRoot, { recursive: true, force: true });
  });

  it("INVALID_PARAMS names the field", async () => {
    const e = await reasonOf(
      client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap", ttl: 5 } as never),
      "INVALID_PARAMS",
    );
    assert.equal(e.data.field, "ttl");
    const tenant = await reasonOf(client.leaseAcquire({ companyId: "other", environmentId: "dev", provider: "bwrap" }), "INVALID_PARAMS");
    assert.equal(tenant.data.field, "companyId");
  });

  it("LEASE_INCOMPLETE, LEASE_NOT_FOUND", async () => {
    const { providerLeaseId: _drop, ...incomplete } = lease;
    await reasonOf(client.open({ lease: incomplete as never, command: ["true"] }), "LEASE_INCOMPLETE");
    await reasonOf(client.leaseGet({ leaseId: "no-such-lease" }), "LEASE_NOT_FOUND");
  });

  it("CHANNEL_LIMIT, CHANNEL_NOT_FOUND", async () => {
    const a = await client.open({ lease, command: ["sleep", "600"] });
    const b = await client.open({ lease, command: ["sleep", "600"] });
    const e = await reasonOf(client.open({ lease, command: ["true"] }), "CHANNEL_LIMIT");
    assert.match(e.message, /.+/);
    await a.close();
    await b.stop();
    await b.exit;
    await reasonOf(b.signal("TERM"), "CHANNEL_NOT_FOUND");
  });

  it("FLOW_CONTROL arrives on the exit of a channel whose stdin window was overrun", async () => {
    const channel = await client.open({ lease, command: ["sleep", "600"] });
    channel.resume();
    // The client keeps to the window by itself; make it believe the window is empty.
    (channel as unknown as { stdinInFlight: number }).stdinInFlight = -4 * channel.stdinWindow;
    channel.write(Buffer.alloc(2 * channel.stdinWindow));
    const exit = await channel.exit;
    assert.equal(exit.outcome, "error");
    assert.equal(exit.error?.data?.reason, "FLOW_CONTROL");
    assert.equal(exit.error?.code, ERROR_CODES.FLOW_CONTROL);
  });

  it("PROVIDER_NOT_READY, PROVIDER_ERROR", async () => {
    await reasonOf(client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "broken" }), "PROVIDER_NOT_READY");
    let pluginLease: Lease | null = null;
    await eventually(
      async () => {
        try {
          pluginLease = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "process" });
          return true;
        } catch (error) {
          if ((error as SandboxdError).reason !== "PROVIDER_NOT_READY") throw error;
          return false;
        }
      },
      30_000,
      "the reference worker to be ready",
    );
    await reasonOf(client.open({ lease: pluginLease as unknown as Lease, command: ["true"] }), "PROVIDER_ERROR");
    await client.leaseRelease({ leaseId: (pluginLease as unknown as Lease).id });
  });

  it("FORBIDDEN for a peer token, UNAUTHORIZED for a wrong one", async () => {
    await reasonOf(new SandboxdClient({ url: daemon.url, token: PEER, reconnect: false }).connect(), "FORBIDDEN");
    await reasonOf(new SandboxdClient({ url: daemon.url, token: "wrong", reconnect: false }).connect(), "UNAUTHORIZED");
  });

  it("LEASE_NOT_ACTIVE after a release, SANDBOX_NOT_CACHED after a restart", async () => {
    const kept = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
    await client.leaseRelease({ leaseId: lease.id });
    await reasonOf(client.open({ lease, command: ["true"] }), "LEASE_NOT_ACTIVE");
    await daemon.relaunch();
    // The lease calls reconnect by themselves; an open is made on the new connection.
    assert.equal((await client.leaseGet({ leaseId: kept.id })).status, "active");
    await reasonOf(client.open({ lease: kept, command: ["true"] }), "SANDBOX_NOT_CACHED");
    assert.equal((await client.leaseRelease({ leaseId: kept.id })).status, "released");
  });
});

describe("errors: REGISTRY_UNAVAILABLE", () => {
  let etcd: Etcd;
  let daemon: Daemon;

  before(async () => {
    etcd = await Etcd.start();
    daemon = await Daemon.start({
      config: {
        registry: { kind: "etcd", endpoints: [etcd.endpoint], prefix: "/sandboxd-node-test/" },
        auth: { tokens: [{ name: "host", token: HOST, role: "host", tenants: ["*"] }] },
      },
    });
  });

  after(async () => {
    await daemon?.dispose();
    await etcd?.dispose();
  });

  it("fails closed while etcd is down", async () => {
    const client = new SandboxdClient({ url: daemon.url, token: HOST });
    await client.connect();
    const lease = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
    await etcd.stop();
    await reasonOf(client.leaseGet({ leaseId: lease.id }), "REGISTRY_UNAVAILABLE");
    await reasonOf(client.open({ lease, command: ["true"] }), "REGISTRY_UNAVAILABLE");
    client.close();
  });
});
