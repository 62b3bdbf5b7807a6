#!/usr/bin/env python3
"""Self-test of the sdk-local plugin without sandboxd: plays the host over the worker's stdio.

Usage: python3 selftest.py [--node PATH] [--keep] [-v]
  --node PATH  the Node binary (default: node on $PATH)
  --keep       keep the temporary SDK_LOCAL_ROOT
  -v           print every line exchanged ('>' host->worker, '<' worker->host)
Exit status 0 when every check passed, 1 otherwise. Python 3 standard library only.
"""
import argparse, base64, json, os, random, select, shutil, subprocess, sys, tempfile, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.js")
DRIVER = "sdk-local"  # the driverKey of manifest.json
with open(os.path.join(HERE, "manifest.json")) as _f:
    MANIFEST = json.load(_f)  # sent in initialize; also checked against the SDK's manifest schema
INSTANCE_CONFIG = {"served": "by the selftest"}  # what config.get answers
SCOPE = {"driverKey": DRIVER, "companyId": "acme", "environmentId": "env-1"}
CHANNEL_METHODS = ["duplexChannelOpen", "duplexChannelWrite", "duplexChannelStop", "duplexChannelClose"]
LEASE_METHODS = ["environmentAcquireLease", "environmentResumeLease", "environmentReleaseLease",
                 "environmentDestroyLease"]

args = None


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def b64(data):
    return base64.b64encode(data).decode()


