// sdk-local: a paperclip plugin (@paperclipai/plugin-sdk 2026.916.1) that provides local-process
// "sandboxes" the way a cloud plugin provides remote ones. A lease is a directory
// $SDK_LOCAL_ROOT/<providerLeaseId>/; a duplex channel is a child process running in it.
// It exists to test sandboxd's plugin host against the real SDK. See README.md.
//
// Environment:
//   SDK_LOCAL_ROOT          required: the directory that holds the leases (created if missing)
//   SDK_LOCAL_TEST_HOOKS=1  enables the test hooks (README.md "Test hooks"); never in production
//   SDK_LOCAL_STOP_GRACE_MS grace of duplexChannelStop before SIGTERM, and again before SIGKILL (default 1000)
import { definePlugin, runWorker, decodeChannelBytes } from "@paperclipai/plugin-sdk";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import fs from "node:fs";
import path from "node:path";

const ROOT = process.env.SDK_LOCAL_ROOT ? path.resolve(process.env.SDK_LOCAL_ROOT) : "";
const HOOKS = process.env.SDK_LOCAL_TEST_HOOKS === "1";
const STOP_GRACE_MS = Number(process.env.SDK_LOCAL_STOP_GRACE_MS) || 1000;
const LEASE_ID = /^sdk-[0-9a-f]{16}$/;

let ctx;
const leases = new Map();    // providerLeaseId -> {companyId, environmentId}: the "handle cache" (acquire, resume)
const sessions = new Map();  // hostRouteId -> {workerSessionId, providerLeaseId, child, exitSent, closed}
let nextSession = 1;

// ---- helpers ---------------------------------------------------------------------------------

function fail(message, code) {  // code -32602 = invalid params; otherwise the SDK sends -32002
  throw Object.assign(new Error(message), code === undefined ? {} : { code });
}
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const leaseDir = (id) => path.join(ROOT, id);
const metadataOf = (id) => ({ dir: leaseDir(id), createdBy: "sdk-local" });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const readJson = (file) => (fs.existsSync(file) ? JSON.parse(fs.readFileSync(file, "utf8")) : null);
const writeJson = (file, value) => fs.writeFileSync(file, JSON.stringify(value, null, 2) + "\n");

// Every lifecycle call, in order, one JSON line each: survives the lease directory's removal.
function journal(method, params, outcome) {
  fs.appendFileSync(path.join(ROOT, "journal.jsonl"),
    JSON.stringify({ at: new Date().toISOString(), pid: process.pid, method, params, ...outcome }) + "\n");
}

// Runs one lifecycle hook: journals it (ok or error) and logs it through the host.
async function lifecycle(method, params, body) {
  try {
    const result = await body();
    journal(method, params, { result: result ?? null });
    ctx.logger.info(`${method} ok`, { providerLeaseId: result?.providerLeaseId ?? params?.providerLeaseId });
    return result;
  } catch (e) {
    journal(method, params, { error: e.message });
    ctx.logger.warn(`${method} failed: ${e.message}`);
    throw e;
  }
}

// The checks of resume, release and destroy: the params a cloud plugin needs to find its sandbox.
function checkLeaseParams(p, { needMetadata }) {
  if (!isObject(p)) fail("params must be an object", -32602);
  if (!isObject(p.config)) fail("config is required (an object): the plugin parses it on every call", -32602);
  if (typeof p.providerLeaseId !== "string" || !LEASE_ID.test(p.providerLeaseId)) {
    fail(`providerLeaseId ${JSON.stringify(p.providerLeaseId)} is not an sdk-local lease id (sdk-<16 hex>)`, -32602);
  }
  const want = metadataOf(p.providerLeaseId);
  if (p.leaseMetadata === undefined && !needMetadata) return;
  if (!isObject(p.leaseMetadata)) fail("leaseMetadata is required: the metadata that acquire returned", -32602);
  for (const k of Object.keys(want)) {
    if (p.leaseMetadata[k] !== want[k]) {
      fail(`leaseMetadata.${k} is ${JSON.stringify(p.leaseMetadata[k])}, but lease ${p.providerLeaseId} has ${JSON.stringify(want[k])}`, -32602);
    }
  }
}

