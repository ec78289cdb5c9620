#!/usr/bin/env bash
# Alternating short `bench gateway` runs of several builds (docs/benchmarks.md, "The end of an
# answer after its last frame"): per run, the gateway's and nginx's added time to first token
# (p50/p99 over direct) and the gateway's gap to nginx. One run's p50 gap moves by ±5 µs on this
# 2-core VM, so compare builds over several rounds, alternating, never one run against another.
# Needs nginx (scripts/setup.sh) and python3.
# Usage: scripts/gateway-ab.sh ROUNDS BINARY...
set -euo pipefail
rounds=${1:?usage: scripts/gateway-ab.sh ROUNDS BINARY...}
shift
[ $# -gt 0 ] || { echo "gateway-ab: name at least one tokenway binary" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for round in $(seq "$rounds"); do
  for bin in "$@"; do
    "$bin" bench gateway --requests 3000 --concurrency 64 --duration-secs 1 --open-streams 0 \
      --out "$out/run" >/dev/null 2>&1
    python3 - "$out/run/results.json" "$bin" "$round" <<'EOT'
import json, sys
d = json.load(open(sys.argv[1]))
t = {x["target"]: x["sequential"]["ttft"] for x in d["targets"]}
if "nginx" not in t:
    sys.exit("gateway-ab: nginx did not run (scripts/setup.sh installs it)")
added = lambda k, q: (t[k][q] - t["direct"][q]) * 1000
g50, g99 = added("gateway", "p50_ms"), added("gateway", "p99_ms")
n50, n99 = added("nginx", "p50_ms"), added("nginx", "p99_ms")
print(f"round {sys.argv[3]} {sys.argv[2]}: gateway +{g50:.1f}/+{g99:.1f} us, nginx +{n50:.1f}/+{n99:.1f} us, "
      f"gap p50 {g50 - n50:+.1f} us, p99 {g99 - n99:+.1f} us")
EOT
  done
done
