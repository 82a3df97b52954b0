#!/usr/bin/env bash
# The GPU proof: one prepared run on one lent GPU (H100 or H200, no network, random-init weights in real shapes).
#
#   bash scripts/gpu_proof.sh            # on the GPU machine: about 6 minutes expected, 9 at most (the parts' limits)
#   bash scripts/gpu_proof.sh --quick    # the same sequence in tiny shapes on a CPU, in a minute or two (a test runs it)
#   ONLY=soak bash scripts/gpu_proof.sh  # a rerun of some parts after the preflight (names as below, comma-separated)
#
# Parts, in order, each under its own `timeout` (so one hang cannot eat the machine's time), cut further to what is
# left of DEADLINE (default 540 s from the start: the whole run stays under a 10-minute command limit). With --quick
# the limits only catch a hang (900 s a part, DEADLINE 3600 s): a test runs it on a CPU that other work may be busy on.
#   preflight  60 s  versions, the GPU, transformers >= 5.24 and every module the parts import (about 15 s: a missing
#                    package fails here, in seconds, and nothing else runs)
#   gpu_check 170 s  python -m specextend.tools.gpu_check at 4K and 16K (one H200 took 140-170 s with 32K as well;
#                    docs/RESULTS.md, "GPU path")
#   presets   100 s  python -m app.preset_check over every preset: an 8K-token document, 32 new tokens, a race of three
#                    through the app's run handler (about 8 s a preset: a random 8B build, one 8K prefill, three decodes)
#   long       60 s  python -m app.preset_check --long-output on qwen3-8b-eagle3, 256 new tokens (about 30 s)
#   soak      150 s  python -m app.soak --runs 30 --switches 2 (about 3 s a race at 4K tokens, and three builds)
# The app-level times are estimates from CPU runs and the H200's step costs: no GPU has run those parts yet.
#
# Everything lands in $OUT (default results/gpu_proof): summary.md (each part's status, time and last lines) and
# gpu_proof.tar.gz (every part's files and full log), both rewritten after each part so a run cut short keeps what it
# did. WHEELS=DIR first installs the wheels in DIR offline into a temporary folder put first on the path (an image
# without the app's packages, or with a transformers older than 5.24). PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
OUT=${OUT:-results/gpu_proof}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DEADLINE=${DEADLINE:-$([ $QUICK = 1 ] && echo 3600 || echo 540)}
ONLY=${ONLY:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ -n "${WHEELS:-}" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi

FAILED=0
RAN=""  # the parts that ran, in order
printf '| part | status | seconds | limit |\n|---|---|---|---|\n' >"$WORK/parts.md"

pack() {  # the summary and the archive, as they stand
  {
    echo "# GPU proof ($([ $QUICK = 1 ] && echo "--quick, CPU" || echo full)), $(date -u +%FT%TZ)"
    echo
    cat "$WORK/parts.md"
    for name in $RAN; do
      printf '\n## %s (last lines)\n\n```\n%s\n```\n' "$name" "$(grep -v '^USDT' "$WORK/$name.log" | tail -n 15)"
    done
  } >"$OUT/summary.md"
  tar -czf "$OUT/gpu_proof.tar.gz" -C "$WORK" --exclude=./site .
}

part() {  # part NAME LIMIT COMMAND...: COMMAND under LIMIT seconds (less if DEADLINE is nearer), output in NAME.log
  local name=$1 limit=$2 start=$SECONDS rc status
  shift 2
  if [ -n "$ONLY" ] && [ "$name" != preflight ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  local left=$((DEADLINE - SECONDS - 10))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    status="SKIPPED: the deadline is near"
  else
    local command="$*"
    command=${command//$'\n'/ }
    echo "== $name (limit ${limit} s): ${command:0:160}"
    RAN="$RAN $name"
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124 | 137) status="TIMED OUT" ;; *) status="FAILED (exit $rc)" ;; esac
  fi
  [ "$status" = ok ] || FAILED=1
  echo "   $status in $((SECONDS - start)) s"
  echo "| $name | $status | $((SECONDS - start)) | $limit |" >>"$WORK/parts.md"
  pack
}

PREFLIGHT=$(cat <<EOF
# versions, the device, transformers and every module the parts import
import sys, torch, transformers
cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "device", torch.cuda.get_device_name() if cuda else "cpu")
from specextend.models import check_transformers
check_transformers()
import app.preset_check, app.soak, app.studio, specextend.tools.gpu_check
sys.exit(0 if cuda or $QUICK else "no CUDA device: use --quick on a CPU")
EOF
)
part preflight $([ $QUICK = 1 ] && echo 900 || echo 60) "$PYTHON" -c "$PREFLIGHT"
if [ "$FAILED" = 1 ]; then  # nothing else could run
  cat "$OUT/summary.md"
  exit 1
fi

if [ $QUICK = 1 ]; then  # the same parts in tiny shapes (tests/test_steps.py runs every section of gpu_check --quick)
  HANG=900  # quiet, each part takes 10-60 s; a busy machine once took 150 s over the long part
  part gpu_check $HANG "$PYTHON" -m specextend.tools.gpu_check --quick --skip lossless,steps,engine --lengths 64,128 \
    --out "$WORK/gpu_check"
  part presets $HANG "$PYTHON" -m app.preset_check --shrink --tokens 200 --max-new-tokens 4 --out "$WORK/presets"
  part long $HANG "$PYTHON" -m app.preset_check --shrink --long-output --presets qwen3-8b-eagle3 --max-new-tokens 32 \
    --out "$WORK/long"
  part soak $HANG "$PYTHON" -m app.soak --shrink --runs 12 --tokens 200 --max-new-tokens 4 --out "$WORK/soak"
else
  part gpu_check 170 "$PYTHON" -m specextend.tools.gpu_check --lengths 4096,16384 --out "$WORK/gpu_check"
  part presets 100 "$PYTHON" -m app.preset_check --out "$WORK/presets"
  part long 60 "$PYTHON" -m app.preset_check --long-output --presets qwen3-8b-eagle3 --max-new-tokens 256 --out "$WORK/long"
  part soak 150 "$PYTHON" -m app.soak --runs 30 --switches 2 --out "$WORK/soak"
fi
cat "$OUT/summary.md"
exit "$FAILED"
