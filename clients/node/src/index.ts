// @sandboxd/client: a host client for sandboxd (docs/protocol.md in the sandboxd repository).
export { SandboxdClient, CLIENT_VERSION } from "./client.js";
export type { SandboxdClientOptions, ReconnectOptions, CallOptions, ExecuteOptions, OpenOptions } from "./client.js";
export { Channel } from "./channel.js";
export { SandboxdError } from "./errors.js";
export type { TlsOptions } from "./connection.js";
export { createSandboxdRunner } from "./runner.js";
export type {
  SandboxdRunner,
  SandboxdRunnerOptions,
  SandboxdDuplexChannel,
  SandboxdExecuteInput,
  SandboxdRunProcessResult,
} from "./runner.js";
export * from "./protocol.js";
