"""The tests whose result can depend on the CPU's vector instruction set, marked `isa` (tests/conftest.py).

Each compares bits, or tokens that rest on float ties, between two sides that may take different arithmetic paths
(a batch against its rows, a whole prompt against its chunks, verify rows against one-token decode rows, this
engine against transformers): ATen's vectorized loops, MKL, oneDNN, numpy and its OpenBLAS (the Triton
interpreter's arithmetic) pick their kernels by instruction set, and a kernel of another width rounds a sum or a
tensor's tail differently. `make test-avx2` runs these again with every one of those libraries pinned to AVX2, so a
machine with AVX-512 also sees what an AVX2-only machine would. Comparisons where both sides run the same kernels
in the same order (copies, cache writes, graph replay against eager, the CPU dispatch against its own reference)
cannot change with the instruction set and are not listed.
"""
from __future__ import annotations

ISA_SENSITIVE: tuple[str, ...] = (
    # references run over a whole row against the row cut short (elementwise tails)
    "tests/kernels/test_gdn_keep.py::test_gdn_reference_keep_equals_prefix_run",
    "tests/kernels/test_gdn_keep.py::test_conv_reference_keep_equals_prefix_run",
    # interpreter kernels: a batch's rows against each row alone (numpy under the interpreter)
    "tests/kernels/test_triton_gdn.py::test_decode_batch_equals_each_sequence_alone",
    "tests/kernels/test_triton_gemv.py::test_row_loop_gives_each_row_its_one_row_bits[16-64-300-dtype0]",
    # the routing kernel's experts against the reference's, ties included (a flipped tie is another expert)
    "tests/kernels/test_moe_routing.py::test_wide_and_large_k",
    "tests/kernels/test_moe_routing.py::test_ties_go_to_the_lower_expert",
    "tests/kernels/test_moe_routing.py::test_ties_in_rounded_bf16_logits",
    "tests/kernels/test_moe_routing.py::test_shared_expert_slot",
    # the models against transformers, batches against their rows, chunks against whole prompts
    "tests/pipeline/models/test_llama_parity.py::test_parity_with_transformers",
    "tests/pipeline/models/test_llama_parity.py::test_chunked_prefill_equals_unchunked",
    "tests/pipeline/models/test_llama_parity.py::test_batch_of_mixed_lengths_equals_each_alone",
    "tests/pipeline/models/test_qwen3_moe.py::test_parity_with_transformers",
    "tests/pipeline/models/test_qwen3_moe.py::test_batch_invariance",
    "tests/pipeline/models/test_qwen3_next.py::test_parity_with_transformers_chunked",
    "tests/pipeline/models/test_qwen3_next.py::test_batched_equals_alone",
    "tests/pipeline/test_engine.py::test_batch_of_8_equals_each_alone",
    "tests/pipeline/test_engine.py::test_chunked_prefill_equals_unchunked",
    "tests/pipeline/test_engine.py::test_same_seed_same_output_alone_or_batched",
    "tests/pipeline/test_engine.py::test_a_prompt_arriving_while_others_decode_joins_their_steps_and_changes_no_tokens",
    "tests/pipeline/test_engine_hybrid.py::test_alone_batched_and_chunked_equal_transformers",
    # the prefix cache: a hit (computed in other steps) against computing the prompt
    "tests/pipeline/test_engine_prefix_cache.py::test_cache_on_equals_cache_off_and_hits_where_it_should",
    # speculation is exact in fp32 on the CPU: verify rows against plain decoding, token for token
    "tests/pipeline/spec/test_engine_speculation.py::test_greedy_equals_plain_decoding",
    "tests/pipeline/spec/test_engine_speculation.py::test_seeded_sampling_equals_plain_decoding",
    "tests/pipeline/spec/test_engine_speculation.py::test_long_accepted_runs_and_rejections_anywhere_equal_plain_decoding[0.0]",
    "tests/pipeline/spec/test_engine_speculation.py::test_hybrid_model_takes_back_a_kept_state_after_a_rejection[0.0]",
)


def is_isa_sensitive(nodeid: str) -> bool:
    """A listed test, a parametrization of one, or a test of a listed file."""
    return any(_matches(name, nodeid) for name in ISA_SENSITIVE)


def _matches(name: str, nodeid: str) -> bool:
    return nodeid == name or nodeid.startswith(name + ("::" if name.endswith(".py") else "["))


def unmatched(nodeids: list[str]) -> list[str]:
    """Listed names that match none of the collected tests of their file (a renamed test would leave the AVX2 run
    without it); files not collected in this run are not judged."""
    files = {nodeid.split("::")[0] for nodeid in nodeids}
    return [name for name in ISA_SENSITIVE if name.split("::")[0] in files
            and not any(_matches(name, n) for n in nodeids)]
