// Headless Chromium for the console test, driven over the DevTools protocol with `ws`: started
// with its own profile directory in its own process group, found by its own pid, killed with
// its group afterwards. SANDBOXD_CHROMIUM names the browser, else /usr/bin/chromium.
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { inflateSync } from "node:zlib";
import WebSocket from "ws";

import { eventually } from "./daemon.js";

export function chromiumPath(): string | null {
  const bin = process.env.SANDBOXD_CHROMIUM ?? "/usr/bin/chromium";
  return existsSync(bin) ? bin : null;
}

type Listener = (params: Record<string, unknown>, sessionId?: string) => void;

export class Browser {
  private readonly child: ChildProcess;
  private readonly profile: string;
  private ws!: WebSocket;
  private nextId = 1;
  private readonly pending = new Map<number, { resolve: (v: any) => void; reject: (e: Error) => void }>();
  private readonly listeners = new Map<string, Set<Listener>>();

  private constructor(child: ChildProcess, profile: string) {
    this.child = child;
    this.profile = profile;
  }

  static async launch(): Promise<Browser> {
    const bin = chromiumPath();
    if (!bin) throw new Error("no chromium");
    const profile = mkdtempSync(join(process.env.TMPDIR || tmpdir(), "sandboxd-chromium."));
    const args = [
      "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
      "--disable-dev-shm-usage", "--disable-extensions", "--mute-audio",
      `--user-data-dir=${profile}`, "--remote-debugging-port=0", "--window-size=1000,700",
    ];
    // Chromium's own sandbox cannot run as root.
    if (process.getuid?.() === 0) args.push("--no-sandbox");
    args.push("about:blank");
    // Its temporary files (org.chromium.Chromium.*) go inside the profile, removed at close.
    const child = spawn(bin, args, {
      detached: true, stdio: ["ignore", "ignore", "ignore"], env: { ...process.env, TMPDIR: profile },
    });
    const b = new Browser(child, profile);
    const portFile = join(profile, "DevToolsActivePort");
    await eventually(() => existsSync(portFile) && readFileSync(portFile, "utf8").split("\n").length >= 2, 30_000, "Chromium's DevTools port");
    const [port, path] = readFileSync(portFile, "utf8").split("\n");
    b.ws = new WebSocket(`ws://127.0.0.1:${port}${path}`, { perMessageDeflate: false, maxPayload: 256 << 20 });
    await new Promise<void>((resolve, reject) => {
      b.ws.once("open", () => resolve());
      b.ws.once("error", reject);
    });
    b.ws.on("message", (data) => {
      const msg = JSON.parse(data.toString());
      if (typeof msg.id === "number") {
        const p = b.pending.get(msg.id);
        if (!p) return;
        b.pending.delete(msg.id);
        if (msg.error) p.reject(new Error(`${msg.error.message} (${msg.error.code})`));
        else p.resolve(msg.result);
      } else if (typeof msg.method === "string") {
        for (const l of b.listeners.get(msg.method) ?? []) l(msg.params, msg.sessionId);
      }
    });
    return b;
  }

  send(method: string, params: Record<string, unknown> = {}, sessionId?: string): Promise<any> {
    const id = this.nextId++;
    this.ws.send(JSON.stringify({ id, method, params, ...(sessionId ? { sessionId } : {}) }));
    return new Promise((resolve, reject) => this.pending.set(id, { resolve, reject }));
  }

  /** The next event `method` (of `sessionId`), as a promise; register before causing it. */
  once(method: string, sessionId?: string): Promise<Record<string, unknown>> {
    return new Promise((resolve) => {
      const set = this.listeners.get(method) ?? new Set<Listener>();
      this.listeners.set(method, set);
      const l: Listener = (params, sid) => {
        if (sessionId && sid !== sessionId) return;
        set.delete(l);
        resolve(params);
      };
      set.add(l);
    });
  }

