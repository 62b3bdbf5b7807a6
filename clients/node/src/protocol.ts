// The wire types of sandboxd's protocol, version 1 (docs/protocol.md in the sandboxd
// repository is the source of every name, unit and range here). Sizes are bytes and times
// milliseconds unless a name says otherwise; timestamps are RFC 3339 strings.

export const PROTOCOL_VERSION = 1;
/** The WebSocket subprotocol that this client offers (docs/protocol.md section 1). */
export const SUBPROTOCOL = "sandboxd.v1";

export type LeaseStatus = "active" | "released" | "expired" | "failed" | "pending_cleanup" | "retained";
export type LeasePolicy =
  | "ephemeral"
  | "reuse_by_environment"
  | "reuse_by_execution_workspace"
  | "retain_on_failure";

export interface LeaseLimits {
  memoryBytes: number | null;
  pids: number | null;
  cpuWeight: number | null;
  cpuQuotaPercent: number | null;
  diskBytes: number | null;
  openFiles: number | null;
  /** Network bytes per second of a lease with egress, each way; null: none. */
  egressBps?: number | null;
}

export interface LeaseUsage {
  memoryBytes: number | null;
  pids: number | null;
  diskBytes: number | null;
  cpuMs: number | null;
  /** Bytes the lease received and sent through its veth (0 without egress). */
  netRxBytes?: number;
  netTxBytes?: number;
}

/** A lease: one sandbox bound to one tenant scope and one owner node (section 2). */
export interface Lease {
  id: string;
  companyId: string;
  environmentId: string;
  runId?: string | null;
  issueId?: string | null;
  heartbeatRunId?: string | null;
  executionWorkspaceId?: string | null;
  agentId?: string | null;
  status: LeaseStatus;
  leasePolicy: LeasePolicy;
  provider: string;
  providerLeaseId: string;
  ownerNodeId: string;
  /** Fencing token: compare for equality only (on etcd it grows by more than 1). */
  epoch: number;
  acquiredAt: string;
  lastUsedAt: string;
  expiresAt: string | null;
  releasedAt: string | null;
  failureReason: string | null;
  cleanupStatus: string | null;
  metadata: { pluginId: string; provider: string };
  providerMetadata: Record<string, unknown> | null;
  hostMetadata: Record<string, unknown> | null;
  capabilities: Capability[] | null;
  limits: LeaseLimits | null;
  /** The lease's network policy as applied (issue 48); null for plugin leases. */
  network: NetworkPolicy | null;
  usage: LeaseUsage | null;
}

/**
 * A host in a network rule: a domain name ("example.com"; "*.example.com" for its subdomains),
 * an IPv4 or IPv6 address, or a CIDR with its host bits zero.
 */
export type NetworkHost = string;

/** A network rule: a host, or a host with ports (numbers, or "LO-HI" ranges) and a protocol. */
export type NetworkRule =
  | NetworkHost
  | { host: NetworkHost; ports?: Array<number | string>; protocol?: "tcp" | "udp" };

/**
 * A lease's network policy (docs/protocol.md section 8, "Network"). "none": loopback only.
 * "egress": everything not denied, or only what `allow` allows when it is given. As
 * Lease.network gives it, every rule is an object.
 */
export interface NetworkPolicy {
  mode: "none" | "egress";
  allow?: NetworkRule[];
  deny?: NetworkRule[];
}

export interface LeaseUpdateNetworkParams {
  leaseId: string;
  /** A policy, or true (egress with the node's default rules) / false (none). */
  network: NetworkPolicy | boolean;
}

export type Capability =
  | "channels"
  | "pty"
  | "stderr"
  | "signals"
  | "closeStdin"
  | "resize"
  | "probe"
  | "execute"
  | "realizeWorkspace"
  | "validateConfig"
  | "resume"
  | "retain"
  | "network";

export interface InitializeParams {
  protocolVersion: 1;
  client?: { name: string; version: string };
}

export interface NodeLimits {
  maxTextMessage: number;
  maxDataPayload: number;
  channelsPerConnection: number;
  channelsPerNode: number;
  outputWindow: number;
  stdinWindow: number;
  requestsPerConnection: number;
}

export interface ProviderInfo {
  provider: string;
  pluginId: string;
  ready: boolean;
  capabilities: Capability[];
}

export interface InitializeResult {
  protocolVersion: number;
  nodeId: string;
  supportedMethods: string[];
  limits: NodeLimits;
  providers: ProviderInfo[];
}

export interface LeaseAcquireParams {
  companyId: string;
  environmentId: string;
  provider: string;
  config?: Record<string, unknown>;
  /** 1.. ; the node's default when absent. */
  ttlMs?: number;
  runId?: string;
  issueId?: string;
  heartbeatRunId?: string;
  executionWorkspaceId?: string;
  agentId?: string;
  /** Same key and scope: the same lease back. The client fills one in when absent (see SandboxdClient). */
  idempotencyKey?: string;
  /** The host's own object, at most 64 KiB as JSON; returned as `hostMetadata`. */
  metadata?: Record<string, unknown>;
  leasePolicy?: LeasePolicy;
}

