#!/usr/bin/env bash
# A bounded libFuzzer run of the datagram layer's receive path (fuzz/, target `receive_path`):
# de-obfuscation, the packet parser and the FEC receiver fed arbitrary datagram scripts.
#
#   scripts/fuzz.sh [SECONDS]      default 60; CI runs it after the tests
#
# It needs a nightly toolchain (cargo-fuzz builds with sanitizer flags stable rejects) and
# installs cargo-fuzz when it is missing. Without nightly it says so and exits 0: the committed
# corpus still runs on stable in `cargo test` (fuzz_corpus_runs_without_panic). New inputs go
# to a scratch copy of the corpus, never into the tree; a crash fails the run and leaves its
# input in fuzz/artifacts/receive_path/ (add it to fuzz/corpus/receive_path/ once fixed).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
case $secs in ''|*[!0-9]*) echo "fuzz: SECONDS must be a whole number, got '$secs'" >&2; exit 2;; esac

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz: skipped: no nightly toolchain (rustup toolchain list); the corpus regression test ran in cargo test"
  exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --quiet --locked cargo-fuzz --version 0.13.2
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The first directory receives what the fuzzer finds; the committed one is only read.
# -rss_limit_mb bounds memory (the receiver's own bounds are asserted inside the target).
status=0
cargo +nightly fuzz run receive_path "$scratch" fuzz/corpus/receive_path -- \
  -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$scratch.log" 2>&1 || status=$?
grep -E '^(INFO: seed corpus|Done [0-9]+ runs|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+==|SUMMARY|Test unit written)' "$scratch.log" || true
if [ "$status" -ne 0 ]; then
  tail -n 40 "$scratch.log" | cut -c1-300 >&2
  echo "fuzz: receive_path FAILED (exit $status); the input is in fuzz/artifacts/receive_path/" >&2
  rm -f "$scratch.log"
  exit "$status"
fi
rm -f "$scratch.log"
echo "fuzz: receive_path ran ${secs}s without a crash; $(ls "$scratch" | wc -l) new inputs (not kept)"
