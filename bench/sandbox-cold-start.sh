#!/usr/bin/env bash
# Cold start of a brokered upstream with and without the sandbox (issue 32): N times each, the
# wall time from spawning the command to the upstream's answer to `tools/list` (after
# `initialize`), for tests/python/hostile_upstream.py on the system python3. "sandboxed" starts it
# exactly as the broker does: `sharedos-broker sandbox-exec PLAN python3 ...` with a clean
# environment (the plan: the default read list, network off with its own network namespace, in
# a user namespace of its own when not root, the default limits). Prints the median and the 90th
# percentile in milliseconds.
#   bench/sandbox-cold-start.sh [N] [path/to/sharedos-broker]
set -euo pipefail
n="${1:-30}"
here="$(cd "$(dirname "$0")/.." && pwd)"
broker="${2:-$here/target/release/sharedos-broker}"
[[ -x "$broker" ]] || broker="$here/target/debug/sharedos-broker"
script="$here/tests/python/hostile_upstream.py"
py=/usr/bin/python3
userns=true; [[ "$(id -u)" == 0 ]] && userns=false
plan() {
  printf '{"uid":%s,"gid":%s,"ownUid":false,"read":["/usr","/lib","/lib64","/bin","/etc/ld.so.cache","%s","%s"],"write":["/dev/null"],"network":"off","netns":true,"userns":%s,"memoryBytes":2147483648,"processes":512,"openFiles":1024,"landlockAbi":4,"parent":%s}' \
    "$(id -u)" "$(id -g)" "$(dirname "$script")" "$(dirname "$(readlink -f "$py")")" "$userns" "__PARENT__"
}
msgs='{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"b","version":"1"}}}
{"jsonrpc":"2.0","method":"notifications/initialized"}
{"jsonrpc":"2.0","id":2,"method":"tools/list"}'
one() { # prints milliseconds for one start
  local t0 t1 me=$BASHPID
  local args=("${@//__PARENT__/$me}")
  t0=$(date +%s%N)
  "${args[@]}" <<<"$msgs" | grep -q '"id": 2' 
  t1=$(date +%s%N)
  echo $(( (t1 - t0) / 1000 ))
}
stats() { sort -n | awk '{a[NR]=$1} END {printf "median %.1f ms, p90 %.1f ms (n=%d)\n", a[int((NR+1)/2)]/1000, a[int(NR*0.9)]/1000, NR}'; }
plan="$(plan)"
echo "broker: $broker"
printf 'unsandboxed: '; for _ in $(seq "$n"); do one env -i PATH=/usr/bin:/bin "$py" "$script"; done | stats
printf 'sandboxed:   '; for _ in $(seq "$n"); do one env -i PATH=/usr/bin:/bin HOME=/nonexistent LANG=C.UTF-8 "$broker" sandbox-exec "$plan" "$py" "$script"; done | stats
