// One WebSocket to one sandboxd node: JSON-RPC requests and their answers, notifications, and
// the binary frames of the channels opened on it. Not exported: SandboxdClient owns connections.
import { EventEmitter } from "node:events";
import WebSocket, { type ClientOptions } from "ws";

import { SandboxdError } from "./errors.js";
import { decodeFrame, FRAME_CREDIT, FRAME_DATA } from "./frames.js";
import type {
  ChannelExit,
  DuplexChannelOpenParams,
  ChannelGap,
  DuplexChannelAttachParams,
  DuplexChannelAttachResult,
  DuplexChannelOpenResult,
  InitializeResult,
  LeaseExecuteLog,
} from "./protocol.js";
import { PROTOCOL_VERSION, SUBPROTOCOL } from "./protocol.js";
import { Channel } from "./channel.js";

/** TLS options, passed to `ws` (and so to `tls.connect`) as they are. */
export interface TlsOptions {
  ca?: string | Buffer | (string | Buffer)[];
  cert?: string | Buffer;
  key?: string | Buffer;
  passphrase?: string;
  servername?: string;
  /** Default true. false accepts any certificate: for tests only. */
  rejectUnauthorized?: boolean;
  minVersion?: "TLSv1.2" | "TLSv1.3";
}

export interface ConnectionOptions {
  url: string;
  token?: string;
  tls?: TlsOptions;
  connectTimeoutMs: number;
  pingIntervalMs: number;
  clientInfo: { name: string; version: string };
}

export interface RequestOptions {
  signal?: AbortSignal;
  /** No answer within this many ms: TIMEOUT. 0: none. */
  timeoutMs: number;
  /** For leaseExecute: its `leaseExecute.log` notifications, in order. */
  onLog?: (log: LeaseExecuteLog) => void;
}

interface Pending {
  method: string;
  resolve: (result: unknown) => void;
  reject: (error: SandboxdError) => void;
  onLog?: (log: LeaseExecuteLog) => void;
  /** For an open: makes the channel as the answer is read, before any of its frames. */
  onResult?: (result: unknown) => void;
  cleanup: () => void;
}

/** Where the URL names no path, the protocol's own: ws://host:port -> ws://host:port/v1/ws. */
export function normalizeUrl(url: string): string {
  const u = new URL(url);
  if (u.protocol !== "ws:" && u.protocol !== "wss:") {
    throw SandboxdError.client("PROTOCOL_ERROR", `url must start with ws:// or wss://, not ${u.protocol}//`);
  }
  if (u.pathname === "" || u.pathname === "/") u.pathname = "/v1/ws";
  return u.toString();
}

function abortError(): SandboxdError {
  return SandboxdError.client("ABORTED", "the call was aborted");
}

export class Connection extends EventEmitter {
  readonly url: string;
  info!: InitializeResult;
  private readonly ws: WebSocket;
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  readonly channels = new Map<number, Channel>();
  private closedError: SandboxdError | null = null;
  private inFlight = 0;
  private readonly waiting: (() => void)[] = [];
  private lastHeard = Date.now();
  private pinger: NodeJS.Timeout | null = null;

  private constructor(ws: WebSocket, url: string) {
    super();
    this.ws = ws;
    this.url = url;
  }

