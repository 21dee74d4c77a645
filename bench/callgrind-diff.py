#!/usr/bin/env python3
"""Instructions per call from two callgrind files of the same process, one run with more calls
than the other (bench/cpu-probe.py): (big - small) / CALLS in all and per function (self cost;
--inclusive for inclusive cost, which counts recursive async frames more than once).

Under valgrind, `rep movsb` counts once per byte (memcpy of large values, opt-level z copies)
and SHA-256 runs its portable code (valgrind hides the SHA extensions): both read higher here
than they cost on the CPU."""
import re, subprocess, sys, argparse
ap = argparse.ArgumentParser()
ap.add_argument("small"); ap.add_argument("big"); ap.add_argument("calls", type=float)
ap.add_argument("--inclusive", action="store_true"); ap.add_argument("--top", type=int, default=40)
a = ap.parse_args()
def total(f):
    for line in open(f, errors="replace"):
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
def fns(f):
    args = ["callgrind_annotate", "--threshold=100", "--auto=no"]
    if a.inclusive: args.append("--inclusive=yes")
    out = subprocess.run(args + [f], capture_output=True, text=True).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r'^\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$', line)
        if m and ":" in m.group(2) or (m and "???" in m.group(2)):
            name = re.sub(r'\s+\[.*\]$', '', m.group(2))
            name = re.sub(r'^[^:]*:', '', name, count=1) if not name.startswith("???") else name
            d[name] = d.get(name, 0) + int(m.group(1).replace(",", ""))
    return d
ts, tb = total(a.small), total(a.big)
print(f"total per call: {(tb - ts) / a.calls:,.0f} instructions ({ts:,} / {tb:,})")
s, b = fns(a.small), fns(a.big)
diff = sorted(((b.get(k, 0) - s.get(k, 0)) / a.calls, k) for k in set(s) | set(b))
diff.reverse()
for v, k in diff[:a.top]:
    print(f"{v:10,.0f}  {k[:160]}")
