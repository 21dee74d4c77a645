#!/usr/bin/env python3
"""Instruction counts of the local call path (issue 46 item 3; bench/NOTES.md).

One real `sharedos-broker serve` (record_sync as --sync, the broker's embedded default policy and
a files provider), N shims (or, with --direct, N direct-files-server processes), each driven by a
thread of this process: initialize, tools/list, --warmup calls, then --calls `files.read` calls,
one at a time per caller. With --vg-broker the broker, and with --vg-shims K the first K shims (or
direct servers), run under `valgrind --tool=callgrind`, writing to --out. Instructions per call
are the difference of two runs with different --calls (bench/callgrind-diff.py), free of start-up
and of the machine's load. Prints the calls, the wall time and each shim's VmRSS/VmHWM (KiB).

    python3 bench/cpu-probe.py --bins target/release --calls 30 --vg-broker --vg-shims 1 --out cg-30
    python3 bench/cpu-probe.py --bins target/release --calls 130 --vg-broker --vg-shims 1 --out cg-130
    python3 bench/callgrind-diff.py cg-30/broker.* cg-130/broker.* 800
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time, signal, glob

POLICY = """// Embedded default policy of `sharedos-broker serve` without --config.
// alice may read, list and search /public and everything under it.
@id("alice-public")
permit(
  principal == SharedOS::User::"alice",
  action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
  resource is SharedOS::File
) when { resource.path == "/public" || resource.path like "/public/*" };

