#!/usr/bin/env bash
# Third device call (2026-11-22): CUDA graphs for decode. Tiny model: CPU == GPU graphs == GPU eager greedy;
# SmolLM2-shaped random bf16 model: batch 1 and 16 with graphs vs eager.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
timeout 400 python3 bench/gpu_smoke.py --tokenizer .peer/tokenizer --out $OUT/gpu_smoke_graphs.json 2>&1 | grep -v shards
