// A duplex channel as Node streams (docs/protocol.md sections 3 and 4).
import { Duplex, Readable } from "node:stream";

import type { Connection } from "./connection.js";
import { SandboxdError } from "./errors.js";
import { creditFrame, dataFrame, MAX_DATA_PAYLOAD, STREAM_STDERR, STREAM_STDIN, STREAM_STDOUT } from "./frames.js";
import type {
  ChannelExit,
  ChannelGap,
  ChannelSignal,
  DuplexChannelAttachResult,
  DuplexChannelOpenParams,
  DuplexChannelOpenResult,
  StreamOffsets,
} from "./protocol.js";

/** What a channel is made from: an open's result, or an attach's. */
export type ChannelInit = (DuplexChannelOpenResult | DuplexChannelAttachResult) & {
  hostRouteId?: string | null;
  workerSessionId?: string | null;
};

/** What of the request a channel keeps. */
export type ChannelRequest = Pick<DuplexChannelOpenParams, "hostRouteId" | "outputWindow" | "stdin"> & {
  leaseId?: string;
};

/** The exit made by the client when no exit comes from the node (close, dropped connection). */
function madeExit(channel: number, hostRouteId: string | null, outcome: "stopped" | "transportClosed"): ChannelExit {
  return {
    channel,
    hostRouteId,
    exitCode: null,
    signal: null,
    outcome,
    stdoutBytes: null,
    stderrBytes: null,
    stdinBytes: null,
    durationMs: null,
  };
}

interface QueuedWrite {
  data: Buffer;
  offset: number;
  done: (error?: Error | null) => void;
}

/**
 * One open channel. The channel itself is a Duplex: what you write is the command's stdin,
 * what you read is its stdout (under a PTY, stdout and stderr merged); `stderr` is a second
 * Readable.
 *
 * Flow control is automatic: output credit goes back to the node as you read (so a consumer
 * that stops reading holds the command back, through the node, instead of buffering here:
 * at most `outputWindow` bytes wait in this object), and stdin is sent only within the node's
 * `stdinWindow` (beyond it `write()` returns false and `drain` follows once the node credits).
 * `end()` closes the command's stdin once everything written before has been sent.
 *
 * The streams never emit 'error': how the channel ended is `exit`, a promise that resolves
 * once with the exit object, after every byte of output has been pushed into the streams and
 * the streams that are being read (a 'data' or 'readable' listener, a pipe, `resume()`, an
 * async iterator) have emitted 'end'. After `close()`, which gets no exit from the node, and
 * when the connection drops, the client makes the exit: outcome `stopped` or
 * `transportClosed`, with null exitCode, signal and counters. The channel also emits 'exit'.
 */
export class Channel extends Duplex {
  /** The channel's id on its connection (a new one after a resume). */
  get id(): number {
    return this.channelId;
  }
  /** A detached channel's durable handle (docs/protocol.md section 3.1), else null. */
  readonly handle: string | null;
  /** A detached channel's name, else null. */
  readonly name: string | null;
  /** The lease, when the open named it by id or this is an attachment. */
  readonly leaseId: string | null;
  readonly hostRouteId: string | null;
  /** The node whose sandbox runs the command. */
  readonly ownerNodeId: string;
  /** Whether the node that answered forwarded the open to the owner. */
  readonly routed: boolean;
  readonly outputWindow: number;
  readonly stdinWindow: number;
  readonly workerSessionId: string | null;
  /** The command's stderr (empty under a PTY). */
  readonly stderr: Readable;
  /** Resolves once with how the channel ended; never rejects. */
  readonly exit: Promise<ChannelExit>;

