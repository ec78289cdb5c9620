#!/usr/bin/env bash
# Installs what the tests need that a fresh machine may lack: curl, aria2 (compared with in
# bench weights), nginx (the reference proxy of bench gateway), iproute2 (as root, for the netlab tests), the Python packages `openai`
# (the official client), `aioquic` (an independent HTTP/3 client), `moto[server]` (an
# S3-compatible server) and `azure-storage-blob` (the Azure SDK, to set up and check the az://
# origin test), and Azurite (Microsoft's Azure Storage emulator, from npm; Node.js from Debian
# when missing). Safe to run repeatedly; does nothing when everything is present.
set -euo pipefail

need_apt=()
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
# Many images ship python3 without pip.
if ! command -v python3 >/dev/null 2>&1; then
  need_apt+=(python3 python3-pip)
elif ! python3 -m pip --version >/dev/null 2>&1; then
  need_apt+=(python3-pip)
fi
# aria2c (-x8) is the multi-connection downloader `tokenway bench weights` compares pulls with.
command -v aria2c >/dev/null 2>&1 || need_apt+=(aria2)
# nginx is the reference streaming proxy `tokenway bench gateway` measures the gateway against
# (Debian installs it in /usr/sbin; the bench only runs it on a loopback port of its own).
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
# The netlab tests (root only) build namespaces with iproute2's `ip`.
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then need_apt+=(iproute2); fi
# Azurite runs on Node.js and comes from npm.
command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
if [ ${#need_apt[@]} -gt 0 ]; then
  # As root, or through sudo when it asks no password; otherwise say what is missing.
  if [ "$(id -u)" = 0 ]; then
    as_root() { "$@"; }
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root() { sudo -n "$@"; }
  else
    echo "setup: please install (as root): apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

if ! python3 -c "import openai, aioquic" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check openai aioquic \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages openai aioquic
fi
python3 -c 'import openai, aioquic; print("setup: openai", openai.__version__, "aioquic", aioquic.__version__)'

# moto's server is the S3-compatible endpoint the s3:// origin test starts on loopback.
if ! python3 -c "import moto.server, boto3" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check 'moto[server]' \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages 'moto[server]'
fi
python3 -c 'import moto, moto.server, boto3; print("setup: moto", moto.__version__)'

# The Azure SDK creates and lists the container of the az:// origin test.
if ! python3 -c "import azure.storage.blob" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check azure-storage-blob \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages azure-storage-blob
fi
python3 -c 'import azure.storage.blob as b; print("setup: azure-storage-blob", b.__version__)'

# Azurite's blob service is the Azure Blob Storage endpoint the az:// origin test starts on
# loopback.
# Not root: into ~/.local (scripts/test.sh puts ~/.local/bin on the PATH).
if ! command -v azurite-blob >/dev/null 2>&1 && ! [ -x "$HOME/.local/bin/azurite-blob" ]; then
  if [ "$(id -u)" = 0 ]; then
    npm install --global --silent --no-audit --no-fund azurite
  else
    npm install --global --prefix "$HOME/.local" --silent --no-audit --no-fund azurite
  fi
fi
export PATH="$PATH:$HOME/.local/bin"
echo "setup: azurite $(azurite-blob --version)"