// files.search searches from / when no path is given; a search returns only the files the
// caller may read, so searching from / shows alice /public and nothing else.
@id("alice-search-from-root")
permit(
  principal == SharedOS::User::"alice",
  action == SharedOS::Action::"search",
  resource is SharedOS::File
) when { resource.path == "/" };
"""

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bins", required=True, help="folder with sharedos-broker and sharedos-mcp-shim")
    ap.add_argument("--shim", help="shim binary (default: BINS/sharedos-mcp-shim)")
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sync", default="batch")
    ap.add_argument("--vg-broker", action="store_true")
    ap.add_argument("--vg-shims", type=int, default=0, help="how many shims run under callgrind")
    ap.add_argument("--vg-demangle-no", action="store_true", help="callgrind names functions by their symbols (bench/shim-order.py)")
    ap.add_argument("--out", required=True, help="folder for callgrind files")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--smaps", action="store_true")
    ap.add_argument("--direct", action="store_true", help="direct-files-server processes instead of shims")
    ap.add_argument("--protocol", default="2025-06-18",
                    help="the client's MCP revision: 2026-07-28 opens with server/discover and names it in every request's _meta")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    shim = a.shim or os.path.join(a.bins, "sharedos-mcp-shim")
    broker = os.path.join(a.bins, "sharedos-broker")
    d = tempfile.mkdtemp(prefix="w46-probe-")
    os.makedirs(f"{d}/data/public"); os.makedirs(f"{d}/data/private")
    open(f"{d}/data/public/hello.txt", "w").write("Hello from SharedOS. This file is public.\n")
    open(f"{d}/policy.cedar", "w").write(POLICY)
    open(f"{d}/broker.toml", "w").write(
        f'record = "record.jsonl"\nrecord_sync = "{a.sync}"\npolicy = "policy.cedar"\n'
        f'\n[[providers]]\ntype = "files"\nnamespace = "files"\nroot = "{d}/data"\nwritable = false\n')
    run = f"{d}/run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAREDOS_")}
    vg = lambda name: ["valgrind", "--tool=callgrind", f"--callgrind-out-file={a.out}/{name}.%p",
                       "--dump-instr=no", "--compress-strings=no"] + (["--demangle=no"] if a.vg_demangle_no else [])
    cmd = (vg("broker") if a.vg_broker else []) + [broker, "--runtime-dir", run, "serve", "--config", f"{d}/broker.toml"]
    blog = open(f"{d}/broker.log", "w")
    bp = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=blog, env=env)
    deadline = time.time() + 120
    while not os.path.exists(f"{run}/control.sock"):
        if bp.poll() is not None or time.time() > deadline:
            sys.exit("broker did not start: " + open(f"{d}/broker.log").read())
        time.sleep(0.05)
    time.sleep(0.5 if a.vg_broker else 0.05)
    tokens = []
    for i in range(a.callers):
        for attempt in range(50):
            r = subprocess.run([broker, "--runtime-dir", run, "turn", "open", "--principal", "alice", "--json"],
                               capture_output=True, text=True, env=env)
            if r.returncode == 0:
                break
            time.sleep(0.2)
        else:
            sys.exit("turn open failed: " + r.stderr)
        tokens.append(json.loads(r.stdout)["token"])
    shims = []
    for i, tok in enumerate(tokens):
        e = dict(env, SHAREDOS_TURN_TOKEN=tok, SHAREDOS_BROKER=f"{run}/bridge.sock")
        c = (vg(f"shim{i}") if i < a.vg_shims else []) + ([os.path.join(a.bins, "direct-files-server"), "--root", f"{d}/data"] if a.direct else [shim])
        shims.append(subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=open(f"{d}/shim{i}.log", "w"), env=e, bufsize=0))
    def rpc(p, msg):
        p.stdin.write((json.dumps(msg) + "\n").encode()); p.stdin.flush()
    def read(p):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("shim closed stdout")
        return json.loads(line)
    errors = []
    barrier = threading.Barrier(a.callers + 1)
    done = threading.Barrier(a.callers + 1)
    stateless = a.protocol >= "2026-07-28"
    meta = {"io.modelcontextprotocol/protocolVersion": a.protocol,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "w46-probe", "version": "1"}}
    def params(p):
        return dict(p, _meta=meta) if stateless else p
    def caller(i, p):
        try:
            if stateless:
                rpc(p, {"jsonrpc": "2.0", "id": 0, "method": "server/discover", "params": params({})})
                read(p)
            else:
                rpc(p, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": a.protocol, "capabilities": {}, "clientInfo": {"name": "w46-probe", "version": "1"}}})
                read(p)
                rpc(p, {"jsonrpc": "2.0", "method": "notifications/initialized"})
            rpc(p, {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": params({})}); read(p)
            n = 2
            for _ in range(a.warmup):
                rpc(p, {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params({"name": "files.read", "arguments": {"path": "/public/hello.txt"}})})
                r = read(p); n += 1
                if "error" in r or r["result"].get("isError"):
                    raise RuntimeError(f"call failed: {r}")
            barrier.wait()
            for _ in range(a.calls):
                rpc(p, {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params({"name": "files.read", "arguments": {"path": "/public/hello.txt"}})})
                r = read(p); n += 1
                if "error" in r or r["result"].get("isError"):
                    raise RuntimeError(f"call failed: {r}")
        except Exception as ex:
            errors.append(f"caller {i}: {ex}")
            try: barrier.abort()
            except Exception: pass
        finally:
            try: done.wait()
            except Exception: pass
    ts = [threading.Thread(target=caller, args=(i, p)) for i, p in enumerate(shims)]
    for t in ts: t.start()
    try:
        barrier.wait(); t0 = time.time()
        done.wait(); t1 = time.time()
    except threading.BrokenBarrierError:
        t0 = t1 = time.time()
    for t in ts: t.join()
    mems = []
    for p in shims:
        st = open(f"/proc/{p.pid}/status").read()
        f = lambda k: int([l for l in st.splitlines() if l.startswith(k)][0].split()[1])
        mems.append((f("VmRSS:"), f("VmHWM:")))
        if a.smaps:
            open(f"{a.out}/smaps.{p.pid}", "w").write(open(f"/proc/{p.pid}/smaps").read())
    for p in shims:
        p.stdin.close()
    for p in shims:
        try: p.wait(timeout=120)
        except subprocess.TimeoutExpired: p.kill()
    bp.send_signal(signal.SIGTERM)
    try: bp.wait(timeout=120)
    except subprocess.TimeoutExpired: bp.kill()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        print(open(f"{d}/broker.log").read()[-3000:], file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"calls": a.calls * a.callers, "seconds": round(t1 - t0, 3), "dir": d,
                      "shim_rss_hwm_kib": mems}))
    if not a.keep:
        subprocess.run(["rm", "-rf", d])

main()
