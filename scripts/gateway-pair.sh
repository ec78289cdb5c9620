#!/usr/bin/env bash
# Two gateway builds in one interleaved `bench gateway` run (docs/benchmarks.md, "Bookkeeping
# while the backend works"): build B stands in nginx's slot, through a stand-in `nginx` on PATH
# that reads the bench's generated nginx.conf and starts `B gateway` on its listen address, in
# front of the same sim, with the bench's own gateway config. The sequential scenario then
# alternates A and B request by request, so drift of the machine between runs cancels out.
# Each round runs A in the gateway slot and B in the other, then the other way round; the slots
# are not quite equal (the request before a slot's is a different target's), so the difference
# of the builds is half the difference of the two runs.
# Usage: scripts/gateway-pair.sh ROUNDS BINARY_A BINARY_B
set -euo pipefail
rounds=${1:?usage: scripts/gateway-pair.sh ROUNDS BINARY_A BINARY_B}
a=$(realpath "${2:?binary A}")
b=$(realpath "${3:?binary B}")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/shim"
cat > "$dir/shim/nginx" <<'EOT'
#!/usr/bin/env bash
conf=""; while [ $# -gt 0 ]; do [ "$1" = -c ] && conf=$2; shift; done
# `nginx -v` (the bench asks for the version) gets an answer, not a gateway.
[ -n "$conf" ] || { echo "nginx version: stand-in for $PAIR_OTHER" >&2; exit 0; }
listen=$(grep -oP 'listen \K[0-9.:]+' "$conf")
upstream=$(grep -oP 'server \K[0-9.:]+(?=;)' "$conf")
out=$(cd "$(dirname "$conf")" && pwd)/pair-gateway.toml
printf 'listen = "%s"\n\n[[backends]]\nurl = "http://%s"\nmodels = ["sim-model"]\nmax_inflight = 4096\n' \
  "$listen" "$upstream" > "$out"
exec "$PAIR_OTHER" gateway --config "$out"
EOT
chmod +x "$dir/shim/nginx"
run() { # run FIRST SECOND: FIRST in the gateway slot; prints FIRST's minus SECOND's added p50
  PAIR_OTHER=$2 PATH="$dir/shim:$PATH" "$1" bench gateway --requests 3000 --concurrency 64 \
    --duration-secs 1 --open-streams 0 --out "$dir/run" >/dev/null 2>&1
  python3 - "$dir/run/results.json" <<'EOT'
import json, sys
t = {x["target"]: x["sequential"]["ttft"]["p50_ms"] for x in json.load(open(sys.argv[1]))["targets"]}
print(f"{(t['gateway'] - t['nginx']) * 1000:.2f}")
EOT
}
sum=0
for round in $(seq "$rounds"); do
  ab=$(run "$a" "$b")
  ba=$(run "$b" "$a")
  diff=$(python3 -c "print(f'{($ab - $ba) / 2:+.1f}')")
  echo "round $round: A in the gateway slot $ab us, B there $ba us; A - B = $diff us (p50 time to first token)"
  sum=$(python3 -c "print($sum + ($ab - $ba) / 2)")
done
python3 -c "print(f'mean A - B over $rounds rounds: {$sum / $rounds:+.1f} us (negative: A is faster)')"
