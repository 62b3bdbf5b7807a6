// A real sandboxd for the client's tests: started on 127.0.0.1:0 with its own state directory,
// found by its own pid, stopped (SIGTERM) and removed afterwards, as tests/support/
// daemon_fixture.cpp does for the C++ tests. SANDBOXD_BIN names the daemon (ctest sets it);
// else the dev build of the repository.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, mkdirSync, readFileSync, rmSync, writeFileSync, existsSync, openSync, closeSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
/** The repository root (this file is clients/node/build-test/test/daemon.js once compiled). */
export const repoRoot = resolve(here, "../../../..");

export function sandboxdBin(): string {
  return process.env.SANDBOXD_BIN ?? join(repoRoot, "build/dev/sandboxd");
}

export interface DaemonOptions {
  nodeId?: string;
  /** The config file's JSON (always written: limits.drainTimeoutMs is 0 unless it sets one). */
  config?: Record<string, unknown>;
  /** Added to the daemon's environment. */
  env?: Record<string, string>;
  /** Write the audit trail to `<dir>/audit.jsonl` (Daemon.audit() reads it). */
  audit?: boolean;
  /** HOST:PORT to listen on (default 127.0.0.1:0). */
  listen?: string;
}

/** Resolves when `check` returns true (polled every 20 ms), else rejects after `ms`. */
export async function eventually(check: () => boolean | Promise<boolean>, ms: number, what: string): Promise<void> {
  const deadline = Date.now() + ms;
  for (;;) {
    if (await check()) return;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

export class Daemon {
  readonly dir: string;
  readonly stateDir: string;
  readonly nodeId: string;
  private readonly options: DaemonOptions;
  private child: ChildProcess | null = null;
  private exited: Promise<number | null> = Promise.resolve(null);
  address = "";
  /** Where the next launch listens: 127.0.0.1:0, or the address of the last one (relaunch). */
  listen: string;

  private constructor(options: DaemonOptions) {
    this.options = options;
    this.nodeId = options.nodeId ?? "node-a";
    this.dir = mkdtempSync(join(process.env.TMPDIR || tmpdir(), "sandboxd-node-test."));
    this.stateDir = join(this.dir, "state");
    this.listen = options.listen ?? "127.0.0.1:0";
    mkdirSync(this.stateDir);
  }

  static async start(options: DaemonOptions = {}): Promise<Daemon> {
    const d = new Daemon(options);
    await d.launch();
    return d;
  }

  get url(): string {
    return `ws://${this.address}/v1/ws`;
  }

  get pid(): number {
    return this.child?.pid ?? -1;
  }

  /** The generated host token (`<stateDir>/admin.token`; no auth.tokens configured). */
  get token(): string {
    return readFileSync(join(this.stateDir, "admin.token"), "utf8").trim();
  }

  get log(): string {
    try {
      return readFileSync(join(this.dir, "daemon.log"), "utf8");
    } catch {
      return "";
    }
  }

  async launch(): Promise<void> {
    const ready = join(this.dir, "ready");
    rmSync(ready, { force: true });
    const args = [
      "--state-dir", this.stateDir,
      "--listen", this.listen,
      "--ready-file", ready,
      "--node-id", this.nodeId,
      "--log-level", "debug",
    ];
    {
      const config = { ...(this.options.config ?? {}) };
      if (this.options.audit) config.audit = { file: join(this.dir, "audit.jsonl") };
      // Tests stop their daemons with SIGTERM: without a drain of their own it is 0 (the 30 s
      // default would hold a stop with a channel left running), as in tests/support.
      const limits = { ...((config.limits as Record<string, unknown> | undefined) ?? {}) };
      if (!("drainTimeoutMs" in limits)) limits.drainTimeoutMs = 0;
      config.limits = limits;
      // Sandboxes end with their daemon (providers.bwrap.adoptTimeoutMs 0) unless the test
      // says otherwise: nothing of a test's daemon outlives it, as in tests/support.
      const providers = { ...((config.providers as Record<string, unknown> | undefined) ?? {}) };
      const bwrap = { ...((providers.bwrap as Record<string, unknown> | undefined) ?? {}) };
      if (!("adoptTimeoutMs" in bwrap)) bwrap.adoptTimeoutMs = 0;
      providers.bwrap = bwrap;
      config.providers = providers;
      const cfg = join(this.dir, "config.json");
      writeFileSync(cfg, JSON.stringify(config));
      args.unshift("--config", cfg);
    }
    const log = openSync(join(this.dir, "daemon.log"), "a");
    const child = spawn(sandboxdBin(), args, {
      stdio: ["ignore", "ignore", log],
      env: { ...process.env, ...(this.options.env ?? {}) },
    });
    closeSync(log);
    this.child = child;
    this.exited = new Promise((resolve) => child.once("exit", (code) => resolve(code)));
    let exitedEarly = false;
    void this.exited.then(() => (exitedEarly = true));
    await eventually(
      () => {
        if (exitedEarly) throw new Error(`sandboxd exited during start:\n${this.log}`);
        return existsSync(ready);
      },
      30_000,
      "sandboxd to become ready",
    );
    this.address = readFileSync(ready, "utf8").split("\n")[0] ?? "";
  }

  /** The audit trail's lines (with `audit: true`). */
  audit(): Record<string, unknown>[] {
    try {
      return readFileSync(join(this.dir, "audit.jsonl"), "utf8")
        .split("\n")
        .filter((l) => l.trim() !== "")
        .map((l) => JSON.parse(l) as Record<string, unknown>);
    } catch {
      return [];
    }
  }

  /** VmHWM (peak resident set) of the daemon, in bytes, from /proc/<pid>/status. */
  peakRss(): number {
    const status = readFileSync(`/proc/${this.pid}/status`, "utf8");
    const m = /VmHWM:\s+(\d+) kB/.exec(status);
    if (!m) throw new Error("no VmHWM in /proc/<pid>/status");
    return Number(m[1]) * 1024;
  }

  /** Resets VmHWM to the current RSS (writing 5 to /proc/<pid>/clear_refs). */
  resetPeakRss(): void {
    writeFileSync(`/proc/${this.pid}/clear_refs`, "5");
  }

  /** SIGTERM and wait (SIGKILL after 20 s). Returns the exit code. */
  async stop(): Promise<number | null> {
    const child = this.child;
    if (!child || child.exitCode !== null || child.signalCode !== null) return child?.exitCode ?? null;
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), 20_000);
    const code = await this.exited;
    clearTimeout(timer);
    return code;
  }

  /** Starts the daemon again on the same state directory and the same address. */
  async relaunch(): Promise<void> {
    await this.stop();
    this.listen = this.address;
    await this.launch();
  }

  /** SIGKILL and wait. */
  async kill9(): Promise<void> {
    const child = this.child;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    child.kill("SIGKILL");
    await this.exited;
  }

  /** Stops the daemon and removes its directory. */
  async dispose(): Promise<void> {
    await this.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }
}
