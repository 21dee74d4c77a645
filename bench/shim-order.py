#!/usr/bin/env python3
"""Writes shim/hot-functions.txt: the functions shim sessions run, for the linker to lay out
first (issue 46 item 3, the shim's peak memory; bench/NOTES.md).

The shim's resident memory is mostly its own code: the kernel maps a file's pages around each
fault, 64 KiB at a time, and the functions a session runs are spread over the whole of `.text`,
so nearly all of it becomes resident. Given this list (shim/build.rs passes it to lld as
`--symbol-ordering-file`), the linker puts these functions together at the start of `.text`, and
the code a session never runs (error paths, clap's help, glibc's NSS, the backtrace printer)
stays out of memory.

How: the release shim, linked statically as the benchmark builds it, runs one session of each
revision in PROTOCOLS under `valgrind --tool=callgrind` (bench/cpu-probe.py: the opening,
tools/list, calls through a real broker), and every function callgrind saw run is listed by its
symbol (mangled), the most executed first. Functions are named with the hash rustc gives each
crate build, so the list holds for one toolchain, one Cargo.lock and one release profile: the
benchmark's memory section says how many of its names the measured shim has, and asks for the
list to be written again below 90 %; this script writes it:

    cargo build --release -p sharedos-broker-cli -p sharedos-mcp-shim
    cargo rustc --release -p sharedos-mcp-shim --bin sharedos-mcp-shim -- -C target-feature=+crt-static
    python3 bench/shim-order.py --bins target/release
"""
import argparse, collections, glob, os, re, subprocess, sys, tempfile

HEADER = """\
# The functions shim sessions run, most executed first: lld lays them out together at the
# start of the release shim's .text (shim/build.rs), so that the code a session never runs stays
# out of memory. Written by bench/shim-order.py from callgrind runs of real sessions; names
# carry rustc's per-build hashes, so they hold for one toolchain, one Cargo.lock and one profile.
"""


# glibc's string and memory functions come in variants (`__memset_avx2_unaligned_erms`,
# `__memset_evex_unaligned_erms`, …), one picked at start for the CPU; valgrind's CPU has no
# AVX-512, so the variant it saw run is often not the one the machine runs.
VARIANT = re.compile(r"^(__[a-z0-9]+?)_(sse2|sse4_1|sse42|ssse3|avx2|avx|evex|avx512|erms)")


def with_siblings(names, shim):
    """Each glibc variant listed, followed by every other variant of its function in `shim`."""
    out = subprocess.run(["nm", "--defined-only", shim], capture_output=True, text=True, check=True).stdout
    defined = [l.split()[2] for l in out.splitlines() if len(l.split()) == 3 and l.split()[1] in "tTwW"]
    families = {}
    for sym in defined:
        m = VARIANT.match(sym)
        if m:
            families.setdefault(m.group(1), []).append(sym)
    # memcpy and memmove share their code (one is the other's alias).
    for a, b in (("__memcpy", "__memmove"), ("__mempcpy", "__memmove")):
        if a in families and b in families:
            families[a] = families[a] + families[b]
    seen, result = set(), []
    for n in names:
        m = VARIANT.match(n)
        for sym in [n] + (families.get(m.group(1), []) if m else []):
            if sym not in seen:
                seen.add(sym)
                result.append(sym)
    return result


# A session of each: `initialize` with 2025-06-18 (Codex, pi) and 2025-11-25 (rmcp's and the SDKs'
# clients), and 2026-07-28's `server/discover` with `_meta` on every request (Claude Code).
PROTOCOLS = ["2025-06-18", "2025-11-25", "2026-07-28"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bins", required=True, help="folder with sharedos-broker and the static sharedos-mcp-shim")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "shim", "hot-functions.txt"))
    a = ap.parse_args()
    probe = os.path.join(os.path.dirname(__file__), "cpu-probe.py")
    # Self cost per function over one session of each revision a harness may speak: the cost
    # line after `calls=` is the call's inclusive cost, not the function's own.
    cost = collections.Counter()
    for protocol in PROTOCOLS:
        with tempfile.TemporaryDirectory(prefix="shim-order-") as d:
            r = subprocess.run([sys.executable, probe, "--bins", a.bins, "--callers", "1", "--calls", str(a.calls),
                                "--protocol", protocol, "--vg-shims", "1", "--vg-demangle-no", "--out", d])
            if r.returncode != 0:
                sys.exit(f"shim-order: the {protocol} session under callgrind failed")
            files = glob.glob(os.path.join(d, "shim0.*"))
            if len(files) != 1:
                sys.exit(f"shim-order: expected one callgrind file, found {files}")
            fn, after_call = None, False
            for line in open(files[0], errors="replace"):
                if line.startswith("fn="):
                    # `'2` and the like: callgrind's names for a function's recursive activations.
                    fn = line[3:].strip().split("'")[0]
                    cost[fn] += 0
                elif line.startswith("calls="):
                    after_call = True
                elif fn and line[:1].isdigit():
                    parts = line.split()
                    if not after_call and len(parts) >= 2:
                        cost[fn] += int(parts[1])
                    after_call = False
    # callgrind names the functions it cannot find a symbol for by address,
    # and what runs before `main` as "(below main)": those are left out.
    names = [n for n, _ in sorted(cost.items(), key=lambda kv: (-kv[1], kv[0]))
             if not n.startswith(("0x", "("))]
    names = with_siblings(names, os.path.join(a.bins, "sharedos-mcp-shim"))
    with open(a.out, "w") as f:
        f.write(HEADER)
        for n in names:
            f.write(n + "\n")
    print(f"shim-order: {len(names)} functions written to {os.path.normpath(a.out)}")


main()