  private conn: Connection;
  private channelId: number;
  // Absolute offset of the first byte pushed on each stream (a detached channel attached
  // from an offset, or past a gap): offsets = start + pushed.
  private startOut = 0;
  private startErr = 0;
  /** Every `duplexChannel.gap` of this channel so far (also emitted as 'gap'). */
  readonly gaps: ChannelGap[] = [];
  /** @internal A detached channel whose connection dropped: true when the client resumes it. */
  onLost: ((channel: Channel) => boolean) | null = null;
  private resolveExit!: (exit: ChannelExit) => void;
  private exitInfo: ChannelExit | null = null;
  private closedByClient = false;
  // Output flow control: bytes pushed into each readable, and credited back so far.
  private pushedOut = 0;
  private pushedErr = 0;
  private credited = 0;
  private readonly creditThreshold: number;
  // Stdin flow control: bytes sent and not yet credited by the node.
  private stdinInFlight = 0;
  private readonly stdinQueue: QueuedWrite[] = [];
  private readonly noStdin: boolean;

  constructor(conn: Connection, result: ChannelInit, params: ChannelRequest) {
    const stdinWindow = positive(result.stdinWindow, conn.info?.limits?.stdinWindow, 1 << 20);
    super({
      allowHalfOpen: true,
      // Stdin beyond this is kept waiting for the window and makes write() return false.
      writableHighWaterMark: Math.min(stdinWindow, 1 << 20),
      // Output is bounded by the window; the readable's own mark only says when to pause.
      readableHighWaterMark: 64 * 1024,
    });
    this.conn = conn;
    this.channelId = result.channel;
    this.handle = result.handle ?? null;
    this.name = result.name ?? null;
    this.leaseId = ("leaseId" in result ? result.leaseId : undefined) ?? params.leaseId ?? null;
    if ("offsets" in result && result.offsets) {
      this.startOut = result.offsets.stdout;
      this.startErr = result.offsets.stderr;
    }
    this.hostRouteId = result.hostRouteId ?? params.hostRouteId ?? null;
    this.ownerNodeId = result.ownerNodeId;
    this.routed = result.routed === true;
    this.workerSessionId = result.workerSessionId ?? null;
    this.outputWindow = positive(result.outputWindow, params.outputWindow, conn.info?.limits?.outputWindow ?? 1 << 20);
    this.stdinWindow = stdinWindow;
    // Credit in quarters of the window: few credit frames, and never a stall (a quarter is
    // reached whenever the node has used its whole window and the consumer has read it).
    this.creditThreshold = Math.max(1, Math.floor(this.outputWindow / 4));
    this.stderr = new OutputStream(() => this.returnCredit());
    this.exit = new Promise<ChannelExit>((resolve) => (this.resolveExit = resolve));
    this.noStdin = params.stdin === false;
    if (this.noStdin) this.end();
  }

  // ---- controls (each a request on the channel's connection) ----

  /** The terminal's new size (PTY channels only), 1..4096 each. */
  async resize(cols: number, rows: number, options: { signal?: AbortSignal } = {}): Promise<void> {
    await this.control("duplexChannelResize", { channel: this.id, cols, rows }, options);
  }

  /** Sends a signal to the command's process group. */
  async signal(signal: ChannelSignal, options: { signal?: AbortSignal } = {}): Promise<void> {
    await this.control("duplexChannelSignal", { channel: this.id, signal }, options);
  }

  /** Closes the command's stdin after what was written before it (same as `end()`, awaited). */
  async closeStdin(): Promise<void> {
    if (this.writableFinished) return;
    await new Promise<void>((resolve) => {
      this.once("finish", resolve);
      this.once("close", resolve);
      this.end();
    });
  }

  /** Kills the command's process tree; its exit follows (outcome `stopped`). */
  async stop(options: { signal?: AbortSignal } = {}): Promise<void> {
    if (this.exitInfo) return;
    await this.control("duplexChannelStop", { channel: this.id }, options);
  }

  /**
   * Stops the channel and forgets it: no exit comes from the node; `exit` resolves with outcome
   * `stopped` and null counters. Idempotent.
   */
  async close(): Promise<void> {
    if (this.exitInfo || this.closedByClient) return;
    this.closedByClient = true;
    this.conn.forget(this);
    const answer = this.conn.closed
      ? Promise.resolve()
      : this.conn
          .request("duplexChannelClose", { channel: this.id }, { timeoutMs: 30_000 })
          .then(() => undefined, () => undefined);
    this.finish(madeExit(this.id, this.hostRouteId, "stopped"));
    await answer;
  }

