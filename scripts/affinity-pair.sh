#!/usr/bin/env bash
# front_cpu_affinity on, auto and off compared in interleaved `bench gateway` runs, optionally
# beside a busy neighbour (docs/benchmarks.md, "Pinned threads and a busy neighbour").
# The bench's gateway (its default config: auto) stays in the gateway slot; the same binary with
# each mode in turn stands in nginx's slot (scripts/lib/pair.sh). Against the run with `off`
# there, the difference of the gaps is the mode's added time to first token minus off's:
# negative is faster. With BUSY_MS and IDLE_MS, a neighbour (python3, unpinned) is busy for
# BUSY_MS and sleeps for IDLE_MS, over and over, for the whole measurement.
# Each round also prints the share of CPU time the hypervisor stole during it.
# Usage: scripts/affinity-pair.sh ROUNDS BINARY [BUSY_MS IDLE_MS]
set -euo pipefail
rounds=${1:?usage: scripts/affinity-pair.sh ROUNDS BINARY [BUSY_MS IDLE_MS]}
bin=$(realpath "${2:?binary}")
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
# shellcheck source=scripts/lib/pair.sh
. "$(dirname "$0")/lib/pair.sh"
pair_setup "$dir"
if [ $# -ge 4 ]; then
  python3 -c '
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(idle)' "$3" "$4" &
  echo "a neighbour busy ${3} ms, idle ${4} ms, in turn"
fi
gaps() { export PAIR_EXTRA="front_cpu_affinity = \"$1\""; pair_run "$bin" "$bin" 6000; }
steal() { python3 -c "
a = list(map(int, '$1'.split()[1:9])); b = list(map(int, '$2'.split()[1:9]))
d = [y - x for x, y in zip(a, b)]; print(f'{d[7] * 100 / sum(d):.1f} %')"; }
declare -A sum50 sum99
for m in on auto; do sum50[$m]=0; sum99[$m]=0; done
for round in $(seq "$rounds"); do
  before=$(head -1 /proc/stat)
  read -r off50 off99 <<<"$(gaps off)"
  line="round $round:"
  for m in on auto; do
    read -r g50 g99 <<<"$(gaps "$m")"
    d50=$(python3 -c "print(f'{$off50 - $g50:+.1f}')")
    d99=$(python3 -c "print(f'{$off99 - $g99:+.1f}')")
    line="$line $m - off: p50 $d50, p99 $d99 us;"
    sum50[$m]=$(python3 -c "print(${sum50[$m]} + $d50)")
    sum99[$m]=$(python3 -c "print(${sum99[$m]} + $d99)")
  done
  echo "$line stolen $(steal "$before" "$(head -1 /proc/stat)")"
done
for m in on auto; do
  python3 -c "print(f'mean $m - off over $rounds rounds: p50 {${sum50[$m]} / $rounds:+.1f} us, p99 {${sum99[$m]} / $rounds:+.1f} us')"
done
