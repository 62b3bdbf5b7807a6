// sandboxd's browser console: one PTY channel in a lease's sandbox (docs/protocol.md, the
// console in section 8). The token travels as the WebSocket subprotocol
// `sandboxd.bearer.<base64url>` because a browser cannot set Authorization on a WebSocket.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const status = (text, kind) => {
    const s = $("status");
    s.textContent = text;
    s.className = kind || "";
  };
  const encoder = new TextEncoder();

  const term = new Terminal({ cursorBlink: true, convertEol: false, scrollback: 5000,
    fontFamily: "DejaVu Sans Mono, Menlo, Consolas, monospace", fontSize: 14 });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open($("terminal"));
  fit.fit();

  const state = { ws: null, channel: null, exit: null, stdinWindow: 0, stdinInFlight: 0, queue: [], nextId: 1, pending: new Map() };
  window.sandboxdConsole = {
    term,
    state,
    /** The terminal's screen (the active buffer's lines), for tests and copy. */
    screenText() {
      const b = term.buffer.active;
      const lines = [];
      for (let y = 0; y < b.length; y++) lines.push(b.getLine(y).translateToString(true));
      return lines.join("\n");
    },
  };

  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("lease")) $("lease").value = hash.get("lease");

  function base64url(text) {
    let bin = "";
    for (const b of encoder.encode(text)) bin += String.fromCharCode(b);
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function frame(kind, channel, stream, body) {
    const out = new Uint8Array(6 + body.length);
    const view = new DataView(out.buffer);
    out[0] = kind;
    view.setUint32(1, channel);
    out[5] = stream;
    out.set(body, 6);
    return out;
  }

  function credit(channel, stream, bytes) {
    const body = new Uint8Array(4);
    new DataView(body.buffer).setUint32(0, bytes);
    state.ws.send(frame(2, channel, stream, body));
  }

  function call(method, params) {
    const id = state.nextId++;
    state.ws.send(JSON.stringify({ jsonrpc: "2.0", id, method, params }));
    return new Promise((resolve, reject) => state.pending.set(id, { resolve, reject }));
  }

  // Stdin within the window the daemon gave (the rest waits for its credit).
  function pumpStdin() {
    while (state.queue.length && state.channel !== null && !state.exit) {
      const room = state.stdinWindow - state.stdinInFlight;
      if (room <= 0) return;
      const head = state.queue[0];
      const n = Math.min(room, head.length, 65536);
      state.ws.send(frame(1, state.channel, 0, head.subarray(0, n)));
      state.stdinInFlight += n;
      if (n === head.length) state.queue.shift();
      else state.queue[0] = head.subarray(n);
    }
  }

  function send(bytes) {
    if (state.channel === null || state.exit) return;
    state.queue.push(bytes);
    pumpStdin();
  }

  term.onData((data) => send(encoder.encode(data)));
  term.onBinary((data) => send(Uint8Array.from(data, (c) => c.charCodeAt(0) & 0xff)));
  term.onResize(({ cols, rows }) => {
    if (state.channel !== null && !state.exit) {
      call("duplexChannelResize", { channel: state.channel, cols, rows }).catch(() => {});
    }
  });
  window.addEventListener("resize", () => fit.fit());

  function onBinary(buf) {
    const bytes = new Uint8Array(buf);
    if (bytes.length < 6) return;
    const view = new DataView(buf);
    const kind = bytes[0], channel = view.getUint32(1), stream = bytes[5];
    if (channel !== state.channel) return;
    if (kind === 1 && (stream === 1 || stream === 2)) {
      const payload = bytes.subarray(6);
      // Credit goes back once the terminal has taken the bytes: a flood cannot outrun it.
      term.write(payload, () => credit(channel, 1, payload.length));
    } else if (kind === 2 && stream === 0 && bytes.length === 10) {
      state.stdinInFlight = Math.max(0, state.stdinInFlight - view.getUint32(6));
      pumpStdin();
    }
  }

  function onText(text) {
    const msg = JSON.parse(text);
    if (typeof msg.id === "number" && state.pending.has(msg.id)) {
      const p = state.pending.get(msg.id);
      state.pending.delete(msg.id);
      if (msg.error) p.reject(msg.error);
      else p.resolve(msg.result);
    } else if (msg.method === "duplexChannel.exit" && msg.params.channel === state.channel) {
      const e = msg.params;
      state.exit = e;
      const how = e.outcome === "exited" ? `exit ${e.exitCode}` : e.signal ? `${e.outcome}, signal ${e.signal}` : e.outcome;
      term.write(`\r\n\x1b[2m[channel ended: ${how}]\x1b[0m\r\n`);
      status(`Channel ended: ${how}.`, e.outcome === "exited" && e.exitCode === 0 ? "ok" : "error");
      state.ws.close(1000);
    }
  }

  async function open(token, leaseId, command) {
    if (state.ws) state.ws.close(1000);
    Object.assign(state, { channel: null, exit: null, stdinInFlight: 0, queue: [], pending: new Map() });
    status("Connecting...");
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(`${scheme}//${location.host}/v1/ws`, ["sandboxd.v1", "sandboxd.bearer." + base64url(token)]);
    ws.binaryType = "arraybuffer";
    state.ws = ws;
    let opened = false;
    ws.onmessage = (ev) => (typeof ev.data === "string" ? onText(ev.data) : onBinary(ev.data));
    ws.onclose = (ev) => {
      for (const p of state.pending.values()) p.reject({ message: "the connection closed", data: { reason: "TRANSPORT_CLOSED" } });
      state.pending.clear();
      if (ws !== state.ws) return;
      if (!opened) {
        status("The node refused the connection: check the token (or the node is not ready).", "error");
      } else if (!state.exit) {
        status(`Connection closed (code ${ev.code}${ev.reason ? ": " + ev.reason : ""}).`, "error");
        term.write("\r\n\x1b[2m[connection closed]\x1b[0m\r\n");
      }
    };
    ws.onopen = async () => {
      opened = true;
      try {
        const info = await call("initialize", { protocolVersion: 1, client: { name: "sandboxd-console", version: "1" } });
        const lease = await call("leaseGet", { leaseId });
        const result = await call("duplexChannelOpen", {
          lease,
          command,
          pty: { cols: term.cols, rows: term.rows },
          env: { TERM: "xterm-256color" },
        });
        state.channel = result.channel;
        state.stdinWindow = result.stdinWindow || info.limits.stdinWindow;
        status(`Connected to ${result.ownerNodeId}: ${command.join(" ")} in lease ${leaseId}.`, "ok");
        term.focus();
        pumpStdin();
      } catch (e) {
        const reason = e && e.data && e.data.reason ? `${e.data.reason}: ` : "";
        status(`${reason}${(e && e.message) || e}`, "error");
        ws.close(1000);
      }
    };
  }

  $("connect").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const command = $("command").value.trim().split(/\s+/).filter(Boolean);
    open($("token").value, $("lease").value.trim(), command.length ? command : ["sh"]);
  });
})();
