#!/usr/bin/env bash
# The project's test command, on a fresh machine: installs what the tests need, lints, then runs every test.
# Debian's chromium drives the browser test (never `playwright install`: it downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
