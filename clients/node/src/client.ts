// SandboxdClient: the host's handle on a sandboxd cluster (docs/protocol.md).
import { randomUUID } from "node:crypto";

import { Channel } from "./channel.js";
import { Connection, normalizeUrl, type TlsOptions } from "./connection.js";
import { SandboxdError } from "./errors.js";
import type {
  ChannelSignal,
  DuplexChannelAttachParams,
  DuplexChannelListResult,
  DuplexChannelOpenParams,
  InitializeParams,
  InitializeResult,
  Lease,
  LeaseAcquireParams,
  LeaseExecuteLog,
  LeaseExecuteParams,
  LeaseExecuteResult,
  LeaseGetParams,
  LeaseListParams,
  LeaseListResult,
  LeaseProbeParams,
  LeaseUpdateNetworkParams,
  LeaseProbeResult,
  LeaseRealizeWorkspaceParams,
  LeaseRealizeWorkspaceResult,
  LeaseReleaseParams,
  LeaseRenewParams,
  NodeListResult,
  ProviderValidateConfigParams,
  ProviderValidateConfigResult,
} from "./protocol.js";

export const CLIENT_VERSION = "0.1.0";

export interface ReconnectOptions {
  /** How many times a lease call is made again after its connection dropped (default 5). */
  retries?: number;
  /** The first wait before a new connection, doubled each time (default 200 ms). */
  initialDelayMs?: number;
  /** The longest wait (default 5,000 ms). */
  maxDelayMs?: number;
}

export interface SandboxdClientOptions {
  /** The node: `ws://host:port` or `wss://host:port` (path `/v1/ws` when none is given). */
  url: string;
  /** A `host`-role bearer token. */
  token?: string;
  /** For `wss://`: passed to `ws` (and Node's `tls.connect`) as given. */
  tls?: TlsOptions;
  /** The WebSocket handshake and `initialize` together (default 10,000 ms). */
  connectTimeoutMs?: number;
  /** Every request's answer (default 30,000 ms; `leaseExecute`: its timeoutMs + 60 s). 0: none. */
  requestTimeoutMs?: number;
  /** Lease calls are made again on a new connection when theirs drops; false: never. */
  reconnect?: ReconnectOptions | false;
  /** Follow `OWNER_ELSEWHERE` (a node in redirect mode) to the owner's URL once (default true). */
  followRedirects?: boolean;
  /** A ping this often; three intervals without a byte from the node drop the connection (default 20,000 ms; 0: none). */
  pingIntervalMs?: number;
  /** Sent in `initialize` (default `{name: "@sandboxd/client", version}`). */
  clientInfo?: { name: string; version: string };
}

/** Per call: an AbortSignal and a timeout that overrides `requestTimeoutMs`. */
export interface CallOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
}

export interface OpenOptions extends CallOptions {
  /**
   * For a detached channel (`detach`, and a lease given with its `id`): when its connection
   * drops, the client connects again (with the `reconnect` retries and delays; one try when
   * `reconnect` is false) and attaches to the channel from the offsets it has read, with
   * `takeover` (the node may not have seen the drop yet). The same Channel goes on, the output
   * without a byte lost or repeated (within the channel's retainBytes; past them a 'gap'
   * event says what was lost), after a delay; it emits 'resumed' each time. Stdin written in
   * the moments before the drop may be lost. When no attach succeeds, the channel ends with
   * outcome `transportClosed`.
   */
  resume?: boolean;
}

export interface ExecuteOptions extends CallOptions {
  /** Each `leaseExecute.log` notification, in output order, before the call resolves. */
  onLog?: (log: LeaseExecuteLog) => void;
}

/**
 * Methods that are made again on a new connection when theirs drops before the answer. Each
 * is safe to repeat: reads, renewals, releases (a release of a released lease returns it), and
 * acquires, which always carry an idempotencyKey. Opens and executes are never repeated: their
 * fate is unknown, so they fail with TRANSPORT_CLOSED.
 */
const RETRIED = new Set([
  "leaseAcquire",
  "leaseGet",
  "leaseList",
  "leaseRenew",
  "leaseRelease",
  "leaseProbe",
  "nodeList",
  "providerValidateConfig",
]);

/**
 * A client of one sandboxd node (and, for redirects, of the owners it names). Calls may be made
 * concurrently; at most the node's `requestsPerConnection` are in flight on one connection, the
 * rest wait in the client. Every failure is a SandboxdError. Not for browsers (it uses `ws`).
 */
export class SandboxdClient {
  private readonly options: Required<Omit<SandboxdClientOptions, "token" | "tls" | "reconnect">> &
    Pick<SandboxdClientOptions, "token" | "tls"> & { reconnect: Required<ReconnectOptions> | false };
  private primary: Connection | null = null;
  private connecting: Promise<Connection> | null = null;
  /** Connections to owners that a redirect named, by URL. */
  private readonly owners = new Map<string, Promise<Connection>>();
  private closed = false;

