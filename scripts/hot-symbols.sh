#!/usr/bin/env bash
# Writes crates/tokenway/hot-symbols.txt, the link order of the gateway's per-request code
# (docs/benchmarks.md, "Hot code on few pages"). Runs the workload of scripts/profile-gateway.sh
# (a zero-think-time sim, the gateway under callgrind, `wrk -t1 -c1` with the bench's 16-token
# streaming POST) and lists, hottest first, every function of the binary with code executed on
# at least every second request. The linker puts them side by side (crates/tokenway/build.rs),
# at the start of the code, which the gateway moves onto one 2 MiB huge page (src/huge_text.rs).
# Regenerate after changes to the request path or to the dependencies of crates/tokenway (the
# symbols' hashes change with them); names the linker no longer finds are skipped.
# Usage: scripts/hot-symbols.sh [TOKENWAY_BINARY] [SECONDS]
set -euo pipefail
bin=${1:-target/release/tokenway}
secs=${2:-5}
command -v python3 >/dev/null || { echo "hot-symbols: needs python3" >&2; exit 1; }
root=$(realpath "$(dirname "$0")/..")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# One connection, as the bench's single stream; mangled names, as the linker knows them.
run=$(CONNECTIONS=1 CALLGRIND_FLAGS="--dump-instr=yes --demangle=no" KEEP="$dir/cg.out.1" \
  "$root/scripts/profile-gateway.sh" "$bin" "$secs")
requests=$(echo "$run" | sed -E 's/^requests: ([0-9]+);.*/\1/')
python3 - "$dir/cg.out.1" "$requests" "$root/crates/tokenway/hot-symbols.txt" "$(realpath "$bin")" <<'EOT'
import collections, re, sys
profile, requests, out, binary = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
names = {"fn": {}, "ob": {}}
fn = ob = "?"
fn_object = {}
cost = collections.Counter()
hot = set()
addr = 0
skip = False
for line in open(profile):
    line = line.rstrip("\n")
    m = re.match(r"(c?)(fn|ob)=\((\d+)\)(?: (.*))?", line)
    if m:
        if m.group(4):
            names[m.group(2)][m.group(3)] = m.group(4)
        if not m.group(1):
            if m.group(2) == "ob":
                ob = names["ob"].get(m.group(3), "?")
            else:
                fn = names["fn"].get(m.group(3), "?")
                fn_object[fn] = ob
        continue
    if line.startswith("calls="):
        skip = True  # the next cost line is the call's inclusive cost
        continue
    if not line or line[0] not in "0123456789+-*":
        continue
    parts = line.split()
    p = parts[0]
    if p.startswith("0x"):
        addr = int(p, 16)
    elif p[0] == "+":
        addr += int(p[1:])
    elif p[0] == "-":
        addr -= int(p[1:])
    if skip:
        skip = False
        continue
    n = int(parts[-1]) if len(parts) >= 3 else 0
    cost[fn] += n
    if n >= requests // 2:
        hot.add(fn)
order = []
for f in sorted(hot, key=lambda f: -cost[f]):
    name = re.sub(r"'\d+$", "", f)  # callgrind's mark of a recursion level
    if fn_object.get(f) == binary and name not in order:
        order.append(name)
open(out, "w").write("\n".join(order) + "\n")
print(f"{requests} requests profiled; {len(order)} functions written to {out}")
EOT
