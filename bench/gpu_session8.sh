#!/usr/bin/env bash
# Session 8: session 5's GPU tests after a step's grammar accepts and fill went into one GIL release
# (ext/grammar_step, built against tvm-ffi from the carried wheels), with its CPU tests run there too.
bash "$(dirname "$0")/gpu_session5.sh" tests/ext/test_grammar_step.py tests/pipeline/runner/test_host_staging.py
PYTHONPATH=/tmp/site python3 -c "import ext; print('grammar_step compiled:', ext.is_compiled('grammar_step'))" | tee $OUT/grammar_step.txt