  private async control(method: string, params: Record<string, unknown>, options: { signal?: AbortSignal }): Promise<void> {
    await this.conn.request(method, params, { timeoutMs: 30_000, ...(options.signal ? { signal: options.signal } : {}) });
  }

  /**
   * Bytes received so far per stream, as absolute offsets of the command's output: where a
   * detached channel resumes (`attach({offsets})`) to miss and repeat nothing.
   */
  get offsets(): StreamOffsets {
    return { stdout: this.startOut + this.pushedOut, stderr: this.startErr + this.pushedErr };
  }

  // ---- from the connection ----

  /**
   * @internal `duplexChannel.gap`: the bytes before `firstKept` are lost; what follows starts
   * there. Emitted as 'gap'.
   */
  onGap(gap: ChannelGap): void {
    if (gap.stream === "stderr") this.startErr = gap.firstKept - this.pushedErr;
    else this.startOut = gap.firstKept - this.pushedOut;
    this.gaps.push(gap);
    // A turn later: the gap may come in the same socket read as the attach's answer, before
    // the code that awaited attach() has added its listener.
    setImmediate(() => this.emit("gap", gap));
  }

  /**
   * @internal The channel goes on as attachment `result` on `conn` (a resume after a dropped
   * connection): output continues from its offsets, the windows start afresh.
   */
  rebind(conn: Connection, result: DuplexChannelAttachResult): void {
    this.conn = conn;
    this.channelId = result.channel;
    this.startOut = result.offsets.stdout - this.pushedOut;
    this.startErr = result.offsets.stderr - this.pushedErr;
    // Bytes received before are credited already as far as the new attachment is concerned.
    this.credited = this.pushedOut + this.pushedErr;
    this.stdinInFlight = Math.max(0, this.stdinWindow - result.stdinWindow);
    this.emit("resumed", result);
    this.pump();
  }

  /** @internal A resume failed for good: the channel ends as its connection did. */
  onResumeFailed(): void {
    this.finish(madeExit(this.id, this.hostRouteId, "transportClosed"));
  }

  /** @internal */
  onData(stream: number, payload: Buffer): void {
    if (this.exitInfo) return;
    if (stream === STREAM_STDERR) {
      this.pushedErr += payload.length;
      if (this.stderr.destroyed) this.returnCredit();
      else this.stderr.push(payload);
    } else if (stream === STREAM_STDOUT) {
      this.pushedOut += payload.length;
      if (this.destroyed || this.readableEnded) this.returnCredit();
      else this.push(payload);
    }
  }

  /** @internal */
  onCredit(stream: number, bytes: number): void {
    if (stream !== STREAM_STDIN) return;
    this.stdinInFlight = Math.max(0, this.stdinInFlight - bytes);
    this.pump();
  }

  /** @internal */
  onExit(exit: ChannelExit): void {
    this.finish(exit);
  }

  /** @internal */
  onTransportClosed(): void {
    if (!this.exitInfo && !this.closedByClient && this.onLost?.(this)) return;
    this.finish(madeExit(this.id, this.hostRouteId, "transportClosed"));
  }

  private finish(exit: ChannelExit): void {
    if (this.exitInfo) return;
    this.exitInfo = exit;
    // Stdin that can no longer reach the command is dropped, as the node drops it.
    for (const w of this.stdinQueue.splice(0)) w.done();
    if (!this.readableEnded && !this.destroyed) this.push(null);
    if (!this.stderr.destroyed) this.stderr.push(null);
    // Which streams are being read is decided a turn later: the output and the exit may
    // arrive in the same socket read as the open's answer, before the code that awaited
    // open() has attached its listeners (it runs in the microtasks before that turn).
    setImmediate(() => {
      const streams: Readable[] = [this, this.stderr];
      const waits = streams
        .filter((s) => s.readableFlowing !== null && !s.readableEnded && !s.destroyed)
        .map(
          (s) =>
            new Promise<void>((resolve) => {
              s.once("end", resolve);
              s.once("close", resolve);
            }),
        );
      void Promise.all(waits).then(() => {
        this.emit("exit", exit);
        this.resolveExit(exit);
      });
    });
  }

