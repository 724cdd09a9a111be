#!/usr/bin/env bash
# Session 9: session 5's GPU tests after the event loop's per-token work went compiled
# (ext/byte_detokenizer, ext/sse_text), with their CPU tests run there too; then, where the image has
# uvloop and aiohttp, the host bench (null device) on that machine's CPU: on 2 of its cores, and on all.
bash "$(dirname "$0")/gpu_session5.sh" tests/ext/test_byte_detokenizer.py tests/ext/test_sse_text.py \
    tests/pipeline/test_detokenizer_bytes.py tests/web/test_socket_sender.py tests/ext/test_grammar_step.py
PYTHONPATH=/tmp/site python3 -c "import ext; print({m: ext.is_compiled(m) for m in ('byte_detokenizer', 'sse_text', 'grammar_step')})" | tee $OUT/compiled9.txt
if PYTHONPATH=/tmp/site python3 -c "import uvloop, aiohttp" 2>/dev/null; then
  for cores in "0,1" "all"; do
    pin=(); [ "$cores" != all ] && pin=(taskset -c "$cores")
    PYTHONPATH=/tmp/site timeout 120 "${pin[@]}" python3 bench/host_overhead.py --batch 256 --tokens 256 --http --grammar \
      --out "$OUT/host-overhead-h100-cores-${cores/,/-}.json" 2>&1 | grep -E "batch 256|Error" | tee -a $OUT/host_bench.txt
  done
else
  echo "no uvloop/aiohttp on this image: host bench skipped" | tee $OUT/host_bench.txt
fi