export interface LeaseGetParams {
  leaseId: string;
}

export interface LeaseListParams {
  companyId?: string;
  environmentId?: string;
  status?: LeaseStatus;
  ownerNodeId?: string;
  limit?: number;
  cursor?: string;
}

export interface LeaseListResult {
  leases: Lease[];
  nextCursor: string | null;
}

export interface LeaseRenewParams {
  leaseId: string;
  ttlMs: number;
}

export interface LeaseReleaseParams {
  leaseId: string;
  disposition?: "destroy" | "retain";
  failed?: boolean;
}

export interface NodeInfo {
  nodeId: string;
  url: string;
  startedAt: string;
  heartbeatAt: string;
  alive: boolean;
  leases: number;
  channels: number;
}

export interface NodeListResult {
  nodes: NodeInfo[];
}

export interface LeaseProbeParams {
  leaseId: string;
}

/** paperclip's probe result, verbatim. */
export interface LeaseProbeResult {
  ok: boolean;
  summary?: string;
  diagnostics?: { severity: string; message: string; code?: string; details?: unknown }[];
  metadata?: Record<string, unknown>;
}

export interface ProviderValidateConfigParams {
  provider: string;
  config?: Record<string, unknown>;
}

export interface ProviderValidateConfigResult {
  ok: boolean;
  warnings?: string[];
  errors?: string[];
  normalizedConfig?: Record<string, unknown>;
}

export interface LeaseExecuteParams {
  leaseId: string;
  /** The program, 1..4096 bytes. */
  command: string;
  args?: string[];
  cwd?: string;
  env?: Record<string, string>;
  /** Written to the command, then closed; absent: stdin is empty. */
  stdin?: string;
  /** 1..86400000; the node's `limits.executeTimeoutMs` when absent. */
  timeoutMs?: number;
  bypassSession?: boolean;
}

export interface LeaseExecuteResult {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  metadata?: Record<string, unknown>;
}

export interface LeaseExecuteLog {
  requestId: number | string;
  stream: "stdout" | "stderr";
  chunk: string;
}

export interface LeaseRealizeWorkspaceParams {
  leaseId: string;
  workspace: { remotePath?: string; mode?: string; metadata?: Record<string, unknown> };
}

export interface LeaseRealizeWorkspaceResult {
  cwd: string;
  metadata?: Record<string, unknown>;
}

/** The lease of an open: the full Lease that the client got back, or at least these fields. */
export interface ChannelLease {
  id?: string;
  providerLeaseId: string;
  companyId: string;
  environmentId: string;
  epoch?: number;
  metadata: { pluginId: string; provider: string };
  [field: string]: unknown;
}

export interface DuplexChannelOpenParams {
  hostRouteId?: string;
  lease: ChannelLease | Lease;
  /** argv: at least one element, no NUL bytes. */
  command: string[];
  cwd?: string;
  env?: Record<string, string>;
  /** Run under a pseudo-terminal of this size (1..4096 each). */
  pty?: { cols: number; rows: number };
  /** Default true; false: the command's stdin is at EOF at once. */
  stdin?: boolean;
  /** Wall-clock limit; then the process tree is killed (outcome `timedOut`). */
  timeoutMs?: number;
  /** Flow-control credit for stdout+stderr; the node's default (1 MiB) when absent. */
  outputWindow?: number;
  /** This client speaks binary frames; base64 is accepted for completeness but not needed. */
  dataEncoding?: "binary" | "base64";
  /**
   * The channel outlives its connection (docs/protocol.md section 3.1): its command goes on
   * and its output is kept, to attach to again from any node. Defaults: the node's
   * `limits.detachRetainMs` (600,000) and `limits.detachRetainBytes` (8 MiB).
   */
  detach?: {
    retainMs?: number;
    retainBytes?: number;
    /** 1,000..2,592,000,000: hang the command up once no host has been attached this long. */
    hangupAfterMs?: number;
  };
  /** With `detach`: 1..128 of [A-Za-z0-9._-], unique among the lease's detached channels. */
  name?: string;
}

/** Where an attachment resumes each output stream: absolute byte offsets. */
export interface StreamOffsets {
  stdout: number;
  stderr: number;
}

export interface DuplexChannelAttachParams {
  leaseId: string;
  /** Exactly one of handle and name. */
  handle?: string;
  name?: string;
  /** Absent: from the oldest kept byte. */
  offsets?: Partial<StreamOffsets>;
  /** End another host's attachment (it gets outcome `takenOver`) instead of CHANNEL_ATTACHED. */
  takeover?: boolean;
  outputWindow?: number;
  /** A PTY channel's new size. */
  resize?: { cols: number; rows: number };
}

export interface DuplexChannelAttachResult {
  channel: number;
  handle: string;
  name?: string;
  leaseId: string;
  ownerNodeId: string;
  routed: boolean;
  pty: boolean;
  state: "running" | "exited";
  /** Where this attachment starts. */
  offsets: StreamOffsets;
  stdinWindow: number;
  outputWindow: number;
}

