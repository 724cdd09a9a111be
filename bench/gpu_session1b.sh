#!/usr/bin/env bash
# Second device call (2026-11-22): the model on CUDA now runs the Triton kernels; check CPU==GPU greedy on the
# tiny model and time the SmolLM2-shaped model with Triton vs the torch-reference path.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
timeout 280 python3 bench/gpu_smoke.py --tokenizer .peer/tokenizer --out $OUT/gpu_smoke_triton.json 2>&1 | grep -v shards
CONVEYOR_DISABLE_TRITON=1 timeout 200 python3 bench/gpu_smoke.py --tokenizer .peer/tokenizer --out $OUT/gpu_smoke_ref.json 2>&1 | grep -v shards
