#!/usr/bin/env bash
# Two gateway builds in one interleaved `bench gateway` run (docs/benchmarks.md, "Bookkeeping
# while the backend works"): build B stands in nginx's slot (scripts/lib/pair.sh), and the
# sequential scenario alternates A and B request by request, so drift of the machine between
# runs cancels out. Each round runs A in the gateway slot and B in the other, then the other way
# round; the slots are not quite equal (the request before a slot's is a different target's), so
# the difference of the builds is half the difference of the two runs.
# Usage: scripts/gateway-pair.sh ROUNDS BINARY_A BINARY_B
set -euo pipefail
rounds=${1:?usage: scripts/gateway-pair.sh ROUNDS BINARY_A BINARY_B}
a=$(realpath "${2:?binary A}")
b=$(realpath "${3:?binary B}")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# shellcheck source=scripts/lib/pair.sh
. "$(dirname "$0")/lib/pair.sh"
pair_setup "$dir"
sum=0
for round in $(seq "$rounds"); do
  ab=$(pair_run "$a" "$b" | cut -d' ' -f1)
  ba=$(pair_run "$b" "$a" | cut -d' ' -f1)
  diff=$(python3 -c "print(f'{($ab - $ba) / 2:+.1f}')")
  echo "round $round: A in the gateway slot $ab us, B there $ba us; A - B = $diff us (p50 time to first token)"
  sum=$(python3 -c "print($sum + ($ab - $ba) / 2)")
done
python3 -c "print(f'mean A - B over $rounds rounds: {$sum / $rounds:+.1f} us (negative: A is faster)')"
