#!/usr/bin/env bash
# Session 6: session 5's GPU tests after the runner's host staging (reused host buffers for the
# sampling inputs and the grammar bitmask; on CUDA the bitmask's pageable buffer is the staging's),
# with the staging's CPU tests run there too.
exec bash "$(dirname "$0")/gpu_session5.sh" tests/pipeline/runner/test_host_staging.py
