// sandboxd's browser console: one PTY channel in a lease's sandbox (docs/protocol.md, the
// console in section 8). The token travels as the WebSocket subprotocol
// `sandboxd.bearer.<base64url>` because a browser cannot set Authorization on a WebSocket.
//
// The channel is detached (section 3.1): a reload of the page, or a dropped connection and a
// reload, attaches to it again and replays its kept output (the last MiB), so the terminal
// comes back as it was. What it needs for that (lease, handle, token) is in this tab's
// sessionStorage until the channel ends (gone with the tab); the daemon hangs the command up
// once no page has been attached to it for `hangupAfterMs`.
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

  // The session a reload attaches to again: {token, leaseId, command, handle}.
  const sessionKey = "sandboxd.console.session";
  const keptBytes = 1 << 20;
  const hangupAfterMs = 300000;
  function remember(session) {
    try {
      sessionStorage.setItem(sessionKey, JSON.stringify(session));
    } catch (e) {
      /* storage disabled: a reload then starts afresh */
    }
  }
  function forget() {
    try {
      sessionStorage.removeItem(sessionKey);
    } catch (e) {
      /* storage disabled */
    }
  }
  function remembered() {
    try {
      const s = JSON.parse(sessionStorage.getItem(sessionKey) || "null");
      return s && typeof s.handle === "string" && typeof s.leaseId === "string" ? s : null;
    } catch (e) {
      return null;
    }
  }

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
    } else if (msg.method === "duplexChannel.gap" && msg.params.channel === state.channel) {
      term.write("\x1b[2m[earlier output is no longer kept]\x1b[0m\r\n");
    } else if (msg.method === "duplexChannel.exit" && msg.params.channel === state.channel) {
      const e = msg.params;
      state.exit = e;
      forget();
      const how = e.outcome === "exited" ? `exit ${e.exitCode}` : e.signal ? `${e.outcome}, signal ${e.signal}` : e.outcome;
      term.write(`\r\n\x1b[2m[channel ended: ${how}]\x1b[0m\r\n`);
      status(`Channel ended: ${how}.`, e.outcome === "exited" && e.exitCode === 0 ? "ok" : "error");
      state.ws.close(1000);
    }
  }

  /** Opens `command` in lease `leaseId`, or with `handle`, attaches to that channel again. */
  async function open(token, leaseId, command, handle) {
    if (state.ws) {
      // A new terminal replaces the one shown: its command ends now, not at hangupAfterMs.
      if (state.channel !== null && !state.exit && state.ws.readyState === WebSocket.OPEN) {
        call("duplexChannelStop", { channel: state.channel }).catch(() => {});
      }
      forget();
      state.ws.close(1000);
    }
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
        const again = remembered() ? " The command goes on: reload the page to attach again." : "";
        status(`Connection closed (code ${ev.code}${ev.reason ? ": " + ev.reason : ""}).${again}`, "error");
        term.write("\r\n\x1b[2m[connection closed]\x1b[0m\r\n");
      }
    };
    ws.onopen = async () => {
      opened = true;
      try {
        const info = await call("initialize", { protocolVersion: 1, client: { name: "sandboxd-console", version: "1" } });
        let result;
        if (handle) {
          // This tab's page before the reload may still count as attached: take it over. All
          // the kept output comes again, from offset 0, to draw the screen as it was.
          result = await call("duplexChannelAttach", {
            leaseId,
            handle,
            offsets: { stdout: 0, stderr: 0 },
            takeover: true,
            resize: { cols: term.cols, rows: term.rows },
          });
        } else {
          const lease = await call("leaseGet", { leaseId });
          result = await call("duplexChannelOpen", {
            lease,
            command,
            pty: { cols: term.cols, rows: term.rows },
            env: { TERM: "xterm-256color" },
            detach: { retainBytes: keptBytes, hangupAfterMs },
          });
        }
        state.channel = result.channel;
        state.stdinWindow = result.stdinWindow || info.limits.stdinWindow;
        remember({ token, leaseId, command, handle: result.handle });
        const what = `${command.join(" ")} in lease ${leaseId}`;
        status(handle ? `Attached again to ${result.ownerNodeId}: ${what}.` : `Connected to ${result.ownerNodeId}: ${what}.`, "ok");
        term.focus();
        pumpStdin();
      } catch (e) {
        const reason = e && e.data && e.data.reason ? `${e.data.reason}: ` : "";
        if (handle) {
          forget();  // ended and forgotten, or no longer this token's: a new terminal is needed
          status(`Cannot attach to the terminal again: ${reason}${(e && e.message) || e}`, "error");
        } else {
          status(`${reason}${(e && e.message) || e}`, "error");
        }
        ws.close(1000);
      }
    };
  }

  $("connect").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const command = $("command").value.trim().split(/\s+/).filter(Boolean);
    open($("token").value, $("lease").value.trim(), command.length ? command : ["sh"]);
  });

  // A reload (or a page that came back) attaches to its terminal again.
  const session = remembered();
  if (session) {
    $("token").value = session.token;
    $("lease").value = session.leaseId;
    $("command").value = (session.command || []).join(" ");
    open(session.token, session.leaseId, session.command || [], session.handle);
  }
})();
