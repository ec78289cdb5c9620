# Two gateways in one interleaved `bench gateway` run (sourced, not run; scripts/gateway-pair.sh,
# scripts/affinity-pair.sh). A stand-in `nginx` on PATH reads the bench's generated nginx.conf and
# starts another gateway binary on its listen address, in front of the same sim, with
# `max_inflight = 4096` and the top-level config lines in PAIR_EXTRA. The sequential scenario
# then alternates the two request by request, so drift of the machine between runs cancels out.
#
# pair_setup DIR writes the stand-in under DIR.
# pair_run FIRST SECOND [REQUESTS] runs FIRST in the gateway slot and SECOND in nginx's and
# prints FIRST's added time to first token minus SECOND's, p50 and p99, in µs.

pair_setup() {
  pair_dir=$1
  mkdir -p "$pair_dir/shim"
  cat > "$pair_dir/shim/nginx" <<'EOT'
#!/usr/bin/env bash
conf=""; while [ $# -gt 0 ]; do [ "$1" = -c ] && conf=$2; shift; done
# `nginx -v` (the bench asks for the version) gets an answer, not a gateway.
[ -n "$conf" ] || { echo "nginx version: stand-in for $PAIR_OTHER" >&2; exit 0; }
listen=$(grep -oP 'listen \K[0-9.:]+' "$conf")
upstream=$(grep -oP 'server \K[0-9.:]+(?=;)' "$conf")
out=$(cd "$(dirname "$conf")" && pwd)/pair-gateway.toml
printf 'listen = "%s"\n%s\n\n[[backends]]\nurl = "http://%s"\nmodels = ["sim-model"]\nmax_inflight = 4096\n' \
  "$listen" "${PAIR_EXTRA:-}" "$upstream" > "$out"
exec "$PAIR_OTHER" gateway --config "$out"
EOT
  chmod +x "$pair_dir/shim/nginx"
}

pair_run() {
  PAIR_OTHER=$2 PATH="$pair_dir/shim:$PATH" "$1" bench gateway --requests "${3:-3000}" \
    --concurrency 64 --duration-secs 1 --open-streams 0 --out "$pair_dir/run" >/dev/null 2>&1
  python3 - "$pair_dir/run/results.json" <<'EOT'
import json, sys
t = {x["target"]: x["sequential"]["ttft"] for x in json.load(open(sys.argv[1]))["targets"]}
print(" ".join(f"{(t['gateway'][k] - t['nginx'][k]) * 1000:.2f}" for k in ("p50_ms", "p99_ms")))
EOT
}
