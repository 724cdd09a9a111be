#!/usr/bin/env bash
# Fourth device call (2026-11-22): the full one-call benchmark on the Qwen3-8B shape.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
timeout 560 python3 bench/gpu.py --commit "$1" --budget-s 520 --serve-args "--max-num-batched-tokens 2048" 2>&1 | tee $OUT/gpu_bench.log | grep -v "shards\|it/s"
