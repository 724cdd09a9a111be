#!/usr/bin/env bash
# Session 2, first device call: GPU tests (run-ahead on CUDA), correctness incl. fp32 at the 8B width,
# graphs == eager, B1/OFF with run-ahead, and the decode step profile.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
timeout 420 python3 bench/gpu.py --commit "$1" --budget-s 400 --skip serve kernels peer 2>&1 | tee $OUT/gpu_bench.log | grep -v "shards\|it/s"