// The lease's record from acquire, if its directory still exists; the scope must match.
function leaseRecord(p) {
  const dir = leaseDir(p.providerLeaseId);
  if (!fs.existsSync(dir)) return null;
  const acquired = readJson(path.join(dir, "acquire.json"))?.params ?? {};
  for (const k of ["driverKey", "companyId", "environmentId"]) {
    if (k in acquired && p[k] !== acquired[k]) {
      fail(`${k} ${JSON.stringify(p[k])} does not match lease ${p.providerLeaseId} (${JSON.stringify(acquired[k])})`);
    }
  }
  return { dir, acquired };
}

// Hook (b): config.failTeardowns = N makes the first N release/destroy calls of a lease fail.
function injectedTeardownFailure(p, dir) {
  const n = Number(p.config.failTeardowns) || 0;
  if (!HOOKS || n <= 0) return;
  const file = path.join(dir, "teardown-failures");
  const done = fs.existsSync(file) ? Number(fs.readFileSync(file, "utf8")) : 0;
  if (done >= n) return;
  fs.writeFileSync(file, String(done + 1));
  fail(`injected teardown failure ${done + 1} of ${n} (test hook failTeardowns)`);
}

function killLeaseChannels(providerLeaseId) {
  for (const s of sessions.values()) if (s.providerLeaseId === providerLeaseId && s.child) s.child.kill("SIGKILL");
}

async function teardown(method, p, destroy) {
  return lifecycle(method, p, async () => {
    checkLeaseParams(p, { needMetadata: true });
    const id = p.providerLeaseId;
    const state = destroy ? "destroyed" : "stopped";
    const rec = leaseRecord(p);
    if (!rec) return { providerLeaseId: id, state };  // already gone: idempotent
    injectedTeardownFailure(p, rec.dir);
    killLeaseChannels(id);
    leases.delete(id);
    writeJson(path.join(rec.dir, destroy ? "destroy.json" : "release.json"), p);
    if (destroy) fs.rmSync(rec.dir, { recursive: true, force: true });
    return { providerLeaseId: id, state };
  });
}

// ---- channels --------------------------------------------------------------------------------

function session(p) {  // the live session of an exact (hostRouteId, workerSessionId) pair
  const s = sessions.get(p?.hostRouteId);
  if (!s || s.workerSessionId !== p.workerSessionId) {
    fail(`no open channel (${JSON.stringify(p?.hostRouteId)}, ${JSON.stringify(p?.workerSessionId)})`);
  }
  return s;
}
function sendData(route, s, bytes) {
  if (!s.closed && bytes.length > 0) ctx.duplexChannel.data(route, s.workerSessionId, bytes);
}
function sendExit(route, s, code) {
  if (s.closed || s.exitSent) return;
  s.exitSent = true;
  ctx.duplexChannel.exit(route, s.workerSessionId, code, false);
}

async function startChild(route, s, argv, cwd) {
  const child = spawn(argv[0], argv.slice(1), { cwd, stdio: ["pipe", "pipe", "pipe"] });
  const spawnError = new Promise((resolve) => child.on("error", resolve));
  child.stdin.on("error", () => {});   // EPIPE after the child ended: the write answer says so
  if (child.pid === undefined) {       // could not start: the open fails
    sessions.delete(route);
    fail(`cannot run ${JSON.stringify(argv[0])} in ${cwd}: ${(await spawnError).message}`);
  }
  s.child = child;
  child.stdout.on("data", (b) => sendData(route, s, b));
  child.stderr.on("data", (b) => sendData(route, s, b));  // the SDK has one output stream: merged
  child.on("exit", () => {
    clearTimeout(s.termTimer); clearTimeout(s.killTimer);
    // A grandchild may hold the pipes open: stop waiting for them after 2 s.
    setTimeout(() => { child.stdout.destroy(); child.stderr.destroy(); }, 2000).unref();
  });
  child.on("close", (code) => { s.child = null; sendExit(route, s, code); });  // code null: killed by a signal
}

