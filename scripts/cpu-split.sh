#!/usr/bin/env bash
# Who pays for a proxied request (docs/benchmarks.md, "Where the two CPUs go"): a zero-think-time
# sim on 18001, the gateway on 18002 and nginx (when installed) on 18003, each driven in turn by
# `wrk -t1 -cCONNECTIONS` with the bench's 16-token streaming POST. Prints, per target and round,
# requests per second and the CPU time per request of the sim, the proxy and wrk (user + system,
# all threads, from /proc and time(1)), and the proxy's and sim's context switches per request.
# When the machine is saturated, requests per second = CPUs / (sum of the three), which is what
# "% of direct" in `bench gateway` comes down to.
# Usage: scripts/cpu-split.sh [TOKENWAY_BINARY] [ROUNDS]
# Environment: CONNECTIONS (default 256), SECONDS_PER_TURN (default 5).
set -euo pipefail
bin=$(realpath "${1:-target/release/tokenway}")
rounds=${2:-2}
conns=${CONNECTIONS:-256}
secs=${SECONDS_PER_TURN:-5}
for tool in wrk /usr/bin/time; do
  command -v "$tool" >/dev/null || { echo "cpu-split: needs $tool (apt-get install wrk time)" >&2; exit 1; }
done
dir=$(mktemp -d)
# shellcheck source=scripts/lib/lab.sh
. "$(dirname "$(realpath "$0")")/lib/lab.sh"
trap 'kill $(jobs -p) 2>/dev/null || true; lab_stop; rm -rf "$dir"' EXIT
profile=$(dirname "$(realpath "$0")")/profile
tick=$(getconf CLK_TCK)
# CPU ticks and context switches of every thread of the given processes.
ticks() { local t=0 p s; for p in "$@"; do for s in /proc/"$p"/task/*/stat; do t=$((t + $(awk '{print $14 + $15}' "$s"))); done; done; echo "$t"; }
switches() { local t=0 p s; for p in "$@"; do for s in /proc/"$p"/task/*/status; do t=$((t + $(awk '/ctxt_switches/ {n += $2} END {print n}' "$s"))); done; done; echo "$t"; }
lab_start "$bin" "$dir"
targets="direct:18001:- $targets"
echo "CPU time per request in µs (context switches per request); $conns connections, ${secs} s per turn"
for round in $(seq "$rounds"); do
  for target in $targets; do
    IFS=: read -r name port pid <<<"$target"
    if [ "$pid" = - ]; then pids=""; else pids=$(lab_pids "$pid"); fi
    url="http://127.0.0.1:$port/v1/chat/completions"
    wrk -t1 -c"$conns" -d1s -s "$profile/post.lua" "$url" >/dev/null
    # shellcheck disable=SC2086 # pids is a list
    { s0=$(ticks "$sim"); p0=$(ticks $pids); ss0=$(switches "$sim"); ps0=$(switches $pids); }
    out=$({ /usr/bin/time -f "TIME %U %S" wrk -t1 -c"$conns" -d"${secs}s" -s "$profile/post.lua" "$url"; } 2>&1)
    # shellcheck disable=SC2086
    { s1=$(ticks "$sim"); p1=$(ticks $pids); ss1=$(switches "$sim"); ps1=$(switches $pids); }
    n=$(awk '/requests in/ {print $1}' <<<"$out")
    rps=$(awk '/Requests\/sec/ {print int($2)}' <<<"$out")
    wrk_s=$(awk '/^TIME/ {print $2 + $3}' <<<"$out")
    awk -v r="$round" -v name="$name" -v rps="$rps" -v n="$n" -v tick="$tick" -v w="$wrk_s" \
      -v s="$((s1 - s0))" -v p="$((p1 - p0))" -v ss="$((ss1 - ss0))" -v ps="$((ps1 - ps0))" 'BEGIN {
        us = 1e6 / n; sim = s / tick * us; proxy = p / tick * us; wrk = w * us
        printf "round %s %-8s %6d requests/s | sim %5.1f (%.2f) | proxy %5.1f (%.2f) | wrk %5.1f | sum %6.1f\n",
          r, name, rps, sim, ss / n, proxy, ps / n, wrk, sim + proxy + wrk }'
  done
done