  /** Credits back what the consumer has taken from both readables, a quarter window at a time. */
  private returnCredit(): void {
    if (this.exitInfo || this.conn.closed) return;
    const heldOut = this.destroyed ? 0 : this.readableLength;
    const heldErr = this.stderr.destroyed ? 0 : this.stderr.readableLength;
    const consumed = this.pushedOut - heldOut + (this.pushedErr - heldErr);
    const owed = consumed - this.credited;
    if (owed < this.creditThreshold) return;
    this.credited += owed;
    this.conn.sendBinary(creditFrame(this.id, STREAM_STDOUT, owed));
  }

  // ---- stream internals ----

  // Credit is returned when the consumer takes bytes out of a readable: after every read()
  // (flowing mode reads through it too), and after _read, which Node calls before it takes them.
  override read(size?: number): any {
    const chunk: unknown = super.read(size);
    this.returnCredit();
    return chunk;
  }

  override _read(): void {
    queueMicrotask(() => this.returnCredit());
  }

  override _write(chunk: Buffer, _encoding: BufferEncoding, done: (error?: Error | null) => void): void {
    if (this.exitInfo || chunk.length === 0) {
      done();
      return;
    }
    this.stdinQueue.push({ data: chunk, offset: 0, done });
    this.pump();
  }

  override _final(done: (error?: Error | null) => void): void {
    if (this.exitInfo || this.conn.closed || this.noStdin) {
      done();
      return;
    }
    this.conn.request("duplexChannelCloseStdin", { channel: this.id }, { timeoutMs: 30_000 }).then(
      () => done(),
      // The channel ended meanwhile, or the connection dropped: exit says how.
      () => done(),
    );
  }

  override _destroy(error: Error | null, done: (error?: Error | null) => void): void {
    // A consumer that destroys the channel no longer wants it: close it on the node.
    if (!this.exitInfo) void this.close();
    if (!this.stderr.destroyed) this.stderr.destroy();
    done(error);
  }

  /** Sends queued stdin within the window, in frames of at most the node's payload limit. */
  private pump(): void {
    const maxPayload = Math.min(MAX_DATA_PAYLOAD, this.conn.info?.limits?.maxDataPayload ?? MAX_DATA_PAYLOAD);
    // A detached channel being resumed sends once it is rebound to its new connection.
    while (this.stdinQueue.length > 0 && !this.exitInfo && !this.conn.closed) {
      const head = this.stdinQueue[0] as QueuedWrite;
      const room = this.stdinWindow - this.stdinInFlight;
      if (room <= 0) return;
      const n = Math.min(room, maxPayload, head.data.length - head.offset);
      const payload = head.data.subarray(head.offset, head.offset + n);
      head.offset += n;
      this.stdinInFlight += n;
      this.conn.sendBinary(dataFrame(this.id, STREAM_STDIN, payload));
      if (head.offset === head.data.length) {
        this.stdinQueue.shift();
        head.done();
      }
    }
  }
}

/** stderr: a Readable that tells its channel when the consumer took bytes from it. */
class OutputStream extends Readable {
  private readonly consumed: () => void;

  constructor(consumed: () => void) {
    super({ highWaterMark: 64 * 1024 });
    this.consumed = consumed;
  }

  override read(size?: number): any {
    const chunk: unknown = super.read(size);
    this.consumed();
    return chunk;
  }

  override _read(): void {
    queueMicrotask(this.consumed);
  }

  override _destroy(error: Error | null, done: (error?: Error | null) => void): void {
    queueMicrotask(this.consumed);
    done(error);
  }
}

function positive(...candidates: (number | undefined | null)[]): number {
  for (const c of candidates) if (typeof c === "number" && Number.isFinite(c) && c > 0) return c;
  throw SandboxdError.client("PROTOCOL_ERROR", "the node gave no window for the channel");
}