async function openChannel(p) {
  if (typeof p?.hostRouteId !== "string" || p.hostRouteId === "") fail("hostRouteId must be a non-empty string", -32602);
  if (!Array.isArray(p.command) || p.command.length === 0 || !p.command.every((a) => typeof a === "string")) {
    fail("command must be a non-empty array of strings", -32602);
  }
  const lease = leases.get(p.providerLeaseId);
  if (!lease) fail(`lease ${JSON.stringify(p.providerLeaseId)} is not in this worker's cache: acquire or resume it first`);
  if (lease.companyId !== p.companyId || lease.environmentId !== p.environmentId) {
    fail(`lease ${p.providerLeaseId} belongs to another company or environment`);
  }
  const dir = leaseDir(p.providerLeaseId);
  if (!fs.existsSync(dir)) fail(`lease ${p.providerLeaseId} no longer exists`);
  if (sessions.has(p.hostRouteId)) fail(`hostRouteId ${p.hostRouteId} is already open`);

  const route = p.hostRouteId;
  const s = { workerSessionId: `ws-${process.pid}-${nextSession++}`, providerLeaseId: p.providerLeaseId,
              child: null, exitSent: false, closed: false };
  sessions.set(route, s);
  let argv = p.command;
  if (HOOKS && argv[0] === "__data_before_answer__") {      // hook (c)
    sendData(route, s, Buffer.from("data before answer\n"));
    argv = argv.slice(1);
  }
  if (HOOKS && argv[0] === "__exit_before_answer__") {      // hook (c'): the exit frame too
    sendExit(route, s, Number(argv[1] ?? 0));
  } else if (HOOKS && (argv[0] === "__exit__" || argv.length === 0)) {  // hook (d): no child
    setTimeout(() => sendExit(route, s, Number(argv[1] ?? 0)), 10);  // after the open answer
  } else {
    await startChild(route, s, argv, dir);
  }
  return { hostRouteId: route, workerSessionId: s.workerSessionId };
}

// ---- one-shot commands and workspaces ---------------------------------------------------------

// The lease of a call that names one ({lease: {providerLeaseId}}): in this worker's cache, of
// the same scope, its directory still there.
function cachedLease(p) {
  const id = p?.lease?.providerLeaseId;
  const lease = leases.get(id);
  if (!lease) fail(`lease ${JSON.stringify(id)} is not in this worker's cache: acquire or resume it first`);
  if (lease.companyId !== p.companyId || lease.environmentId !== p.environmentId) {
    fail(`lease ${id} belongs to another company or environment`);
  }
  const dir = leaseDir(id);
  if (!fs.existsSync(dir)) fail(`lease ${id} no longer exists`);
  return dir;
}

// A path inside the lease directory (relative to it); nothing outside it.
function inside(dir, rel, field) {
  const full = path.resolve(dir, rel ?? ".");
  if (full !== dir && !full.startsWith(dir + path.sep)) fail(`${field} ${JSON.stringify(rel)} leaves the lease directory`, -32602);
  return full;
}

// environmentExecute: the command in the lease directory, its output streamed through
// ctx.execution.log (the SDK stamps each chunk with the call's invocation id) and returned whole.
async function execute(p) {
  const dir = cachedLease(p);
  if (typeof p.command !== "string" || p.command === "") fail("command must be a non-empty string", -32602);
  const args = p.args ?? [];
  if (!Array.isArray(args) || !args.every((a) => typeof a === "string")) fail("args must be an array of strings", -32602);
  const cwd = inside(dir, p.cwd, "cwd");
  const env = { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: dir, ...(isObject(p.env) ? p.env : {}) };
  const child = spawn(p.command, args, { cwd, env, stdio: ["pipe", "pipe", "pipe"] });
  const out = { stdout: [], stderr: [] };
  let timedOut = false;
  const timer = Number(p.timeoutMs) > 0
    ? setTimeout(() => { timedOut = true; child.kill("SIGKILL"); }, Number(p.timeoutMs)) : null;
  for (const stream of ["stdout", "stderr"]) {
    child[stream].setEncoding("utf8");
    child[stream].on("data", (text) => { out[stream].push(text); ctx.execution.log(stream, text); });
  }
  child.stdin.on("error", () => {});
  child.stdin.end(typeof p.stdin === "string" ? p.stdin : "");
  const [exitCode, signal] = await new Promise((resolve, reject) => {
    child.on("error", (e) => reject(Object.assign(new Error(`cannot run ${JSON.stringify(p.command)}: ${e.message}`))));
    child.on("close", (code, sig) => resolve([code, sig]));
  }).finally(() => clearTimeout(timer));
  const result = { exitCode, signal, timedOut, stdout: out.stdout.join(""), stderr: out.stderr.join(""),
                   metadata: { pid: process.pid } };
  journal("environmentExecute", p, { result: { exitCode, signal, timedOut } });
  return result;
}

