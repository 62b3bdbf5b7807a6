// The browser console (GET /console) in headless Chromium: a real page, xterm.js from the
// build tree, the token as a subprotocol, a PTY channel in a real sandbox.
import assert from "node:assert/strict";
import { mkdirSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { after, before, describe, it } from "node:test";
import WebSocket from "ws";

import type { Lease, SandboxdClient } from "../src/index.js";
import { Browser, chromiumPath, pngColours } from "./chromium.js";
import { repoRoot } from "./daemon.js";
import { bwrapLease, clientFor, Daemon, eventually } from "./helpers.js";

const screenshotPath = process.env.SANDBOXD_CONSOLE_SCREENSHOT ?? join(repoRoot, "clients/node/build-test/console.png");

function b64url(text: string): string {
  return Buffer.from(text).toString("base64url");
}

/** Whether an upgrade with these headers is accepted (101), or the HTTP status it got. */
async function upgradeStatus(url: string, protocols: string[], origin?: string): Promise<number> {
  return new Promise((resolve) => {
    const ws = new WebSocket(url, protocols, origin ? { origin } : {});
    ws.once("open", () => {
      ws.close();
      resolve(101);
    });
    ws.once("unexpected-response", (_req, res) => {
      resolve(res.statusCode ?? 0);
      ws.terminate();
    });
    ws.once("error", () => resolve(0));
  });
}

describe("console", { skip: chromiumPath() ? false : "no chromium (scripts/bootstrap installs it)" }, () => {
  let daemon: Daemon;
  let client: SandboxdClient;
  let lease: Lease;
  let browser: Browser;
  let page: string;

  before(async () => {
    daemon = await Daemon.start({ config: { console: { enabled: true } } });
    client = await clientFor(daemon);
    lease = await bwrapLease(client);
    browser = await Browser.launch();
    page = await browser.newPage();
  });

  after(async () => {
    await browser?.close();
    client?.close();
    await daemon?.dispose();
  });

  const screen = () => browser.evaluate(page, "window.sandboxdConsole.screenText()") as Promise<string>;
  const statusText = () => browser.evaluate(page, "document.getElementById('status').textContent") as Promise<string>;
  const type = async (text: string) => {
    await browser.send("Input.insertText", { text }, page);
    for (const type of ["keyDown", "keyUp"]) {
      await browser.send("Input.dispatchKeyEvent", { type, key: "Enter", code: "Enter", windowsVirtualKeyCode: 13, ...(type === "keyDown" ? { text: "\r" } : {}) }, page);
    }
  };
  /** Waits until the terminal's lines satisfy `check`; a timeout shows the screen. */
  const waitForScreen = async (check: (lines: string[]) => boolean, what: string) => {
    await eventually(async () => check((await screen()).split("\n").map((l) => l.trim())), 15_000, what).catch(
      async (e) => {
        throw new Error(`${(e as Error).message}; the terminal shows:\n${await screen()}`);
      },
    );
  };
  const waitForLine = (line: string, what: string) => waitForScreen((lines) => lines.includes(line), what);
  // The shell waits for input: the screen's last line is its bare prompt. A line typed before
  // that is echoed ahead of the prompt, and its output comes out after it ("# 42"): on a loaded
  // machine the shell can start after the first line is typed.
  const waitForPrompt = (what: string) =>
    waitForScreen((lines) => /^[#$]$/.test(lines.filter((l) => l !== "").at(-1) ?? ""), `the shell's prompt ${what}`);
  const submit = (token: string) =>
    browser.evaluate(page, `document.getElementById('token').value = ${JSON.stringify(token)}; document.getElementById('open').click(); true`);

  it("is served with a CSP of its own origin only, and only when enabled", async () => {
    const res = await fetch(`http://${daemon.address}/console`);
    assert.equal(res.status, 200);
    const csp = res.headers.get("content-security-policy") ?? "";
    assert.match(csp, /default-src 'none'/);
    assert.match(csp, /script-src 'self';/);
    assert.match(csp, /connect-src 'self';/);
    assert.doesNotMatch(csp, /https?:|\*/);
    assert.equal((await fetch(`http://${daemon.address}/console/xterm.js`)).status, 200);
    assert.equal((await fetch(`http://${daemon.address}/console/../admin.token`)).status, 404);
    const plain = await Daemon.start();
    try {
      assert.equal((await fetch(`http://${plain.address}/console`)).status, 404);
    } finally {
      await plain.dispose();
    }
    // Enabled without its files: the node starts, says why, and /console is 503.
    const bare = await Daemon.start({ config: { console: { enabled: true, assetsDir: "/nonexistent-console" } } });
    try {
      const res503 = await fetch(`http://${bare.address}/console`);
      assert.equal(res503.status, 503);
      assert.match(await res503.text(), /nonexistent-console\/index.html/);
      assert.match(bare.log, /console: enabled but not available/);
    } finally {
      await bare.dispose();
    }
  });

  it("takes the token as a subprotocol only from its own origin", async () => {
    const protocols = ["sandboxd.v1", `sandboxd.bearer.${b64url(daemon.token)}`];
    assert.equal(await upgradeStatus(daemon.url, protocols, `http://${daemon.address}`), 101);
    assert.equal(await upgradeStatus(daemon.url, protocols, "http://evil.example"), 403);
    assert.equal(await upgradeStatus(daemon.url, protocols), 403);
    assert.equal(await upgradeStatus(daemon.url, ["sandboxd.v1", `sandboxd.bearer.${b64url("wrong")}`], `http://${daemon.address}`), 401);
  });

  it("says so when the token is refused", async () => {
    await browser.navigate(page, `http://${daemon.address}/console#lease=${lease.id}`);
    await submit("not-the-token");
    await eventually(async () => /refused/.test(await statusText()), 10_000, "the refusal on the page");
  });

  it("is a working terminal: typing, colours, Ctrl-C, resize, screenshot, end", async () => {
    // A new document (the query differs): a fragment-only change would not load the page again.
    await browser.navigate(page, `http://${daemon.address}/console?again#lease=${lease.id}`);
    await submit(daemon.token);
    await eventually(async () => /^Connected/.test(await statusText()), 15_000, "the channel to open");

    await waitForPrompt("at the start");
    await type("echo $((6*7))");
    await waitForLine("42", "42 on the terminal");

    await waitForPrompt("after 42");
    await type("printf '\\033[31mRED\\033[0m plain\\n'");
    await waitForLine("RED plain", "the coloured line");
    const red = await browser.evaluate(page, `(() => {
      const b = window.sandboxdConsole.term.buffer.active;
      for (let y = 0; y < b.length; y++) {
        const line = b.getLine(y);
        if (line.translateToString(true) === "RED plain") {
          const c = line.getCell(0), p = line.getCell(4);
          return { red: c.isFgPalette() && c.getFgColor() === 1, plain: p.isFgDefault() };
        }
      }
      return null;
    })()`);
    assert.deepEqual(red, { red: true, plain: true });

    // Ctrl-C interrupts the foreground command: the shell answers again. The command says when
    // it runs (a line its own text does not hold): a Ctrl-C before that would reach the shell,
    // not the command (the window is wide on a loaded machine).
    await waitForPrompt("after the coloured line");
    await type("sh -c 'echo sleeping-$((3*3)); exec sleep 100'");
    await waitForLine("sleeping-9", "the foreground command to run");
    await browser.send("Input.dispatchKeyEvent", { type: "keyDown", key: "c", code: "KeyC", windowsVirtualKeyCode: 67, modifiers: 2 }, page);
    await browser.send("Input.dispatchKeyEvent", { type: "keyUp", key: "c", code: "KeyC", windowsVirtualKeyCode: 67, modifiers: 2 }, page);
    await waitForPrompt("after Ctrl-C");
    await type("echo after-$((1+1))");
    await waitForLine("after-2", "the shell after Ctrl-C");

    // A smaller window: the terminal fits it, and the command in the sandbox sees the size.
    const before = await browser.evaluate(page, "[window.sandboxdConsole.term.cols, window.sandboxdConsole.term.rows]");
    await browser.send("Emulation.setDeviceMetricsOverride", { width: 640, height: 360, deviceScaleFactor: 1, mobile: false }, page);
    await eventually(
      async () => JSON.stringify(await browser.evaluate(page, "[window.sandboxdConsole.term.cols, window.sandboxdConsole.term.rows]")) !== JSON.stringify(before),
      10_000,
      "the terminal to fit the new window",
    );
    const [cols, rows] = (await browser.evaluate(page, "[window.sandboxdConsole.term.cols, window.sandboxdConsole.term.rows]")) as [number, number];
    await waitForPrompt("before stty size");
    await type("stty size");
    await waitForLine(`${rows} ${cols}`, `stty size = ${rows} ${cols}`);

    const shot = await browser.send("Page.captureScreenshot", { format: "png" }, page);
    const png = Buffer.from(shot.data as string, "base64");
    mkdirSync(dirname(screenshotPath), { recursive: true });
    writeFileSync(screenshotPath, png);
    const { width, height, colours } = pngColours(png);
    console.log(`screenshot ${screenshotPath}: ${width}x${height}, ${colours} colours`);
    assert.equal(width, 640);
    assert.ok(colours >= 8, `the screenshot has ${colours} colours: blank`);

    await waitForPrompt("before exit");
    await type("exit 0");
    await eventually(async () => /Channel ended: exit 0/.test(await statusText()), 10_000, "the end of the channel on the page");
    assert.match(await screen(), /\[channel ended: exit 0\]/);
  });

  it("attaches to its terminal again after the page went away: the command went on, the screen comes back", async () => {
    const sessionStored = () => browser.evaluate(page, "sessionStorage.getItem('sandboxd.console.session')") as Promise<string | null>;
    await browser.navigate(page, `http://${daemon.address}/console?reattach#lease=${lease.id}`);
    await submit(daemon.token);
    await eventually(async () => /^Connected/.test(await statusText()), 15_000, "the channel to open");
    const stored = JSON.parse((await sessionStored()) ?? "null");
    assert.equal(stored?.leaseId, lease.id);
    assert.match(stored?.handle ?? "", /^dch_[0-9a-f]{24}$/);
    const mine = async () => (await client.listChannels({ leaseId: lease.id })).channels.find((c) => c.handle === stored.handle);
    assert.equal((await mine())?.retainBytes, 1 << 20);

    // The shell starts a command that writes once a file appears (made below, from outside).
    await waitForPrompt("at the start");
    await type("echo before-$((2*3)); while [ ! -e /tmp/console-go ]; do sleep 0.05; done; echo while-away-$((4*4))");
    await waitForLine("before-6", "the first line");

    // The page goes away: the channel is detached, and the command goes on without it.
    await browser.navigate(page, "about:blank");
    await eventually(async () => (await mine())?.attached === false, 10_000, "the channel to be let go");
    const written = (await mine())!.offsets.stdout;
    const touched = await client.leaseExecute({ leaseId: lease.id, command: "touch", args: ["/tmp/console-go"] });
    assert.equal(touched.exitCode, 0);
    await eventually(async () => (await mine())!.offsets.stdout > written, 10_000, "the line written while away");
    assert.equal((await mine())?.state, "running");

    // Back on the page: it attaches again by itself, and the terminal shows what came before and
    // while it was away.
    await browser.navigate(page, `http://${daemon.address}/console?reattach#lease=${lease.id}`);
    await eventually(async () => /^Attached again/.test(await statusText()), 15_000, "the page to attach again");
    await waitForLine("before-6", "the replayed first line");
    await waitForLine("while-away-16", "the line written while away");
    assert.equal((await mine())?.attached, true);
    await waitForPrompt("after attaching again");
    await type("echo back-$((5*5))");
    await waitForLine("back-25", "the shell answering after the reattach");

    // Its end clears the session: the next load starts afresh.
    await type("exit 0");
    await eventually(async () => /Channel ended: exit 0/.test(await statusText()), 10_000, "the end of the channel");
    assert.equal(await sessionStored(), null);
    await browser.navigate(page, `http://${daemon.address}/console?afresh#lease=${lease.id}`);
    assert.equal(await statusText(), "Not connected.");
  });
});