  constructor(options: SandboxdClientOptions) {
    this.options = {
      url: normalizeUrl(options.url),
      token: options.token,
      tls: options.tls,
      connectTimeoutMs: options.connectTimeoutMs ?? 10_000,
      requestTimeoutMs: options.requestTimeoutMs ?? 30_000,
      reconnect:
        options.reconnect === false
          ? false
          : {
              retries: options.reconnect?.retries ?? 5,
              initialDelayMs: options.reconnect?.initialDelayMs ?? 200,
              maxDelayMs: options.reconnect?.maxDelayMs ?? 5_000,
            },
      followRedirects: options.followRedirects ?? true,
      pingIntervalMs: options.pingIntervalMs ?? 20_000,
      clientInfo: options.clientInfo ?? { name: "@sandboxd/client", version: CLIENT_VERSION },
    };
  }

  /** Connects (if not connected) and returns the node's `initialize` answer. */
  async connect(options: CallOptions = {}): Promise<InitializeResult> {
    return (await this.connection(options.signal)).info;
  }

  /** The `initialize` answer of the current connection, or null before `connect()`. */
  get info(): InitializeResult | null {
    return this.primary?.info ?? null;
  }

  /** Closes every connection; open channels end with outcome `transportClosed`. */
  close(): void {
    this.closed = true;
    this.primary?.close();
    this.primary = null;
    for (const conn of this.owners.values()) void conn.then((c) => c.close(), () => {});
    this.owners.clear();
  }

  // ---- one method per protocol method ----

  /** `initialize` again on the current connection (connect() already sends it). */
  async initialize(params: Partial<InitializeParams> = {}, options: CallOptions = {}): Promise<InitializeResult> {
    return (await this.call("initialize", { protocolVersion: 1, ...params }, options)) as InitializeResult;
  }

  /** A new lease, or the same one for the same idempotencyKey: one is generated when absent. */
  async leaseAcquire(params: LeaseAcquireParams, options: CallOptions = {}): Promise<Lease> {
    const withKey = { ...params, idempotencyKey: params.idempotencyKey ?? randomUUID() };
    return (await this.call("leaseAcquire", withKey, options)) as Lease;
  }

  async leaseGet(params: LeaseGetParams, options: CallOptions = {}): Promise<Lease> {
    return (await this.call("leaseGet", params, options)) as Lease;
  }

  async leaseList(params: LeaseListParams = {}, options: CallOptions = {}): Promise<LeaseListResult> {
    return (await this.call("leaseList", params, options)) as LeaseListResult;
  }

  async leaseRenew(params: LeaseRenewParams, options: CallOptions = {}): Promise<Lease> {
    return (await this.call("leaseRenew", params, options)) as Lease;
  }

  async leaseRelease(params: LeaseReleaseParams, options: CallOptions = {}): Promise<Lease> {
    return (await this.call("leaseRelease", params, options)) as Lease;
  }

  async nodeList(options: CallOptions = {}): Promise<NodeListResult> {
    return (await this.call("nodeList", {}, options)) as NodeListResult;
  }

  /**
   * Replaces the network policy of a running lease (forwarded to its owner); connections the
   * new policy no longer allows are cut at once. Resolves to the lease with its new `network`.
   */
  async leaseUpdateNetwork(
    params: LeaseUpdateNetworkParams,
    options: CallOptions = {},
  ): Promise<Lease> {
    return (await this.call("leaseUpdateNetwork", params, options)) as Lease;
  }

  async leaseProbe(params: LeaseProbeParams, options: CallOptions = {}): Promise<LeaseProbeResult> {
    return (await this.call("leaseProbe", params, options)) as LeaseProbeResult;
  }

  async providerValidateConfig(
    params: ProviderValidateConfigParams,
    options: CallOptions = {},
  ): Promise<ProviderValidateConfigResult> {
    return (await this.call("providerValidateConfig", params, options)) as ProviderValidateConfigResult;
  }

  /**
   * Runs one command to its end; `onLog` gets its output as it comes. Waits for the answer up
   * to the command's timeoutMs (the node's default, 300,000, when absent) + 60 s.
   */
  async leaseExecute(params: LeaseExecuteParams, options: ExecuteOptions = {}): Promise<LeaseExecuteResult> {
    const timeoutMs = options.timeoutMs ?? (params.timeoutMs ?? 300_000) + 60_000;
    return (await this.call("leaseExecute", params, { ...options, timeoutMs })) as LeaseExecuteResult;
  }

