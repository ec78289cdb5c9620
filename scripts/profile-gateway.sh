#!/usr/bin/env bash
# Instructions per request of the gateway's path (docs/benchmarks.md, "The gateway's own HTTP/1.1
# front"): a zero-think-time sim and a gateway on loopback ports 18001/18002, the gateway under
# callgrind, `wrk -t1 -c8` with the bench's 16-token streaming POST; prints requests and
# instructions per request. Needs valgrind and wrk (Debian packages).
# Usage: scripts/profile-gateway.sh [TOKENWAY_BINARY] [SECONDS]
# Environment: CONNECTIONS (wrk's, default 8), CALLGRIND_FLAGS (more valgrind flags), KEEP=FILE
# (keep the profile there; scripts/hot-symbols.sh uses these).
set -euo pipefail
bin=${1:-target/release/tokenway}
secs=${2:-10}
for tool in valgrind callgrind_control callgrind_annotate wrk; do
  command -v "$tool" >/dev/null || { echo "profile-gateway: needs $tool (apt-get install valgrind wrk)" >&2; exit 1; }
done
# Under valgrind the code stays where the binary maps it (src/huge_text.rs).
export TOKENWAY_HUGE_TEXT=off
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
profile=$(dirname "$(realpath "$0")")/profile
"$bin" sim --listen 127.0.0.1:18001 --config "$profile/sim.toml" >"$dir/sim.log" 2>&1 &
sleep 1
conns=${CONNECTIONS:-8}
# shellcheck disable=SC2086 # CALLGRIND_FLAGS is a list of flags
valgrind --tool=callgrind ${CALLGRIND_FLAGS:-} --callgrind-out-file="$dir/cg.out" "$bin" gateway --config "$profile/gateway.toml" >"$dir/gw.log" 2>&1 &
gw=$!
for _ in $(seq 60); do grep -q "listening on" "$dir/gw.log" && break; sleep 0.5; done
url=http://127.0.0.1:18002/v1/chat/completions
wrk -t1 -c"$conns" -d2s -s "$profile/post.lua" "$url" >/dev/null
callgrind_control -z "$gw" >/dev/null 2>&1
requests=$(wrk -t1 -c"$conns" -d"${secs}s" -s "$profile/post.lua" "$url" | awk '/requests in/ {print $1}')
callgrind_control -d "$gw" >/dev/null 2>&1
sleep 1
total=$(callgrind_annotate "$dir/cg.out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
echo "requests: $requests; instructions: $total; per request: $((total / requests))"
[ -z "${KEEP:-}" ] || cp "$dir/cg.out.1" "$KEEP"