class Worker:
    """One worker process and the host side of its JSON-RPC stream."""

    def __init__(self, root, hooks=True):
        env = dict(os.environ, SDK_LOCAL_ROOT=root, SDK_LOCAL_STOP_GRACE_MS="300")
        env.pop("SDK_LOCAL_TEST_HOOKS", None)
        if hooks:
            env["SDK_LOCAL_TEST_HOOKS"] = "1"
        self.p = subprocess.Popen([args.node, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env)
        self.buf, self.next_id = b"", 1
        self.trace = []     # every frame from the worker, in order, except answered config.get requests
        self.pending = []   # notifications and answers not consumed yet
        self.logs = []
        self.stderr = []
        threading.Thread(target=lambda: self.stderr.extend(self.p.stderr), daemon=True).start()

    def send(self, obj):
        line = json.dumps(obj, separators=(",", ":"))
        if args.verbose:
            print("> " + (line if len(line) < 400 else line[:400] + "..."))
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()

    def _read_frame(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return None
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if not r:
                return None
            chunk = os.read(self.p.stdout.fileno(), 1 << 20)
            if not chunk:
                raise Failure("worker closed its stdout; stderr: %r" % b"".join(self.stderr).decode())
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        if args.verbose:
            text = line.decode()
            print("< " + (text if len(text) < 400 else text[:400] + "..."))
        try:
            m = json.loads(line)
        except ValueError:
            raise Failure("worker wrote a line that is not JSON: %r" % line[:200])
        check(m.get("jsonrpc") == "2.0", "frame without jsonrpc 2.0: %r" % m)
        return m

    def _pump(self, deadline):
        """Read one frame; serve worker->host requests; returns False on timeout."""
        m = self._read_frame(deadline)
        if m is None:
            return False
        if "method" in m and m.get("id") is not None:  # a worker->host request
            if m["method"] == "config.get":
                self.send({"jsonrpc": "2.0", "id": m["id"], "result": INSTANCE_CONFIG})
            else:
                self.send({"jsonrpc": "2.0", "id": m["id"],
                           "error": {"code": -32601, "message": "not served by the selftest"}})
            return True
        if m.get("method") == "log":
            self.logs.append(m["params"])
            return True
        self.trace.append(m)
        self.pending.append(m)
        return True

    def take(self, pred, timeout=10.0, what="frame"):
        """The first pending or coming frame that matches pred (removed from pending)."""
        deadline = time.time() + timeout
        while True:
            for i, m in enumerate(self.pending):
                if pred(m):
                    return self.pending.pop(i)
            if not self._pump(deadline):
                raise Failure("timed out waiting for " + what)

    def request(self, method, params):
        rid = self.next_id
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        return rid

    def answer(self, rid, timeout=10.0):
        return self.take(lambda m: m.get("id") == rid and "method" not in m, timeout, "answer %d" % rid)

    def call(self, method, params, timeout=10.0):
        return self.answer(self.request(method, params), timeout)

    def ok(self, method, params, timeout=10.0):
        m = self.call(method, params, timeout)
        check("result" in m, "%s failed: %r" % (method, m.get("error")))
        return m["result"]

    def err(self, method, params, contains, code=None):
        m = self.call(method, params)
        check("error" in m, "%s should have failed (%s), got %r" % (method, contains, m.get("result")))
        check(contains in m["error"]["message"], "%s error %r lacks %r" % (method, m["error"]["message"], contains))
        if code is not None:
            check(m["error"]["code"] == code, "%s error code %r, wanted %r" % (method, m["error"]["code"], code))
        return m["error"]

    def channel_frames(self, route, until_exit=True, timeout=10.0, max_bytes=None):
        """Data of a route, and its exit code (when until_exit)."""
        data, deadline = b"", time.time() + timeout
        while True:
            if not until_exit and max_bytes is not None and len(data) >= max_bytes:
                return data, None
            m = self.take(lambda m: m.get("method", "").startswith("duplexChannel.")
                          and m["params"]["hostRouteId"] == route, max(0.01, deadline - time.time()),
                          "frames of " + route)
            if m["method"] == "duplexChannel.data":
                data += base64.b64decode(m["params"]["chunk"], validate=True)
            else:
                check(m["params"].get("transportClosed") is False, "transportClosed should be false: %r" % m)
                return data, m["params"]["exitCode"]

    def quiet(self, seconds, pred):
        """Checks that no frame matching pred arrives for a while."""
        try:
            m = self.take(pred, seconds)
        except Failure:
            return
        raise Failure("unexpected frame %r" % m)

    def initialize(self):
        r = self.ok("initialize", {"manifest": MANIFEST, "config": INSTANCE_CONFIG,
                                   "instanceInfo": {"instanceId": "selftest", "hostVersion": "0.0.0"},
                                   "apiVersion": 1}, timeout=30)
        check(r.get("ok") is True, "initialize result %r" % r)
        missing = set(LEASE_METHODS + CHANNEL_METHODS + ["health", "shutdown"]) - set(r.get("supportedMethods", []))
        check(not missing, "supportedMethods lacks %s" % sorted(missing))

    def shutdown(self):
        check(self.ok("shutdown", {}) is None, "shutdown should answer null")
        rc = self.p.wait(10)
        check(rc == 0, "worker exit status %r after shutdown" % rc)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def lease_dirs(root):
    return sorted(d for d in os.listdir(root) if d.startswith("sdk-"))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def journal(root):
    with open(os.path.join(root, "journal.jsonl")) as f:
        return [json.loads(line) for line in f]


def acquire(w, config, **extra):
    params = {**SCOPE, "issueId": None, "runId": "run-%d" % random.randrange(1 << 30), "config": config, **extra}
    return params, w.ok("environmentAcquireLease", params)


def teardown_params(lease, **over):
    return {**SCOPE, "issueId": None, "config": {}, "providerLeaseId": lease["providerLeaseId"],
            "leaseMetadata": lease["metadata"], **over}


def open_params(lease, route, command):
    return {"hostRouteId": route, **SCOPE, "providerLeaseId": lease["providerLeaseId"], "command": command}


# ---- the checks ------------------------------------------------------------------------------

def test_acquire(w, root, state):
    params, lease = acquire(w, {"expiresInMs": 60000, "custom": [1, "two"]}, agentId="agent-1",
                            executionWorkspaceId=None, requestedExpiresAt="2099-01-01T00:00:00.000Z")
    check(lease["providerLeaseId"].startswith("sdk-") and len(lease["providerLeaseId"]) == 20, "lease id %r" % lease)
    d = os.path.join(root, lease["providerLeaseId"])
    check(lease["metadata"] == {"dir": d, "createdBy": "sdk-local"}, "metadata %r" % lease["metadata"])
    check(os.path.isdir(d), "lease directory %s missing" % d)
    rec = read_json(os.path.join(d, "acquire.json"))
    check(rec["params"] == params, "acquire.json params %r != sent %r" % (rec["params"], params))
    check(rec["instanceConfig"] == INSTANCE_CONFIG, "config.get result recorded as %r" % rec["instanceConfig"])
    left = time.mktime(time.strptime(lease["expiresAt"][:19], "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.gmtime())
    check(50 < left <= 61, "expiresAt %r is not ~60 s ahead" % lease["expiresAt"])
    # expiresAt never later than the requested bound
    _, l2 = acquire(w, {"expiresInMs": 3600000}, requestedExpiresAt="2000-01-01T00:00:00.000Z")
    check(l2["expiresAt"] == "2000-01-01T00:00:00.000Z", "expiresAt not bounded: %r" % l2)
    _, l3 = acquire(w, {})
    check("expiresAt" not in l3, "expiresAt without config.expiresInMs: %r" % l3)
    w.err("environmentAcquireLease", {**SCOPE, "config": {}}, "runId is required", -32602)
    w.err("environmentAcquireLease", {**SCOPE, "runId": "r", "config": {"expiresInMs": "soon"}}, "expiresInMs", -32602)
    for extra in (l2, l3):
        w.ok("environmentDestroyLease", teardown_params(extra))
    state["lease"] = lease


def test_echo(w, root, state):
    lease = state["lease"]
    r = w.ok("duplexChannelOpen", open_params(lease, "r-echo", ["sh", "-c", "cat; exit 7"]))
    check(r["hostRouteId"] == "r-echo" and r["workerSessionId"], "open result %r" % r)
    pair = {"hostRouteId": "r-echo", "workerSessionId": r["workerSessionId"]}
    sent = bytes(range(256))
    check(w.ok("duplexChannelWrite", {**pair, "data": b64(sent)}) is None, "write should answer null")
    big = random.Random(7).randbytes(300000) if hasattr(random.Random, "randbytes") else os.urandom(300000)
    for i in range(0, len(big), 65536):
        w.ok("duplexChannelWrite", {**pair, "data": b64(big[i:i + 65536])})
    sent += big
    data, _ = w.channel_frames("r-echo", until_exit=False, max_bytes=len(sent))
    check(data == sent, "echo differs: %d bytes back, %d sent" % (len(data), len(sent)))
    w.err("duplexChannelWrite", {**pair, "data": "!!not base64"}, "base64", -32602)
    w.err("duplexChannelWrite", {**pair, "workerSessionId": "ws-other", "data": b64(b"x")}, "no open channel")
    check(w.ok("duplexChannelStop", pair) is None, "stop should answer null")
    data, code = w.channel_frames("r-echo")
    check(data == b"" and code == 7, "after stop: data %r, exit code %r (wanted 7)" % (data[:50], code))
    check(w.ok("duplexChannelClose", pair) == pair, "close should echo the pair")
    w.err("duplexChannelWrite", {**pair, "data": b64(b"x")}, "no open channel")


def test_channels(w, root, state):
    lease = state["lease"]
    d = lease["metadata"]["dir"]
    r = w.ok("duplexChannelOpen", open_params(lease, "r-cwd", ["sh", "-c", "pwd; printf err >&2; exit 3"]))
    data, code = w.channel_frames("r-cwd")
    check(data in ((d + "\nerr").encode(), ("err" + d + "\n").encode()), "cwd/stderr data %r" % data)
    check(code == 3, "exit code %r, wanted 3" % code)
    w.ok("duplexChannelClose", {"hostRouteId": "r-cwd", "workerSessionId": r["workerSessionId"]})
    # stop of a command that ignores stdin: SIGTERM after the grace period, exit code null
    r = w.ok("duplexChannelOpen", open_params(lease, "r-sleep", ["sleep", "30"]))
    pair = {"hostRouteId": "r-sleep", "workerSessionId": r["workerSessionId"]}
    t = time.time()
    w.ok("duplexChannelStop", pair)
    _, code = w.channel_frames("r-sleep", timeout=5)
    check(code is None and time.time() - t < 3, "stopped sleep: exit code %r after %.1fs" % (code, time.time() - t))
    w.ok("duplexChannelClose", pair)
    # close by hostRouteId alone ends a live channel, and nothing of it follows
    r = w.ok("duplexChannelOpen", open_params(lease, "r-alone", ["sleep", "30"]))
    check(w.ok("duplexChannelClose", {"hostRouteId": "r-alone"}) ==
          {"hostRouteId": "r-alone", "workerSessionId": r["workerSessionId"]}, "route-only close result")
    w.quiet(0.5, lambda m: m.get("params", {}).get("hostRouteId") == "r-alone")
    check(w.ok("duplexChannelClose", {"hostRouteId": "r-never"}) == {"hostRouteId": "r-never"}, "unknown route close")
    w.err("duplexChannelOpen", open_params(lease, "r-bad", ["/nonexistent/prog"]), "cannot run")
    w.err("duplexChannelOpen", open_params(lease, "r-bad", []), "command must be", -32602)
    w.err("duplexChannelOpen", {**open_params(lease, "r-bad", ["true"]), "companyId": "other"}, "another company")
    w.err("duplexChannelOpen", {**open_params(lease, "r-bad", ["true"]), "providerLeaseId": "sdk-0000000000000000"},
          "not in this worker's cache")


def test_restart_resume(w, root, state):
    """A second worker (no test hooks) on the same root: the lease must be resumed before use."""
    lease = state["lease"]
    w2 = Worker(root, hooks=False)
    try:
        w2.initialize()
        w2.err("duplexChannelOpen", open_params(lease, "r-2a", ["true"]), "resume it first")
        p = teardown_params(lease, config={"x": 1})
        del p["leaseMetadata"]  # optional in resume
        r = w2.ok("environmentResumeLease", p)
        check(r == lease, "resume result %r != acquire result %r" % (r, lease))
        check(read_json(os.path.join(lease["metadata"]["dir"], "resume.json")) == p, "resume.json")
        w2.ok("environmentResumeLease", teardown_params(lease))
        w2.err("environmentResumeLease", teardown_params(lease, leaseMetadata={"dir": "/elsewhere"}), "leaseMetadata.dir")
        w2.err("environmentResumeLease", {**teardown_params(lease), "providerLeaseId": "sdk-0000000000000000",
                                          "leaseMetadata": None}, "leaseMetadata is required")
        gone = {**SCOPE, "config": {}, "providerLeaseId": "sdk-0000000000000000"}
        w2.err("environmentResumeLease", gone, "not found: cannot resume")
        w2.ok("duplexChannelOpen", open_params(lease, "r-2b", ["sh", "-c", "echo resumed"]))
        data, code = w2.channel_frames("r-2b")
        check((data, code) == (b"resumed\n", 0), "after resume: %r %r" % (data, code))
        w2.err("duplexChannelOpen", open_params(lease, "r-2c", ["__exit__", "300"]), "cannot run")  # hooks off
        w2.shutdown()
    finally:
        w2.kill()


def test_release_destroy(w, root, state):
    lease = state["lease"]
    d = lease["metadata"]["dir"]
    good = teardown_params(lease, config={"k": "v"}, cancelActiveWork=False)
    no_config = dict(good)
    del no_config["config"]
    w.err("environmentReleaseLease", no_config, "config is required", -32602)
    no_meta = dict(good)
    del no_meta["leaseMetadata"]
    w.err("environmentReleaseLease", no_meta, "leaseMetadata is required", -32602)
    w.err("environmentReleaseLease", {**good, "leaseMetadata": {"dir": "/tmp", "createdBy": "sdk-local"}},
          "leaseMetadata.dir", -32602)
    w.err("environmentReleaseLease", {**good, "providerLeaseId": None}, "not an sdk-local lease id", -32602)
    w.err("environmentDestroyLease", {**good, "environmentId": "env-2"}, "environmentId")
    # a running channel ends when its lease is released
    r = w.ok("duplexChannelOpen", open_params(lease, "r-rel", ["sleep", "30"]))
    check(w.ok("environmentReleaseLease", good) == {"providerLeaseId": lease["providerLeaseId"], "state": "stopped"},
          "release receipt")
    _, code = w.channel_frames("r-rel", timeout=5)
    check(code is None, "channel of a released lease: exit code %r" % code)
    w.ok("duplexChannelClose", {"hostRouteId": "r-rel", "workerSessionId": r["workerSessionId"]})
    check(read_json(os.path.join(d, "release.json")) == good, "release.json differs from the params")
    w.err("duplexChannelOpen", open_params(lease, "r-rel2", ["true"]), "not in this worker's cache")
    dp = teardown_params(lease, config={"k": "v"})
    check(w.ok("environmentDestroyLease", dp) == {"providerLeaseId": lease["providerLeaseId"], "state": "destroyed"},
          "destroy receipt")
    check(not os.path.exists(d), "lease directory survived destroy")
    last = journal(root)[-1]
    check(last["method"] == "environmentDestroyLease" and last["params"] == dp, "journal's destroy entry %r" % last)
    w.ok("environmentDestroyLease", dp)  # idempotent
    w.ok("environmentReleaseLease", dp)


def test_hook_late_acquire(w, root, state):
    before = set(lease_dirs(root))
    rid = w.request("environmentAcquireLease", {**SCOPE, "runId": "late", "config": {"acquireDelayMs": 1500}})
    try:
        m = w.answer(rid, timeout=1.0)
        raise Failure("late acquire answered early: %r" % m)
    except Failure as e:
        if "timed out" not in str(e):
            raise
    new = set(lease_dirs(root)) - before
    check(len(new) == 1, "late acquire: lease directories created before the answer: %r" % new)
    lease = w.answer(rid, timeout=5)["result"]
    check(new == {lease["providerLeaseId"]}, "late answer %r is not the directory %r" % (lease, new))
    w.ok("environmentDestroyLease", teardown_params(lease, config={"acquireDelayMs": 1500}))
    check(set(lease_dirs(root)) == before, "late lease not removed")


def test_hook_fail_teardowns(w, root, state):
    cfg = {"failTeardowns": 3}
    _, lease = acquire(w, cfg)
    p = teardown_params(lease, config=cfg)
    w.err("environmentReleaseLease", p, "injected teardown failure 1 of 3")
    w.err("environmentReleaseLease", p, "injected teardown failure 2 of 3")
    w.err("environmentDestroyLease", p, "injected teardown failure 3 of 3")
    w.ok("environmentReleaseLease", p)
    w.ok("environmentDestroyLease", p)
    check(not os.path.exists(lease["metadata"]["dir"]), "lease directory survived destroy")


def test_hook_frames(w, root, state):
    _, lease = acquire(w, {})
    state["hook_lease"] = lease
    # (c) a data frame before the open answer, then exit 300 after it
    rid = w.request("duplexChannelOpen", open_params(lease, "r-early", ["__data_before_answer__", "__exit__", "300"]))
    ans = w.answer(rid)
    data, code = w.channel_frames("r-early")
    kinds = [m.get("method", "answer") for m in w.trace if m.get("id") == rid or
             m.get("params", {}).get("hostRouteId") == "r-early"]
    check(kinds == ["duplexChannel.data", "answer", "duplexChannel.exit"], "early frames order %r" % kinds)
    check(data == b"data before answer\n" and code == 300, "early: %r %r" % (data, code))
    w.ok("duplexChannelClose", {"hostRouteId": "r-early", "workerSessionId": ans["result"]["workerSessionId"]})
    # (c') data and exit before the answer
    rid = w.request("duplexChannelOpen", open_params(lease, "r-early2",
                                                     ["__data_before_answer__", "__exit_before_answer__", "5"]))
    w.answer(rid)
    kinds = [m.get("method", "answer") for m in w.trace if m.get("id") == rid or
             m.get("params", {}).get("hostRouteId") == "r-early2"]
    check(kinds == ["duplexChannel.data", "duplexChannel.exit", "answer"], "early exit order %r" % kinds)
    data, code = w.channel_frames("r-early2")
    check(code == 5, "early exit code %r" % code)
    w.ok("duplexChannelClose", {"hostRouteId": "r-early2"})
    # (d) exit code 300, no child, nothing before the answer
    rid = w.request("duplexChannelOpen", open_params(lease, "r-300", ["__exit__", "300"]))
    ans = w.answer(rid)
    data, code = w.channel_frames("r-300")
    check(data == b"" and code == 300, "__exit__ 300: %r %r" % (data, code))
    kinds = [m.get("method", "answer") for m in w.trace if m.get("id") == rid or
             m.get("params", {}).get("hostRouteId") == "r-300"]
    check(kinds == ["answer", "duplexChannel.exit"], "__exit__ order %r" % kinds)
    w.ok("duplexChannelClose", {"hostRouteId": "r-300", "workerSessionId": ans["result"]["workerSessionId"]})
    w.ok("environmentDestroyLease", teardown_params(lease))


def test_manifest(w, root, state):
    """manifest.json passes @paperclipai/shared's pluginManifestV1Schema (what paperclip checks at install)."""
    script = ('import { pluginManifestV1Schema as s } from "@paperclipai/shared"; import fs from "node:fs";'
              'const r = s.safeParse(JSON.parse(fs.readFileSync("manifest.json", "utf8")));'
              'console.log(r.success ? "OK" : r.error.issues.map(i => i.path.join(".") + ": " + i.message).join("; "))')
    r = subprocess.run([args.node, "--input-type=module", "-e", script], cwd=HERE, capture_output=True, text=True)
    check(r.stdout.strip() == "OK", "manifest.json: %s %s" % (r.stdout.strip(), r.stderr.strip()[-300:]))
    check(MANIFEST["environmentDrivers"][0]["driverKey"] == DRIVER, "manifest driverKey")


def main():
    global args
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default="node")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(HERE, "node_modules", "@paperclipai", "plugin-sdk")):
        sys.exit("node_modules missing: run `npm ci` in " + HERE)
    version = subprocess.run([args.node, "--version"], capture_output=True, text=True).stdout.strip()
    root = tempfile.mkdtemp(prefix="sdk-local-selftest-")
    print("node %s (%s), SDK_LOCAL_ROOT=%s" % (version, args.node, root))
    failures, state = 0, {}
    w = Worker(root)
    tests = [test_manifest, test_acquire, test_echo, test_channels, test_restart_resume, test_release_destroy,
             test_hook_late_acquire, test_hook_fail_teardowns, test_hook_frames]
    try:
        t = time.time()
        w.initialize()
        w.ok("health", {})
        print("ok   initialize, health (%.2fs)" % (time.time() - t))
        for test in tests:
            t = time.time()
            try:
                test(w, root, state)
                print("ok   %s (%.2fs)" % (test.__name__, time.time() - t))
            except Failure as e:
                failures += 1
                print("FAIL %s: %s" % (test.__name__, e))
        w.shutdown()
        left = lease_dirs(root)
        check(not left, "lease directories left behind: %r" % left)
        print("ok   shutdown, no lease directory left")
    except Failure as e:
        failures += 1
        print("FAIL %s" % e)
    finally:
        w.kill()
    err = b"".join(w.stderr).decode()
    if err:
        print("worker stderr:\n" + err.rstrip())
    if args.keep:
        print("kept " + root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    print("%s: %d failure(s)" % ("PASS" if failures == 0 else "FAIL", failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
