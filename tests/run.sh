#!/usr/bin/env bash
# The project's test command, on a fresh machine: installs what the tests need, lints, then runs every test.
# Debian's chromium drives the browser test (never `playwright install`: it downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
# Inductor (tests/test_fusion.py) compiles its CPU kernels with g++ against the Python headers.
NEED=""
[ -x /usr/bin/chromium ] || NEED="$NEED chromium"
command -v g++ >/dev/null || NEED="$NEED g++"
[ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || NEED="$NEED python3-dev"
if [ -n "$NEED" ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $NEED >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
