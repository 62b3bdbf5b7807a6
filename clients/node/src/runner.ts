// paperclip's CommandManagedRuntimeRunner over a sandboxd lease. The types below are structural
// copies of `@paperclipai/adapter-utils` (dist/command-managed-runtime.d.ts, version 2026.916.1),
// so that this package does not depend on it at run time; the tests check with the TypeScript
// compiler that createSandboxdRunner's result is assignable to the published interface.
import type { Channel } from "./channel.js";
import type { SandboxdClient } from "./client.js";
import { SandboxdError } from "./errors.js";
import type { ChannelLease, Lease, LeaseExecuteParams } from "./protocol.js";

/** adapter-utils' RunProcessResult, as the runner fills it in. */
export interface SandboxdRunProcessResult {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  /** No process id crosses the sandbox boundary: always null. */
  pid: number | null;
  startedAt: string | null;
  finishedAt?: string | null;
  durationMs?: number | null;
}

/** adapter-utils' execute input: leaseExecute's params (the lease is the runner's) and its callbacks. */
export interface SandboxdExecuteInput extends Omit<LeaseExecuteParams, "leaseId"> {
  onLog?: (stream: "stdout" | "stderr", chunk: string) => Promise<void>;
  /** Never called: no process id crosses the sandbox boundary. */
  onSpawn?: (meta: { pid: number; startedAt: string }) => Promise<void>;
  /** Accepted and ignored: sandboxd has no persistent session. */
  useSession?: boolean;
}

/** adapter-utils' CommandManagedDuplexChannel. */
export interface SandboxdDuplexChannel {
  write(data: Uint8Array): void;
  onData(listener: (chunk: Uint8Array) => void): void;
  onExit(listener: (exit: { exitCode: number | null; transportClosed?: boolean }) => void): void;
  stop(): void;
  close(): Promise<void>;
  /** The sandboxd channel underneath, for what the paperclip interface does not carry. */
  readonly channel: Channel;
}

export interface SandboxdRunner {
  execute(input: SandboxdExecuteInput): Promise<SandboxdRunProcessResult>;
  openDuplexChannel(input: { command: readonly string[] }): Promise<SandboxdDuplexChannel>;
  supportsSingleStreamStdinProgress: false;
}

export interface SandboxdRunnerOptions {
  client: SandboxdClient;
  /** The lease whose sandbox runs every command (the Lease that leaseAcquire returned). */
  lease: Lease | (ChannelLease & { id: string });
  /** The working directory of duplex channels (default: the sandbox's, /workspace). */
  cwd?: string;
  /** Environment added to every duplex channel. */
  env?: Record<string, string>;
  /**
   * Duplex channels are detached (docs/protocol.md section 3.1) and resumed after a dropped
   * connection (`open`'s `resume`): the agent's long-lived command goes on, and its stream with
   * it, while the host reconnects. Default true; false: a dropped connection ends the command
   * (outcome `transportClosed`). An object sets the kept output and exit
   * (`{retainBytes, retainMs}`; the node's defaults otherwise).
   */
  detach?: boolean | { retainMs?: number; retainBytes?: number };
}

/**
 * A runner for paperclip's command-managed runtime: `execute` is `leaseExecute` with `onLog`
 * streaming (in output order, each call awaited before the next) and the command's real exit
 * code; `openDuplexChannel` is a duplex channel, detached and resumed across a dropped connection
 * unless `detach: false`. No `syncIn`/`syncOut`: file sync is not served,
 * so adapter-utils falls back to its shell transport over `execute`.
 */
export function createSandboxdRunner(options: SandboxdRunnerOptions): SandboxdRunner {
  const { client, lease } = options;
  return {
    supportsSingleStreamStdinProgress: false,

    async execute(input) {
      const startedAt = new Date();
      // onLog is async: run the calls one after another, in the order the output came.
      let logs: Promise<void> = Promise.resolve();
      let logError: unknown = null;
      const onLog = input.onLog;
      const result = await client.leaseExecute(
        {
          leaseId: lease.id,
          command: input.command,
          ...(input.args ? { args: input.args } : {}),
          ...(input.cwd ? { cwd: input.cwd } : {}),
          ...(input.env ? { env: input.env } : {}),
          ...(input.stdin !== undefined ? { stdin: input.stdin } : {}),
          ...(input.timeoutMs !== undefined ? { timeoutMs: input.timeoutMs } : {}),
          ...(input.bypassSession !== undefined ? { bypassSession: input.bypassSession } : {}),
        },
        onLog
          ? {
              onLog: (log) => {
                logs = logs.then(() => onLog(log.stream, log.chunk)).catch((error) => {
                  logError ??= error;
                });
              },
            }
          : {},
      );
      await logs;
      if (logError) throw logError;
      const finishedAt = new Date();
      const metaDuration = result.metadata?.durationMs;
      return {
        exitCode: result.exitCode,
        signal: result.signal,
        timedOut: result.timedOut,
        stdout: result.stdout,
        stderr: result.stderr,
        pid: null,
        startedAt: startedAt.toISOString(),
        finishedAt: finishedAt.toISOString(),
        durationMs: typeof metaDuration === "number" ? metaDuration : finishedAt.getTime() - startedAt.getTime(),
      };
    },

    async openDuplexChannel(input) {
      if (input.command.length === 0) {
        throw SandboxdError.client("PROTOCOL_ERROR", "openDuplexChannel: command needs at least the program");
      }
      const detach = options.detach === false ? null : options.detach === true || options.detach === undefined ? {} : options.detach;
      const channel = await client.open(
        {
          lease,
          command: [...input.command],
          ...(options.cwd ? { cwd: options.cwd } : {}),
          ...(options.env ? { env: options.env } : {}),
          ...(detach ? { detach } : {}),
        },
        detach ? { resume: true } : {},
      );
      // Both streams feed the one data listener (paperclip's channel has one output).
      let exitListener: ((exit: { exitCode: number | null; transportClosed?: boolean }) => void) | null = null;
      let dataListener: ((chunk: Uint8Array) => void) | null = null;
      const pendingData: Uint8Array[] = [];
      const deliver = (chunk: Buffer) => {
        if (dataListener) dataListener(chunk);
        else pendingData.push(chunk);
      };
      channel.on("data", deliver);
      channel.stderr.on("data", deliver);
      let reported = false;
      void channel.exit.then((exit) => {
        reported = true;
        exitListener?.({ exitCode: exit.exitCode, transportClosed: exit.outcome === "transportClosed" });
      });
      return {
        channel,
        write(data) {
          channel.write(data);
        },
        onData(listener) {
          dataListener = listener;
          for (const chunk of pendingData.splice(0)) listener(chunk);
        },
        onExit(listener) {
          exitListener = listener;
          if (reported) {
            void channel.exit.then((exit) =>
              listener({ exitCode: exit.exitCode, transportClosed: exit.outcome === "transportClosed" }),
            );
          }
        },
        stop() {
          channel.stop().catch(() => {
            /* already ended, or the connection dropped: onExit says so */
          });
        },
        async close() {
          if (!detach) {
            await channel.close();
            return;
          }
          // Closing an attachment would only let go of it: the command is ended instead.
          await channel.stop().catch(() => {});
          await channel.exit;
        },
      };
    },
  };
}
