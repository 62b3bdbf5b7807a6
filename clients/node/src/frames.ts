// Binary data frames (docs/protocol.md section 4):
//   byte 0      kind: 0x01 data, 0x02 credit
//   bytes 1-4   channel, u32 big-endian
//   byte 5      stream: 0 stdin, 1 stdout, 2 stderr
//   data:   bytes 6.. payload, 1..262144 bytes
//   credit: bytes 6-9 u32 big-endian byte count

export const FRAME_DATA = 0x01;
export const FRAME_CREDIT = 0x02;
export const STREAM_STDIN = 0;
export const STREAM_STDOUT = 1;
export const STREAM_STDERR = 2;
/** The protocol's largest data payload. */
export const MAX_DATA_PAYLOAD = 262144;
const HEADER = 6;

export type Frame =
  | { kind: typeof FRAME_DATA; channel: number; stream: number; payload: Buffer }
  | { kind: typeof FRAME_CREDIT; channel: number; stream: number; credit: number };

/** The header of a data frame; the payload follows it on the wire (sent as one message). */
export function dataFrame(channel: number, stream: number, payload: Uint8Array): Buffer {
  const frame = Buffer.allocUnsafe(HEADER + payload.byteLength);
  frame[0] = FRAME_DATA;
  frame.writeUInt32BE(channel, 1);
  frame[5] = stream;
  frame.set(payload, HEADER);
  return frame;
}

export function creditFrame(channel: number, stream: number, bytes: number): Buffer {
  const frame = Buffer.allocUnsafe(HEADER + 4);
  frame[0] = FRAME_CREDIT;
  frame.writeUInt32BE(channel, 1);
  frame[5] = stream;
  frame.writeUInt32BE(bytes, HEADER);
  return frame;
}

/** Decodes one binary message; a malformed one is an Error that says why. */
export function decodeFrame(message: Buffer): Frame {
  if (message.length < HEADER) throw new Error(`binary frame of ${message.length} bytes is shorter than its header`);
  const kind = message[0];
  const channel = message.readUInt32BE(1);
  const stream = message[5] as number;
  if (stream > STREAM_STDERR) throw new Error(`binary frame names stream ${stream}`);
  if (kind === FRAME_DATA) {
    const size = message.length - HEADER;
    if (size < 1 || size > MAX_DATA_PAYLOAD) throw new Error(`data frame payload of ${size} bytes`);
    return { kind: FRAME_DATA, channel, stream, payload: message.subarray(HEADER) };
  }
  if (kind === FRAME_CREDIT) {
    if (message.length !== HEADER + 4) throw new Error(`credit frame of ${message.length} bytes`);
    return { kind: FRAME_CREDIT, channel, stream, credit: message.readUInt32BE(HEADER) };
  }
  throw new Error(`binary frame of kind ${kind}`);
}
