#!/usr/bin/env bash
# Session 5: the GPU tests after the grammar matchers moved to the device thread (batched accepts,
# CUDA graphs with run-ahead included). Extra arguments: more CPU test paths to run there too.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || exit 1
python3 -c "import ext; print({m: ext.is_compiled(m) for m in ('bitmask', 'step_inputs', 'penalties')})" | tee $OUT/compiled.txt
timeout 400 python3 -m pytest -p no:cacheprovider -m gpu -rA tests/kernels tests/ext tests/pipeline 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|skipped" | tail -60 | tee $OUT/gpu_tests.txt
timeout 120 python3 -m pytest -p no:cacheprovider -q tests/pipeline/grammar tests/ext/test_bitmask.py "$@" 2>&1 | tail -5 | tee $OUT/grammar_cpu_tests.txt