  async leaseRealizeWorkspace(
    params: LeaseRealizeWorkspaceParams,
    options: CallOptions = {},
  ): Promise<LeaseRealizeWorkspaceResult> {
    return (await this.call("leaseRealizeWorkspace", params, options)) as LeaseRealizeWorkspaceResult;
  }

  /** Opens a duplex channel (the same as `open`). */
  async duplexChannelOpen(params: DuplexChannelOpenParams, options: CallOptions = {}): Promise<Channel> {
    return this.open(params, options);
  }

  /**
   * Opens a duplex channel to a command in a lease's sandbox. `lease` may be the Lease that
   * leaseAcquire returned. A node in redirect mode answers OWNER_ELSEWHERE: the open is made
   * once more on the owner (when followRedirects). Never repeated after a dropped connection:
   * that fails with TRANSPORT_CLOSED, as the open's fate is unknown.
   */
  async open(params: DuplexChannelOpenParams, options: OpenOptions = {}): Promise<Channel> {
    if (options.resume && (!params.detach || typeof params.lease?.id !== "string")) {
      throw SandboxdError.client("INVALID_PARAMS", "open: resume needs detach and the lease's id");
    }
    const run = (conn: Connection) => conn.openChannel(params, this.requestOptions(options));
    let channel: Channel;
    try {
      channel = await run(await this.connection(options.signal));
    } catch (error) {
      const owner = this.redirectTarget(error);
      if (!owner) throw error;
      channel = await run(await this.ownerConnection(owner, options.signal));
    }
    if (options.resume) this.resumeOnLoss(channel);
    return channel;
  }

  /**
   * Attaches to a detached channel of a lease (docs/protocol.md section 3.1), by handle or by
   * name: the kept output from `offsets` (or the oldest kept byte), then live output, then its
   * exit. CHANNEL_ATTACHED when another host is attached, unless `takeover`. With `resume`, as
   * open's.
   */
  async attach(params: DuplexChannelAttachParams, options: OpenOptions = {}): Promise<Channel> {
    const conn = await this.connection(options.signal);
    const channel = await conn.attachChannel(params, this.requestOptions(options));
    if (options.resume) this.resumeOnLoss(channel);
    return channel;
  }

  /** The same as `attach`. */
  async duplexChannelAttach(params: DuplexChannelAttachParams, options: OpenOptions = {}): Promise<Channel> {
    return this.attach(params, options);
  }

  /** A lease's detached channels, running and recently ended (oldest first). */
  async listChannels(params: { leaseId: string }, options: CallOptions = {}): Promise<DuplexChannelListResult> {
    return (await this.call("duplexChannelList", params, options)) as DuplexChannelListResult;
  }

  /** The same as `listChannels`. */
  async duplexChannelList(params: { leaseId: string }, options: CallOptions = {}): Promise<DuplexChannelListResult> {
    return this.listChannels(params, options);
  }

  // Channel controls by channel; prefer the Channel's own methods.
  async duplexChannelWrite(params: { channel: Channel; data: Uint8Array }): Promise<void> {
    await new Promise<void>((resolve) => params.channel.write(params.data, () => resolve()));
  }
  async duplexChannelCloseStdin(params: { channel: Channel }): Promise<void> {
    await params.channel.closeStdin();
  }
  async duplexChannelResize(params: { channel: Channel; cols: number; rows: number }, options: CallOptions = {}): Promise<void> {
    await params.channel.resize(params.cols, params.rows, options);
  }
  async duplexChannelSignal(params: { channel: Channel; signal: ChannelSignal }, options: CallOptions = {}): Promise<void> {
    await params.channel.signal(params.signal, options);
  }
  async duplexChannelStop(params: { channel: Channel }, options: CallOptions = {}): Promise<void> {
    await params.channel.stop(options);
  }
  async duplexChannelClose(params: { channel: Channel }): Promise<void> {
    await params.channel.close();
  }

  /**
   * Any method by name, with the client's connection, retry and redirect rules: for a method
   * this version does not wrap yet.
   */
  async request(method: string, params: unknown, options: ExecuteOptions = {}): Promise<unknown> {
    return this.call(method, params, options);
  }

  // ---- connections, retries and redirects ----

  /** Resumes `channel` on a new connection whenever its own drops (OpenOptions.resume). */
  private resumeOnLoss(channel: Channel): void {
    channel.onLost = (lost) => {
      if (this.closed || !lost.handle || !lost.leaseId) return false;
      void this.resume(lost, lost.handle, lost.leaseId);
      return true;
    };
  }