  /** Opens the WebSocket and sends `initialize`. Rejects with a SandboxdError. */
  static async open(options: ConnectionOptions, signal?: AbortSignal): Promise<Connection> {
    const url = normalizeUrl(options.url);
    if (signal?.aborted) throw abortError();
    const wsOptions: ClientOptions = {
      perMessageDeflate: false,
      handshakeTimeout: options.connectTimeoutMs,
      headers: options.token ? { Authorization: `Bearer ${options.token}` } : {},
      // The node's limits are 1 MiB for text and 256 KiB (+6) for frames; allow a margin.
      maxPayload: 64 * 1024 * 1024,
      ...(options.tls ?? {}),
    };
    const ws = new WebSocket(url, [SUBPROTOCOL], wsOptions);
    ws.binaryType = "nodebuffer";
    const conn = new Connection(ws, url);
    await new Promise<void>((resolve, reject) => {
      let settled = false;
      const fail = (error: SandboxdError) => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener("abort", onAbort);
        ws.terminate();
        reject(error);
      };
      const onAbort = () => fail(abortError());
      signal?.addEventListener("abort", onAbort, { once: true });
      ws.once("unexpected-response", (_req, res) => {
        const status = res.statusCode ?? 0;
        let body = "";
        res.setEncoding("utf8");
        res.on("data", (chunk: string) => {
          if (body.length < 1024) body += chunk;
        });
        res.on("end", () => {
          const text = body.trim();
          const why = `${url} answered HTTP ${status}${text ? `: ${text}` : ""}`;
          fail(
            status === 401 || status === 403
              ? SandboxdError.client("UNAUTHORIZED", why, { status })
              : SandboxdError.client("TRANSPORT_CLOSED", why, { status }),
          );
        });
        res.on("error", () => fail(SandboxdError.client("TRANSPORT_CLOSED", `${url} answered HTTP ${status}`)));
      });
      ws.once("error", (err: Error) => {
        const timedOut = /timed out/i.test(err.message);
        fail(
          SandboxdError.client(timedOut ? "TIMEOUT" : "TRANSPORT_CLOSED", `cannot connect to ${url}: ${err.message}`),
        );
      });
      ws.once("open", () => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener("abort", onAbort);
        resolve();
      });
    });
    conn.attach(options.pingIntervalMs);
    try {
      conn.info = (await conn.request(
        "initialize",
        { protocolVersion: PROTOCOL_VERSION, client: options.clientInfo },
        { timeoutMs: options.connectTimeoutMs, ...(signal ? { signal } : {}) },
      )) as InitializeResult;
    } catch (error) {
      conn.close();
      throw error;
    }
    return conn;
  }

  private attach(pingIntervalMs: number): void {
    this.ws.on("message", (data: Buffer, isBinary: boolean) => {
      this.lastHeard = Date.now();
      if (isBinary) this.onBinary(data);
      else this.onText(data.toString("utf8"));
    });
    this.ws.on("pong", () => (this.lastHeard = Date.now()));
    this.ws.on("ping", () => (this.lastHeard = Date.now()));
    this.ws.on("error", () => {
      /* 'close' follows and says so */
    });
    this.ws.on("close", (code: number, reason: Buffer) => {
      const why = reason.length > 0 ? `: ${reason.toString("utf8")}` : "";
      this.shutdown(SandboxdError.client("TRANSPORT_CLOSED", `connection to ${this.url} closed (${code}${why})`, { closeCode: code }));
    });
    if (pingIntervalMs > 0) {
      this.pinger = setInterval(() => {
        // Three intervals without a byte from the node: it is gone, whatever TCP thinks.
        if (Date.now() - this.lastHeard > 3 * pingIntervalMs) {
          this.ws.terminate();
          return;
        }
        if (this.ws.readyState === WebSocket.OPEN) this.ws.ping();
      }, pingIntervalMs);
      this.pinger.unref();
    }
  }

  get closed(): boolean {
    return this.closedError !== null;
  }

  /** How many requests may be in flight: the node's `requestsPerConnection`. */
  private get requestLimit(): number {
    return this.info?.limits?.requestsPerConnection ?? 64;
  }

  private async acquireSlot(signal?: AbortSignal): Promise<void> {
    if (this.inFlight < this.requestLimit) {
      this.inFlight++;
      return;
    }
    await new Promise<void>((resolve, reject) => {
      const go = () => {
        signal?.removeEventListener("abort", onAbort);
        this.inFlight++;
        resolve();
      };
      const onAbort = () => {
        const at = this.waiting.indexOf(go);
        if (at >= 0) this.waiting.splice(at, 1);
        reject(abortError());
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.waiting.push(go);
    });
  }

  private releaseSlot(): void {
    this.inFlight--;
    const next = this.waiting.shift();
    if (next) next();
  }

  /** Sends one request and resolves with its result; every failure is a SandboxdError. */
  async request(method: string, params: unknown, options: RequestOptions & { onResult?: (r: unknown) => void }): Promise<unknown> {
    if (this.closedError) throw this.closedError;
    if (options.signal?.aborted) throw abortError();
    await this.acquireSlot(options.signal);
    if (this.closedError) {
      this.releaseSlot();
      throw this.closedError;
    }
    const id = this.nextId++;
    return new Promise<unknown>((resolve, reject) => {
      let timer: NodeJS.Timeout | null = null;
      const onAbort = () => {
        const p = this.pending.get(id);
        if (!p) return;
        this.abandon(id, p);
        reject(abortError());
      };
      const cleanup = () => {
        if (timer) clearTimeout(timer);
        options.signal?.removeEventListener("abort", onAbort);
        this.releaseSlot();
      };
      const entry: Pending = {
        method,
        resolve,
        reject,
        cleanup,
        ...(options.onLog ? { onLog: options.onLog } : {}),
        ...(options.onResult ? { onResult: options.onResult } : {}),
      };
      this.pending.set(id, entry);
      if (options.timeoutMs > 0) {
        timer = setTimeout(() => {
          const p = this.pending.get(id);
          if (!p) return;
          this.abandon(id, p);
          reject(SandboxdError.client("TIMEOUT", `${method}: no answer from ${this.url} within ${options.timeoutMs} ms`));
        }, options.timeoutMs);
      }
      options.signal?.addEventListener("abort", onAbort, { once: true });
      this.ws.send(JSON.stringify({ jsonrpc: "2.0", id, method, params }), (err) => {
        if (err && this.pending.get(id) === entry) {
          this.pending.delete(id);
          cleanup();
          reject(SandboxdError.client("TRANSPORT_CLOSED", `${method}: cannot send to ${this.url}: ${err.message}`));
        }
      });
    });
  }

  /**
   * A request given up (aborted, timed out) before its answer: it stays known, so that an open
   * answered later is closed on the node instead of running unseen.
   */
  private abandon(id: number, p: Pending): void {
    p.cleanup();
    const abandoned: Pending = {
      method: p.method,
      resolve: (result) => {
        if (p.method === "duplexChannelOpen" || p.method === "duplexChannelAttach") {
          const channel = (result as DuplexChannelOpenResult | null)?.channel;
          if (typeof channel === "number") this.notify("duplexChannelClose", { channel });
        }
      },
      reject: () => {},
      cleanup: () => {},
    };
    this.pending.set(id, abandoned);
  }

  /** A notification (no answer comes). Ignored once the connection is closed. */
  notify(method: string, params: unknown): void {
    if (this.closedError) return;
    this.ws.send(JSON.stringify({ jsonrpc: "2.0", method, params }), () => {});
  }

  /** A binary frame; `done` once `ws` has handed it to the socket (or failed). */
  sendBinary(frame: Buffer, done?: (err?: Error) => void): void {
    if (this.closedError) {
      done?.(this.closedError);
      return;
    }
    this.ws.send(frame, { binary: true }, done);
  }

  /** Opens a channel; its Channel exists before any of its frames is read. */
  async openChannel(params: DuplexChannelOpenParams, options: RequestOptions): Promise<Channel> {
    let channel: Channel | null = null;
    const leaseId = typeof params.lease?.id === "string" ? params.lease.id : undefined;
    await this.request("duplexChannelOpen", params, {
      ...options,
      onResult: (result) => {
        channel = new Channel(this, result as DuplexChannelOpenResult, { ...params, ...(leaseId ? { leaseId } : {}) });
        this.channels.set(channel.id, channel);
      },
    });
    if (!channel) throw SandboxdError.client("PROTOCOL_ERROR", "duplexChannelOpen answered without a channel");
    return channel;
  }

  /**
   * Attaches to a detached channel: a new Channel, or `into` resumed (rebound to this
   * connection). Either exists before any of the attachment's frames is read.
   */
  async attachChannel(params: DuplexChannelAttachParams, options: RequestOptions, into?: Channel): Promise<Channel> {
    let channel: Channel | null = null;
    await this.request("duplexChannelAttach", params, {
      ...options,
      onResult: (result) => {
        const attached = result as DuplexChannelAttachResult;
        if (into) {
          into.rebind(this, attached);
          channel = into;
        } else {
          const request = params.outputWindow ? { outputWindow: params.outputWindow } : {};
          channel = new Channel(this, attached, request);
        }
        this.channels.set(channel.id, channel);
      },
    });
    if (!channel) throw SandboxdError.client("PROTOCOL_ERROR", "duplexChannelAttach answered without a channel");
    return channel;
  }

  private onText(text: string): void {
    let message: {
      id?: unknown;
      method?: unknown;
      params?: unknown;
      result?: unknown;
      error?: unknown;
    };
    try {
      message = JSON.parse(text);
    } catch {
      this.protocolError("the node sent a text frame that is not JSON");
      return;
    }
    if (typeof message.method === "string") {
      this.onNotification(message.method, message.params);
      return;
    }
    if (typeof message.id !== "number") {
      // An error without an id answers something unreadable (not ours); nothing waits for it.
      return;
    }
    const p = this.pending.get(message.id);
    if (!p) return;
    this.pending.delete(message.id);
    p.cleanup();
    if (message.error !== undefined) {
      p.reject(SandboxdError.fromWire(message.error));
    } else {
      try {
        p.onResult?.(message.result);
      } catch (error) {
        p.reject(error instanceof SandboxdError ? error : SandboxdError.client("PROTOCOL_ERROR", String(error)));
        return;
      }
      p.resolve(message.result);
    }
  }

  private onNotification(method: string, params: unknown): void {
    const p = (params ?? {}) as Record<string, unknown>;
    if (method === "duplexChannel.exit") {
      const channel = this.channels.get(p.channel as number);
      if (!channel) return;
      this.channels.delete(channel.id);
      channel.onExit(params as ChannelExit);
    } else if (method === "duplexChannel.gap") {
      this.channels.get(p.channel as number)?.onGap(params as ChannelGap);
    } else if (method === "duplexChannel.data") {
      const channel = this.channels.get(p.channel as number);
      if (!channel || typeof p.chunk !== "string") return;
      channel.onData(p.stream === "stderr" ? 2 : 1, Buffer.from(p.chunk, "base64"));
    } else if (method === "leaseExecute.log") {
      const pending = typeof p.requestId === "number" ? this.pending.get(p.requestId) : undefined;
      pending?.onLog?.(params as LeaseExecuteLog);
    }
    this.emit("notification", method, params);
  }

  private onBinary(data: Buffer): void {
    let frame;
    try {
      frame = decodeFrame(data);
    } catch (error) {
      this.protocolError(`the node sent a bad frame: ${(error as Error).message}`);
      return;
    }
    const channel = this.channels.get(frame.channel);
    if (!channel) return;  // closed by us: the node forgets it too
    if (frame.kind === FRAME_DATA) channel.onData(frame.stream, frame.payload);
    else if (frame.kind === FRAME_CREDIT) channel.onCredit(frame.stream, frame.credit);
  }

  private protocolError(why: string): void {
    this.ws.close(1002, why.slice(0, 120));
    this.shutdown(SandboxdError.client("PROTOCOL_ERROR", why));
  }

  forget(channel: Channel): void {
    if (this.channels.get(channel.id) === channel) this.channels.delete(channel.id);
  }

  /** Closes the WebSocket (1000); every request and channel ends as TRANSPORT_CLOSED. */
  close(): void {
    if (this.ws.readyState === WebSocket.OPEN || this.ws.readyState === WebSocket.CONNECTING) {
      this.ws.close(1000);
    }
    this.shutdown(SandboxdError.client("TRANSPORT_CLOSED", `connection to ${this.url} closed by the client`));
  }

  private shutdown(error: SandboxdError): void {
    if (this.closedError) return;
    this.closedError = error;
    if (this.pinger) clearInterval(this.pinger);
    const pending = [...this.pending.values()];
    this.pending.clear();
    for (const p of pending) {
      p.cleanup();
      p.reject(error);
    }
    const channels = [...this.channels.values()];
    this.channels.clear();
    for (const c of channels) c.onTransportClosed();
    for (const w of this.waiting.splice(0)) w();
    this.emit("close", error);
  }
}
