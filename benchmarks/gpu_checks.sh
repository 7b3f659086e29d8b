#!/usr/bin/env bash
# The GPU checks of a session that has a CUDA machine: the tests that run on the `cuda` backend
# (every backend-parametrized test and the Triton kernel tests' cuda cases), then
# benchmarks/torch_compile.py with --device cuda on a few models. Each part has a time limit,
# so the script ends within about TESTS_S + BENCH_S + 30 seconds; logs and JSON go to OUT.
# On an H100 with 16 workers the tests took over 200 s (735 of 804 in 200 s, 2026-11-26):
# give TESTS_S 300 for the whole selection.
#
#   OUT=/tmp/gpu TESTS_S=180 BENCH_S=220 MODELS=bert,resnet50 BATCH="8" bash benchmarks/gpu_checks.sh
#
# It uses the machine's own python3 (torch, Triton, transformers preinstalled) and installs
# yirage from this checkout with --no-deps; wheels in .whl/ (e.g. gguf) are installed first
# when present, and those in .whl/hf/ (transformers and its hub, tokenizers, ... at the versions
# yirage requires, when the machine's are older) only if transformers then imports.
# PYTEST_K narrows the tests further (default: every test with "cuda" in its id); PYTEST_PATHS
# (default: tests) and PYTEST_PATHS2 (a second pass, after the first, within the same TESTS_S)
# order them, so that a run cut short has run the first group.
set -u
OUT=${OUT:-/tmp/gpu-checks}; mkdir -p "$OUT"
TESTS_S=${TESTS_S:-180}; BENCH_S=${BENCH_S:-220}
MODELS=${MODELS:-bert,resnet50,convnext-tiny,mobilenetv2}; BATCH=${BATCH:-8}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 YIRAGE_CACHE_DIR=${YIRAGE_CACHE_DIR:-/tmp/yirage-cache}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .whl/hf/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hf .whl/hf/*.whl \
    && PYTHONPATH=/tmp/site-hf:$PYTHONPATH $PY -c "import transformers, tokenizers; from transformers import AutoModelForCausalLM" \
    && export PYTHONPATH=/tmp/site-hf:$PYTHONPATH || echo "the carried transformers wheels do not import here: using the machine's"
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch, triton, transformers, yirage as yr; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'backends', [b.value for b in yr.get_available_backends()])"
if [ "$TESTS_S" -gt 0 ]; then
  start=$(date +%s)
  per_test=""; $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout ${PER_TEST_S:-90}"
  # -v: each result is logged as it ends, so a run cut short by the time limit still names its failures
  export YIRAGE_FAILURE_LOG="$OUT/gpu-failures.log"   # tracebacks as they happen (tests/conftest.py)
  # (tests/conftest.py splits the cores between the xdist workers: OMP_NUM_THREADS)
  for paths in "${PYTEST_PATHS:-tests}" ${PYTEST_PATHS2:+"$PYTEST_PATHS2"}; do
    left=$(( TESTS_S - ($(date +%s) - start) )); [ "$left" -gt 10 ] || break
    # its own process group (setsid), killed whole afterwards: a time limit ends pytest, not
    # its xdist workers, which would go on using the GPU during the benchmarks
    setsid timeout -k 10 "$left" $PY -m pytest -v --tb=short -W ignore -p no:cacheprovider -p no:benchmark \
      $per_test -n "${WORKERS:-8}" -k "${PYTEST_K:-cuda}" $paths >>"$OUT/gpu-tests.log" 2>&1 &
    group=$!; wait $group; rc=$?
    kill -9 -- -$group 2>/dev/null; sleep 1
    echo "tests ($paths): rc=$rc at $(( $(date +%s) - start )) s"
  done
  echo "passed $(grep -c ' PASSED ' "$OUT/gpu-tests.log"), skipped $(grep -c ' SKIPPED ' "$OUT/gpu-tests.log")"
  grep -E " (FAILED|ERROR) " "$OUT/gpu-tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | head -40
fi
echo "before the benchmarks: load $(cut -d' ' -f1-3 /proc/loadavg), pytest processes left: $(pgrep -c -f pytest)"
if [ "$BENCH_S" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 10 "$BENCH_S" $PY benchmarks/torch_compile.py --device cuda --models "$MODELS" --batch-sizes $BATCH \
    --rounds "${ROUNDS:-3}" --threads "${THREADS:-8}" --timeout 150 >"$OUT/torch-compile-cuda.json" 2>"$OUT/torch-compile-cuda.err"
  echo "torch_compile --device cuda: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\[torch_compile\].*: \{" "$OUT/torch-compile-cuda.err" | cut -c1-1500
  tail -5 "$OUT/torch-compile-cuda.err"
fi
if [ "${PROFILE_S:-0}" -gt 0 ]; then   # per-kernel GPU time of yirage and Inductor (benchmarks/gpu_profile.py)
  start=$(date +%s)
  timeout -k 10 "$PROFILE_S" $PY benchmarks/gpu_profile.py --models "${PROFILE_MODELS:-$MODELS}" --batch "${BATCH%% *}" \
    >"$OUT/gpu-profile.txt" 2>&1
  echo "gpu_profile: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^== " "$OUT/gpu-profile.txt"
fi
cp -r "$YIRAGE_CACHE_DIR/tuning" "$OUT/" 2>/dev/null   # the kernel choices measured (shape class -> provider)
