#!/usr/bin/env bash
# The project's test command: installs test prerequisites, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export TOKENWAY_REQUIRE_PYTHON=1
# Where setup.sh installs npm tools when not root.
export PATH="$PATH:$HOME/.local/bin"
cargo test --workspace --locked "$@"
