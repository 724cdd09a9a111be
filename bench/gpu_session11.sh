#!/usr/bin/env bash
# Session 11: session 5's GPU tests after more of the host path was compiled (sender streams and
# rounds, detokenize rows, sampling rows, the step's grammar plan), with their CPU tests run there too.
bash "$(dirname "$0")/gpu_session5.sh" tests/ext/test_text_delta_sink.py tests/ext/test_socket_send.py \
    tests/ext/test_detokenize_rows.py tests/ext/test_sampling_rows.py tests/ext/test_grammar_rows.py \
    tests/ext/test_grammar_step.py tests/web/test_socket_sender.py tests/web/test_socket_sender_failures.py \
    tests/pipeline/test_output_channel.py tests/pipeline/runner
PYTHONPATH=/tmp/site python3 -c "import ext; print({m: ext.is_compiled(m) for m in ('text_delta_sink', 'socket_send', 'detokenize_rows', 'sampling_rows', 'grammar_rows', 'grammar_step')})" | tee $OUT/compiled11.txt
