#!/usr/bin/env bash
# Session 2, second device call: GPU tests (fused qkv prologue, skinny GEMM, run-ahead), then the
# full one-call benchmark (ceilings, correctness incl. fp32 at the 8B width, graphs, B1, OFF, step
# profile, SERVE, kernels, transformers peer) on the Qwen3-8B shape.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
python3 -c "import ext; print('compiled:', {m: ext.is_compiled(m) for m in ('step_inputs', 'repetition', 'penalties', 'stop_strings', 'bitmask')})" | tee $OUT/gpu_tests.txt
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/ext tests/pipeline 2>&1 | tail -8 | tee -a $OUT/gpu_tests.txt
timeout 490 python3 bench/gpu.py --commit "$1" --budget-s 470 --serve-args "--max-num-batched-tokens 2048" 2>&1 | tee $OUT/gpu_bench.log | grep -v "shards\|it/s"
