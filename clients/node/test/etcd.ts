// A private etcd for a test (the tests that stop it must own it): free loopback ports, its own
// data directory, stopped and removed afterwards. SANDBOXD_ETCD_BIN, else /usr/bin/etcd.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, openSync, closeSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

export class Etcd {
  readonly dir: string;
  endpoint = "";
  private child: ChildProcess | null = null;
  private exited: Promise<void> = Promise.resolve();

  private constructor() {
    this.dir = mkdtempSync(join(process.env.TMPDIR || tmpdir(), "sandboxd-node-etcd."));
  }

  static async start(): Promise<Etcd> {
    const e = new Etcd();
    const client = `http://127.0.0.1:${await freePort()}`;
    const peer = `http://127.0.0.1:${await freePort()}`;
    e.endpoint = client;
    const log = openSync(join(e.dir, "etcd.log"), "a");
    const child = spawn(
      process.env.SANDBOXD_ETCD_BIN ?? "/usr/bin/etcd",
      [
        "--name", "t", "--data-dir", join(e.dir, "data"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", `t=${peer}`,
      ],
      { stdio: ["ignore", "ignore", log] },
    );
    closeSync(log);
    e.child = child;
    e.exited = new Promise((resolve) => child.once("exit", () => resolve()));
    // Ready when its health endpoint answers.
    const deadline = Date.now() + 30_000;
    for (;;) {
      try {
        const res = await fetch(`${client}/health`);
        if (res.ok) break;
      } catch {
        /* not listening yet */
      }
      if (Date.now() > deadline) throw new Error("etcd did not start");
      await new Promise((r) => setTimeout(r, 50));
    }
    return e;
  }

  async stop(): Promise<void> {
    if (!this.child || this.child.exitCode !== null || this.child.signalCode !== null) return;
    this.child.kill("SIGTERM");
    await this.exited;
  }

  async dispose(): Promise<void> {
    await this.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }
}