/** `duplexChannel.gap`: bytes from the asked offset are no longer kept; data resumes at firstKept. */
export interface ChannelGap {
  channel: number;
  stream: "stdout" | "stderr";
  firstKept: number;
}

export interface DetachedChannelInfo {
  handle: string;
  name: string | null;
  /** The program (command[0]). */
  command: string;
  pty: boolean;
  state: "running" | "exited";
  attached: boolean;
  startedAt: string;
  endedAt: string | null;
  /** Bytes written so far per stream. */
  offsets: StreamOffsets;
  firstKept: StreamOffsets;
  retainBytes: number;
  retainMs: number;
  /** The exit (without `channel`), null while it runs. */
  exit: Omit<ChannelExit, "channel"> | null;
}

export interface DuplexChannelListResult {
  leaseId: string;
  channels: DetachedChannelInfo[];
}

export interface DuplexChannelOpenResult {
  channel: number;
  hostRouteId: string | null;
  workerSessionId: string | null;
  ownerNodeId: string;
  routed: boolean;
  stdinWindow: number;
  outputWindow: number;
  /** A detached channel's durable handle ("dch_" and 24 hex digits). */
  handle?: string;
  name?: string;
}

export type ChannelSignal = "INT" | "TERM" | "HUP" | "QUIT" | "KILL" | "USR1" | "USR2" | "WINCH";

export type ExitOutcome =
  | "exited"
  | "signaled"
  | "timedOut"
  | "stopped"
  | "leaseReleased"
  | "transportClosed"
  | "error"
  /** An attachment to a detached channel that another host took over; the command goes on. */
  | "takenOver";

/** `duplexChannel.exit`: a channel's last message, sent after every output byte (section 3). */
export interface ChannelExit {
  channel: number;
  hostRouteId: string | null;
  /** A number only when a real exit status was observed; never a made-up 0. */
  exitCode: number | null;
  signal: string | null;
  outcome: ExitOutcome;
  stdoutBytes: number | null;
  stderrBytes: number | null;
  stdinBytes: number | null;
  durationMs: number | null;
  limit?: "memory";
  /** With outcome `error`: why (section 8), e.g. reason `FLOW_CONTROL`. */
  error?: { code: number; message: string; data?: { reason?: string; [key: string]: unknown } };
}

/** The `reason` of every error that a sandboxd node answers (docs/protocol.md section 5). */
export type ServerReason =
  | "INVALID_PARAMS"
  | "INVALID_REQUEST"
  | "METHOD_NOT_FOUND"
  | "PARSE_ERROR"
  | "INTERNAL_ERROR"
  | "LEASE_INCOMPLETE"
  | "SANDBOX_NOT_CACHED"
  | "LEASE_NOT_FOUND"
  | "LEASE_NOT_ACTIVE"
  | "OWNER_UNAVAILABLE"
  | "OWNER_ELSEWHERE"
  | "CHANNEL_LIMIT"
  | "PROVIDER_ERROR"
  | "PROVIDER_NOT_READY"
  | "CHANNEL_NOT_FOUND"
  | "FLOW_CONTROL"
  | "REGISTRY_UNAVAILABLE"
  | "ROUTING_LOOP"
  | "FORBIDDEN"
  | "CHANNEL_ATTACHED";

/**
 * Reasons that the client itself gives (code 0, never on the wire):
 * - `TRANSPORT_CLOSED`: the connection closed or could not be opened before the answer came;
 *   for an open, its fate is unknown and it is not retried;
 * - `TIMEOUT`: no answer within the request timeout (or no connection within the connect timeout);
 * - `ABORTED`: the caller's AbortSignal fired;
 * - `UNAUTHORIZED`: the node refused the token (HTTP 401) or the upgrade (another HTTP status);
 * - `PROTOCOL_ERROR`: the node sent something this client cannot read.
 */
export type ClientReason = "TRANSPORT_CLOSED" | "TIMEOUT" | "ABORTED" | "UNAUTHORIZED" | "PROTOCOL_ERROR";

export type Reason = ServerReason | ClientReason;

/** The JSON-RPC codes of section 5, by reason. */
export const ERROR_CODES: Readonly<Record<ServerReason, number>> = {
  PARSE_ERROR: -32700,
  INVALID_REQUEST: -32600,
  METHOD_NOT_FOUND: -32601,
  INVALID_PARAMS: -32602,
  INTERNAL_ERROR: -32603,
  LEASE_INCOMPLETE: -32010,
  SANDBOX_NOT_CACHED: -32011,
  LEASE_NOT_FOUND: -32012,
  LEASE_NOT_ACTIVE: -32013,
  OWNER_UNAVAILABLE: -32014,
  OWNER_ELSEWHERE: -32015,
  CHANNEL_LIMIT: -32016,
  PROVIDER_ERROR: -32017,
  PROVIDER_NOT_READY: -32018,
  CHANNEL_NOT_FOUND: -32019,
  FLOW_CONTROL: -32020,
  REGISTRY_UNAVAILABLE: -32021,
  ROUTING_LOOP: -32022,
  FORBIDDEN: -32023,
  CHANNEL_ATTACHED: -32024,
};