  /** A new page: its DevTools session id. */
  async newPage(): Promise<string> {
    const { targetId } = await this.send("Target.createTarget", { url: "about:blank" });
    const { sessionId } = await this.send("Target.attachToTarget", { targetId, flatten: true });
    await this.send("Page.enable", {}, sessionId);
    await this.send("Runtime.enable", {}, sessionId);
    await this.send("Emulation.setFocusEmulationEnabled", { enabled: true }, sessionId);
    return sessionId as string;
  }

  async navigate(sessionId: string, url: string): Promise<void> {
    const loaded = this.once("Page.loadEventFired", sessionId);
    const { errorText } = await this.send("Page.navigate", { url }, sessionId);
    if (errorText) throw new Error(`navigate ${url}: ${errorText}`);
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`navigate ${url}: no load event within 30 s`)), 30_000);
    });
    try {
      await Promise.race([loaded, timeout]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Evaluates an expression in the page; its value (awaited, by value). */
  async evaluate(sessionId: string, expression: string): Promise<any> {
    const r = await this.send("Runtime.evaluate", { expression, awaitPromise: true, returnByValue: true }, sessionId);
    if (r.exceptionDetails) throw new Error(`in the page: ${JSON.stringify(r.exceptionDetails).slice(0, 500)}`);
    return r.result.value;
  }

  async close(): Promise<void> {
    try {
      this.ws?.close();
    } catch {
      /* already closed */
    }
    if (this.child.pid && this.child.exitCode === null) {
      const exited = new Promise((resolve) => this.child.once("exit", resolve));
      try {
        process.kill(-this.child.pid, "SIGKILL");
      } catch {
        /* gone */
      }
      await exited;
    }
    rmSync(this.profile, { recursive: true, force: true });
  }
}

/** Width, height and how many distinct colours a PNG has (8-bit RGB or RGBA, not interlaced). */
export function pngColours(png: Buffer): { width: number; height: number; colours: number } {
  if (png.subarray(0, 8).toString("hex") !== "89504e470d0a1a0a") throw new Error("not a PNG");
  let at = 8;
  let width = 0, height = 0, colourType = 0, depth = 0;
  const idat: Buffer[] = [];
  while (at < png.length) {
    const len = png.readUInt32BE(at);
    const type = png.toString("latin1", at + 4, at + 8);
    const data = png.subarray(at + 8, at + 8 + len);
    if (type === "IHDR") {
      width = data.readUInt32BE(0);
      height = data.readUInt32BE(4);
      depth = data[8] as number;
      colourType = data[9] as number;
      if (data[12] !== 0) throw new Error("interlaced PNG");
    } else if (type === "IDAT") {
      idat.push(data);
    }
    at += 12 + len;
  }
  if (depth !== 8 || (colourType !== 2 && colourType !== 6)) throw new Error(`PNG depth ${depth} type ${colourType}`);
  const bpp = colourType === 6 ? 4 : 3;
  const raw = inflateSync(Buffer.concat(idat));
  const stride = width * bpp;
  const prev = Buffer.alloc(stride);
  const cur = Buffer.alloc(stride);
  const seen = new Set<number>();
  for (let y = 0; y < height; y++) {
    const filter = raw[y * (stride + 1)] as number;
    const line = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    for (let x = 0; x < stride; x++) {
      const a = x >= bpp ? (cur[x - bpp] as number) : 0;
      const b = prev[x] as number;
      const c = x >= bpp ? (prev[x - bpp] as number) : 0;
      const v = line[x] as number;
      let out: number;
      if (filter === 0) out = v;
      else if (filter === 1) out = v + a;
      else if (filter === 2) out = v + b;
      else if (filter === 3) out = v + ((a + b) >> 1);
      else {
        const p = a + b - c;
        const pa = Math.abs(p - a), pb = Math.abs(p - b), pc = Math.abs(p - c);
        out = v + (pa <= pb && pa <= pc ? a : pb <= pc ? b : c);
      }
      cur[x] = out & 0xff;
    }
    for (let x = 0; x < stride; x += bpp) seen.add(((cur[x] as number) << 16) | ((cur[x + 1] as number) << 8) | (cur[x + 2] as number));
    cur.copy(prev);
  }
  return { width, height, colours: seen.size };
}
