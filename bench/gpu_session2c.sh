#!/usr/bin/env bash
# Session 2, third device call: the GPU tests after the truncation kernel joined the logits
# pipeline, and the kernel against sorting at S = 1, 64, 256 (V = 151936).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -rA tests/kernels tests/ext tests/pipeline 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -60 | tee $OUT/gpu_tests.txt
python3 - <<'PY' | tee $OUT/cutoff.json
import json
from kernels.triton_sampling import bench_cutoff
print(json.dumps([bench_cutoff(s) for s in (1, 64, 256)], indent=1))
PY