// environmentRealizeWorkspace: a directory inside the lease for the workspace's remotePath.
async function realizeWorkspace(p) {
  const dir = cachedLease(p);
  const w = p.workspace;
  if (!isObject(w)) fail("workspace must be an object", -32602);
  if (w.localPath !== undefined) fail("workspace.localPath is not supported by sdk-local", -32602);
  const cwd = inside(dir, w.remotePath ?? "workspace", "workspace.remotePath");
  fs.mkdirSync(cwd, { recursive: true });
  const result = { cwd, metadata: { mode: w.mode ?? "default", providerLeaseId: p.lease.providerLeaseId } };
  journal("environmentRealizeWorkspace", p, { result });
  return result;
}

// ---- the plugin ------------------------------------------------------------------------------

const plugin = definePlugin({
  async setup(c) {
    ctx = c;
    if (!ROOT) fail("SDK_LOCAL_ROOT must name the directory that holds the leases");
    fs.mkdirSync(ROOT, { recursive: true });
    ctx.logger.info("sdk-local ready", { root: ROOT, testHooks: HOOKS, pid: process.pid });
  },

  async onHealth() {
    return { status: "ok", details: { root: ROOT, cachedLeases: leases.size, channels: sessions.size } };
  },

  async onShutdown() {
    for (const s of sessions.values()) s.child?.kill("SIGKILL");
  },

  async onEnvironmentAcquireLease(p) {
    return lifecycle("environmentAcquireLease", p, async () => {
      if (!isObject(p?.config)) fail("config is required (an object)", -32602);
      if (typeof p.runId !== "string" || p.runId === "") fail("runId is required (the SDK declares it)", -32602);
      const { expiresInMs, acquireDelayMs } = p.config;
      if (expiresInMs !== undefined && !(Number.isInteger(expiresInMs) && expiresInMs > 0)) {
        fail("config.expiresInMs must be a positive integer", -32602);
      }
      // Served by the host from the plugin's instance config; recorded so tests can check it.
      const instanceConfig = await ctx.config.get(p.companyId).catch((e) => ({ error: e.message, code: e.code }));

      const id = `sdk-${randomBytes(8).toString("hex")}`;
      const dir = leaseDir(id);
      fs.mkdirSync(dir);
      writeJson(path.join(dir, "acquire.json"), { params: p, instanceConfig });
      // Hook (a): the sandbox exists now, the answer comes late (after the host's timeout).
      if (HOOKS && Number(acquireDelayMs) > 0) await sleep(Number(acquireDelayMs));

      const lease = { providerLeaseId: id, metadata: metadataOf(id) };
      if (expiresInMs !== undefined) {
        let at = Date.now() + expiresInMs;
        const requested = Date.parse(p.requestedExpiresAt ?? "");
        if (!Number.isNaN(requested)) at = Math.min(at, requested);  // at or before the requested bound
        lease.expiresAt = new Date(at).toISOString();
      }
      writeJson(path.join(dir, "lease.json"), lease);
      leases.set(id, { companyId: p.companyId, environmentId: p.environmentId });
      return lease;
    });
  },

  async onEnvironmentResumeLease(p) {
    return lifecycle("environmentResumeLease", p, async () => {
      checkLeaseParams(p, { needMetadata: false });
      const rec = leaseRecord(p);
      if (!rec) fail(`lease ${p.providerLeaseId} not found: cannot resume`);
      writeJson(path.join(rec.dir, "resume.json"), p);
      leases.set(p.providerLeaseId, { companyId: p.companyId, environmentId: p.environmentId });
      const expiresAt = readJson(path.join(rec.dir, "lease.json"))?.expiresAt;  // absent if acquire never answered
      return { providerLeaseId: p.providerLeaseId, metadata: metadataOf(p.providerLeaseId), ...(expiresAt ? { expiresAt } : {}) };
    });
  },

  // Checks a lease config without making anything: numbers where numbers belong, and the
  // test-hook fields only when the hooks are on.
  async onEnvironmentValidateConfig(p) {
    const config = p?.config;
    if (!isObject(config)) return { ok: false, errors: ["config must be an object"] };
    const errors = [];
    const warnings = [];
    for (const [key, value] of Object.entries(config)) {
      if (["expiresInMs", "acquireDelayMs", "failTeardowns"].includes(key)) {
        if (!Number.isInteger(value) || value < 0) errors.push(`config.${key} must be a non-negative integer`);
        if (key !== "expiresInMs" && !HOOKS) warnings.push(`config.${key} is a test hook and is ignored: SDK_LOCAL_TEST_HOOKS is off`);
      } else {
        warnings.push(`config.${key} is not used by sdk-local`);
      }
    }
    journal("environmentValidateConfig", p, { result: { ok: errors.length === 0 } });
    return { ok: errors.length === 0, errors, warnings, normalizedConfig: config };
  },

  // The environment, not one lease (the SDK's probe has the base params only): is the root
  // there and writable, and how many leases does it hold for this scope.
  async onEnvironmentProbe(p) {
    let writable = true;
    try { fs.accessSync(ROOT, fs.constants.W_OK); } catch { writable = false; }
    const leasesHere = fs.readdirSync(ROOT).filter((d) => LEASE_ID.test(d)).length;
    const result = {
      ok: writable,
      summary: writable ? `sdk-local root ${ROOT} is writable` : `sdk-local root ${ROOT} is not writable`,
      diagnostics: [{ severity: writable ? "info" : "error", message: `${leasesHere} lease directories`, code: "leases" }],
      metadata: { root: ROOT, companyId: p?.companyId, environmentId: p?.environmentId, pid: process.pid },
    };
    journal("environmentProbe", p, { result });
    return result;
  },

  onEnvironmentExecute: execute,
  onEnvironmentRealizeWorkspace: realizeWorkspace,

  onEnvironmentReleaseLease: (p) => teardown("environmentReleaseLease", p, false),
  onEnvironmentDestroyLease: (p) => teardown("environmentDestroyLease", p, true),

  onDuplexChannelOpen: openChannel,

  async onDuplexChannelWrite(p) {
    const s = session(p);
    const bytes = decodeChannelBytes(p.data);
    if (bytes === null) fail("data must be non-empty base64 (RFC 4648, with padding)", -32602);
    if (!s.child) return;  // a hook session without a process: the bytes are dropped
    if (s.child.stdin.writableEnded) fail("the channel's stdin is closed (the channel is stopping)");
    await new Promise((resolve, reject) => s.child.stdin.write(bytes, (e) => (e ? reject(e) : resolve())));
  },

  // The SDK has no "close stdin" method, so stop is graceful: stdin EOF first, then SIGTERM after
  // SDK_LOCAL_STOP_GRACE_MS, then SIGKILL after as long again. The exit frame follows.
  async onDuplexChannelStop(p) {
    const s = session(p);
    const child = s.child;
    if (!child || s.termTimer) return;
    child.stdin.end();
    s.termTimer = setTimeout(() => child.kill("SIGTERM"), STOP_GRACE_MS);
    s.killTimer = setTimeout(() => child.kill("SIGKILL"), 2 * STOP_GRACE_MS);
  },

  // Close by the exact pair, or by hostRouteId alone; an unknown route is already closed.
  async onDuplexChannelClose(p) {
    const s = sessions.get(p?.hostRouteId);
    if (!s) return { hostRouteId: p?.hostRouteId };
    if (p.workerSessionId !== undefined && p.workerSessionId !== s.workerSessionId) {
      fail(`hostRouteId ${p.hostRouteId} is bound to ${s.workerSessionId}, not ${p.workerSessionId}`);
    }
    sessions.delete(p.hostRouteId);
    s.closed = true;  // no frame for this pair after the close acknowledgement
    s.child?.kill("SIGKILL");
    return { hostRouteId: p.hostRouteId, workerSessionId: s.workerSessionId };
  },
});

// The SDK exits at once on stdin EOF without calling onShutdown: end the children anyway.
process.on("exit", () => { for (const s of sessions.values()) s.child?.kill("SIGKILL"); });

export default plugin;
runWorker(plugin, import.meta.url);
