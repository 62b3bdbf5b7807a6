import type { Reason } from "./protocol.js";

/**
 * Every error this client raises: a node's JSON-RPC error (its `code`, `data.reason` and `data`,
 * docs/protocol.md section 5) or one the client makes itself (code 0; see ClientReason).
 */
export class SandboxdError extends Error {
  /** The JSON-RPC error code, e.g. -32013; 0 for an error that the client made. */
  readonly code: number;
  /** The stable, machine-read part, e.g. "LEASE_NOT_ACTIVE" or "TRANSPORT_CLOSED". */
  readonly reason: Reason;
  /** The error's `data` as the node sent it (`reason` included); `{reason}` for the client's own. */
  readonly data: Record<string, unknown>;

  constructor(code: number, reason: Reason, message: string, data?: Record<string, unknown>) {
    super(message);
    this.name = "SandboxdError";
    this.code = code;
    this.reason = reason;
    this.data = data ?? { reason };
  }

  /** An error that the client made (code 0). */
  static client(reason: Reason, message: string, extra?: Record<string, unknown>): SandboxdError {
    return new SandboxdError(0, reason, message, { reason, ...extra });
  }

  /** From a JSON-RPC error object; a malformed one becomes PROTOCOL_ERROR. */
  static fromWire(error: unknown): SandboxdError {
    if (typeof error !== "object" || error === null) {
      return SandboxdError.client("PROTOCOL_ERROR", "the node sent an error that is not an object");
    }
    const e = error as { code?: unknown; message?: unknown; data?: unknown };
    const data = typeof e.data === "object" && e.data !== null ? (e.data as Record<string, unknown>) : {};
    const code = typeof e.code === "number" ? e.code : 0;
    const reason = typeof data.reason === "string" ? (data.reason as Reason) : "PROTOCOL_ERROR";
    const message = typeof e.message === "string" ? e.message : `error ${code}`;
    return new SandboxdError(code, reason, message, { ...data, reason });
  }
}