  private async resume(channel: Channel, handle: string, leaseId: string): Promise<void> {
    const retries = this.options.reconnect ? this.options.reconnect.retries : 0;
    for (let attempt = 0; !this.closed; attempt++) {
      try {
        const conn = await this.connection();
        await conn.attachChannel(
          { leaseId, handle, offsets: channel.offsets, takeover: true },
          this.requestOptions({}),
          channel,
        );
        return;
      } catch (error) {
        const gone =
          error instanceof SandboxdError &&
          ["CHANNEL_NOT_FOUND", "LEASE_NOT_FOUND", "LEASE_NOT_ACTIVE", "FORBIDDEN", "UNAUTHORIZED"].includes(error.reason);
        if (gone || attempt >= retries) break;
        await this.backoff(attempt);
      }
    }
    channel.onResumeFailed();
  }

  private requestOptions(options: ExecuteOptions) {
    return {
      timeoutMs: options.timeoutMs ?? this.options.requestTimeoutMs,
      ...(options.signal ? { signal: options.signal } : {}),
      ...(options.onLog ? { onLog: options.onLog } : {}),
    };
  }

  private async call(method: string, params: unknown, options: ExecuteOptions): Promise<unknown> {
    const retries = RETRIED.has(method) && this.options.reconnect ? this.options.reconnect.retries : 0;
    for (let attempt = 0; ; attempt++) {
      try {
        const conn = await this.connection(options.signal);
        try {
          return await conn.request(method, params, this.requestOptions(options));
        } catch (error) {
          const owner = this.redirectTarget(error);
          if (!owner) throw error;
          const ownerConn = await this.ownerConnection(owner, options.signal);
          return await ownerConn.request(method, params, this.requestOptions(options));
        }
      } catch (error) {
        if (!(error instanceof SandboxdError) || error.reason !== "TRANSPORT_CLOSED" || attempt >= retries || this.closed) {
          throw error;
        }
        await this.backoff(attempt, options.signal);
      }
    }
  }

  private redirectTarget(error: unknown): string | null {
    if (!this.options.followRedirects || !(error instanceof SandboxdError) || error.reason !== "OWNER_ELSEWHERE") {
      return null;
    }
    const url = error.data.ownerUrl;
    return typeof url === "string" && url.length > 0 ? url : null;
  }

  private async backoff(attempt: number, signal?: AbortSignal): Promise<void> {
    const r = this.options.reconnect;
    if (!r) return;
    const delay = Math.min(r.maxDelayMs, r.initialDelayMs * 2 ** attempt);
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
      }, delay);
      const onAbort = () => {
        clearTimeout(timer);
        reject(SandboxdError.client("ABORTED", "the call was aborted"));
      };
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  private connectionOptions(url: string) {
    return {
      url,
      connectTimeoutMs: this.options.connectTimeoutMs,
      pingIntervalMs: this.options.pingIntervalMs,
      clientInfo: this.options.clientInfo,
      ...(this.options.token !== undefined ? { token: this.options.token } : {}),
      ...(this.options.tls !== undefined ? { tls: this.options.tls } : {}),
    };
  }

  /** The connection to the configured node: opened on first use and again after a drop. */
  private async connection(signal?: AbortSignal): Promise<Connection> {
    if (this.closed) throw SandboxdError.client("TRANSPORT_CLOSED", "the client is closed");
    if (this.primary && !this.primary.closed) return this.primary;
    if (!this.connecting) {
      this.connecting = Connection.open(this.connectionOptions(this.options.url)).then(
        (conn) => {
          this.connecting = null;
          if (this.closed) {
            conn.close();
            throw SandboxdError.client("TRANSPORT_CLOSED", "the client is closed");
          }
          this.primary = conn;
          return conn;
        },
        (error) => {
          this.connecting = null;
          throw error;
        },
      );
    }
    return withAbort(this.connecting, signal);
  }

  private async ownerConnection(url: string, signal?: AbortSignal): Promise<Connection> {
    const key = normalizeUrl(url);
    const existing = this.owners.get(key);
    if (existing) {
      const conn = await existing.catch(() => null);
      if (conn && !conn.closed) return withAbort(Promise.resolve(conn), signal);
    }
    const opening = Connection.open(this.connectionOptions(key));
    this.owners.set(key, opening);
    opening.catch(() => this.owners.delete(key));
    return withAbort(opening, signal);
  }
}

/** The promise, or ABORTED when the signal fires first (the promise itself goes on). */
function withAbort<T>(promise: Promise<T>, signal?: AbortSignal): Promise<T> {
  if (!signal) return promise;
  if (signal.aborted) {
    promise.catch(() => {});  // its failure, if any, is nobody's now: not an unhandled rejection
    return Promise.reject(SandboxdError.client("ABORTED", "the call was aborted"));
  }
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(SandboxdError.client("ABORTED", "the call was aborted"));
    signal.addEventListener("abort", onAbort, { once: true });
    promise.then(
      (v) => {
        signal.removeEventListener("abort", onAbort);
        resolve(v);
      },
      (e) => {
        signal.removeEventListener("abort", onAbort);
        reject(e);
      },
    );
  });
}
