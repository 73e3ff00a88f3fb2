#!/usr/bin/env bash
# The GPU checks of issue #28 in one call, for a session that has a GPU machine (whose device time is short):
#   1. the CUDA variants of the device tests (tests/test_devices.py: every case and backend against the CPU loop,
#      bf16, checkpoints read on the CPU, GradScaler, InBackward, functional, compiled, no host sync per step with
#      torch.cuda.set_sync_debug_mode('error'); and the bench's own GPU test);
#   2. `python -m cbopt bench --device cuda` on GPT-2 small's param set (Adam and Lion, fp32 and bf16, clipping,
#      peak memory; the catalogue's AdamW and Lion against their references: torch's AdamW, and lion-pytorch where
#      carried), whose bench.json/bench.md go to the README's tables and docs/performance.md.
# Everything is written under $OUT (the device tool's folder; ./gpu_check_out elsewhere): tests.log, bench.log and
# bench/bench.{json,md,png}.
#
# Before the call, here (the GPU image has torch but not fastcore, and nothing can be fetched there):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl fastcore lion-pytorch
# then run it with carry=['.whl'] and command `bash tools/gpu_check.sh` (timeout_s 600: the tests are capped at
# TEST_TIMEOUT seconds, the bench at BENCH_TIMEOUT). On the CPU it runs too (the CUDA tests skip, with the reason):
#   TEST_TIMEOUT=120 BENCH_ARGS='--quick --only adam' bash tools/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's cbopt, not an installed one
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
$PY -c "import torch, cbopt; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '-', '| cbopt', cbopt.__version__)" \
  || { echo "cbopt does not import: carry its missing packages as wheels (see the top of this script)"; exit 1; }

echo "== 1. tests on the GPU (at most ${TEST_TIMEOUT:-260} s)"
timeout "${TEST_TIMEOUT:-260}" $PY -m pytest -o addopts='' -p no:cacheprovider -p no:randomly -q -rfs --durations=10 \
  tests/test_devices.py "tests/test_bench.py::test_cuda_bench_times_fp32_and_bf16" ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log"
tests=$?

echo "== 2. the bench (at most ${BENCH_TIMEOUT:-280} s)"
timeout "${BENCH_TIMEOUT:-280}" $PY -m cbopt bench ${BENCH_ARGS:---device cuda --only adam,lion,clip,catalogue --optimizers AdamW,Lion} --out "$OUT/bench" \
  2>&1 | tee "$OUT/bench.log"
bench=$?
echo "== tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
