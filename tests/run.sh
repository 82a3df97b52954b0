#!/usr/bin/env bash
# The project's test command, on a fresh machine: installs what the tests need, lints, then runs every test.
# Debian's chromium drives the browser test (never `playwright install`: it downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
# The project needs Python 3.11 or newer (pyproject.toml): the venv's if there is one, else the first such python3.
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
  new_enough "$PY" || { echo "tests/run.sh: .venv holds Python $("$PY" -V 2>&1); the project needs 3.11 or newer: remove .venv and run again" >&2; exit 1; }
else
  PY=""
  for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && new_enough "$candidate"; then PY=$(command -v "$candidate"); break; fi
  done
  [ -n "$PY" ] || { echo "tests/run.sh: no Python 3.11 or newer found (python3 is $(python3 -V 2>&1 || echo missing)); install one, e.g. apt-get install python3.11 python3.11-venv" >&2; exit 1; }
fi
# Inductor (tests/test_fusion.py) compiles its CPU kernels with g++ against the Python headers; specextend/cpu_kernels.py
# compiles the bf16 attention kernel with cc (gcc, which g++ brings).
NEED=""
[ -x /usr/bin/chromium ] || NEED="$NEED chromium"
command -v g++ >/dev/null || NEED="$NEED g++"
[ -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] ||
  NEED="$NEED $("$PY" -c 'import sys; print("python%d.%d-dev" % sys.version_info[:2])')"
if [ -n "$NEED" ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $NEED >/dev/null
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
.venv/bin/ruff check --quiet .
# Test files run on up to 4 workers (pytest-xdist; one per core), each file whole on one worker so that its module
# fixtures load once; conftest.py pins each worker's torch to one thread. TEST_WORKERS=0 runs them in this process.
WORKERS=${TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
