#!/usr/bin/env bash
# Installs what the tests need that a fresh machine may lack: curl and the official `openai`
# Python package. Safe to run repeatedly; does nothing when everything is present.
set -euo pipefail

need_apt=()
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  else
    echo "setup: please install: ${need_apt[*]}" >&2
    exit 1
  fi
fi

if ! python3 -c "import openai, aioquic" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check openai aioquic \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages openai aioquic
fi
python3 -c 'import openai, aioquic; print("setup: openai", openai.__version__, "aioquic", aioquic.__version__)'
