#!/usr/bin/env bash
# Where a proxied request's time goes, hop by hop (docs/benchmarks.md, "Bookkeeping after the
# frame"): a zero-think-time sim on 18001, the gateway on 18002 and nginx (when installed) on
# 18003, each driven by `wrk -t1 -c1` with the bench's 16-token streaming POST while
# `perf record` traces every system call and scheduler switch on the machine for 2 s. Prints,
# per proxy, the median user-space time from reading the client's request to writing it
# upstream ("request work") and from reading the backend's first body bytes to writing them to
# the client ("response work"), and wrk's time from its write to the first read of the answer.
# Tracing slows system calls by a few µs each, so compare the proxies with each other, not with
# `bench gateway`. Needs root, perf, wrk and python3.
# Usage: scripts/hop-latency.sh [TOKENWAY_BINARY] [ROUNDS]
set -euo pipefail
bin=$(realpath "${1:-target/release/tokenway}")
rounds=${2:-1}
for tool in perf wrk python3; do
  command -v "$tool" >/dev/null || { echo "hop-latency: needs $tool" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "hop-latency: perf tracepoints need root" >&2; exit 1; }
dir=$(mktemp -d)
# shellcheck source=scripts/lib/lab.sh
. "$(dirname "$(realpath "$0")")/lib/lab.sh"
trap 'kill $(jobs -p) 2>/dev/null || true; lab_stop; rm -rf "$dir"' EXIT
profile=$(dirname "$(realpath "$0")")/profile
cat > "$dir/hops.py" <<'EOT'
# hops.py TRACE PROXY_TIDS SIM_TIDS: medians of the hops of each traced request.
import re, sys
proxy = set(open(sys.argv[2]).read().split())
sim = set(open(sys.argv[3]).read().split())
READ, WRITE = {"0", "19", "45"}, {"1", "20", "44", "46"}
line_re = re.compile(r"^\s*(\S.*?)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit): NR (\d+)(.*)$")
events = []
for line in open(sys.argv[1], errors="replace"):
    m = line_re.match(line)
    if not m:
        continue
    comm, tid, t, kind, nr, rest = m.groups()
    role = "wrk" if comm == "wrk" else "proxy" if tid in proxy else "sim" if tid in sim else None
    if role:
        ret = int(rest.split("=")[1]) if kind == "exit" else 0
        events.append((float(t) * 1e6, role, kind, nr, ret))
# One request: wrk writes; the proxy reads it and writes upstream; the sim reads it and
# writes; the proxy reads body bytes (> 300: more than the head) and writes to the client;
# wrk reads them.
steps = [("proxy", "exit", READ, 1), ("proxy", "enter", WRITE, 0), ("sim", "exit", READ, 1),
         ("proxy", "exit", READ, 300), ("proxy", "enter", WRITE, 0), ("wrk", "exit", {"0"}, 300)]
request, response, ttft = [], [], []
i = 0
while i < len(events):
    t0, role, kind, nr, _ = events[i]
    if not (role == "wrk" and kind == "enter" and nr == "1"):
        i += 1
        continue
    times, j = [], i + 1
    for s_role, s_kind, s_nrs, s_min in steps:
        while j < len(events):
            e = events[j]
            if e[1] == "wrk" and e[2] == "enter" and e[3] == "1":
                break
            if e[1] == s_role and e[2] == s_kind and e[3] in s_nrs and e[4] >= s_min:
                break
            j += 1
        if j >= len(events) or events[j][1:4] == ("wrk", "enter", "1"):
            break
        times.append(events[j][0])
        j += 1
    if len(times) == len(steps):
        request.append(times[1] - times[0])
        response.append(times[4] - times[3])
        ttft.append(times[5] - t0)
        i = j
    else:
        i += 1
def p50(v):
    return sorted(v)[len(v) // 2] if v else float("nan")
print(f"requests {len(ttft):5d}  request work p50 {p50(request):5.1f} us  "
      f"response work p50 {p50(response):5.1f} us  wrk first answer bytes p50 {p50(ttft):6.1f} us")
EOT
tids() { for p in "$@"; do ls "/proc/$p/task"; done; }
lab_start "$bin" "$dir"
for round in $(seq "$rounds"); do
  for target in $targets; do
    IFS=: read -r name port pid <<<"$target"
    pids=$(lab_pids "$pid")
    # shellcheck disable=SC2086
    tids $pids > "$dir/proxy.tids"
    tids "$sim" > "$dir/sim.tids"
    wrk -t1 -c1 -d5s -s "$profile/post.lua" "http://127.0.0.1:$port/v1/chat/completions" >/dev/null &
    load=$!
    sleep 1.5
    timeout 2 perf record -q -o "$dir/trace.data" -a \
      -e raw_syscalls:sys_enter,raw_syscalls:sys_exit,sched:sched_switch >/dev/null 2>&1 || true
    wait "$load"
    perf script -i "$dir/trace.data" 2>/dev/null > "$dir/trace.txt"
    printf 'round %s %-8s ' "$round" "$name"
    python3 "$dir/hops.py" "$dir/trace.txt" "$dir/proxy.tids" "$dir/sim.tids"
  done
done
