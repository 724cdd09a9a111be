#!/usr/bin/env bash
# Session 10: session 5's GPU tests after the streamed text delta went through one compiled call
# (ext/text_delta_sink, sse_text.text_event_chunk), with their CPU tests run there too.
bash "$(dirname "$0")/gpu_session5.sh" tests/ext/test_text_delta_sink.py tests/ext/test_sse_text.py \
    tests/ext/test_byte_detokenizer.py tests/ext/test_grammar_step.py tests/web/test_socket_sender.py
PYTHONPATH=/tmp/site python3 -c "import ext; print({m: ext.is_compiled(m) for m in ('text_delta_sink', 'sse_text', 'byte_detokenizer', 'grammar_step')})" | tee $OUT/compiled10.txt
