"""The verify primitive: one forward over a row of K+1 tokens with logits at all K+1 positions equals
K+1 single-token steps (logits within fp32 tolerance, the same greedy tokens), alone and beside a
decode row and a prefill chunk in the same step. The speculative verify stage builds on it."""
from __future__ import annotations

import pytest
import torch

from pipeline.request import SamplingParams
from pipeline.runner.model_runner import ModelRunner
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
from tests.model_utils import SMOLLM2_VOCAB, conveyor_from_hf, make_tiny_hf_model

BLOCK = 4
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def greedy_rows(count: int) -> list[SamplingRow]:
    return [SamplingRow(GREEDY, [], [], frozenset(), seed=0, counter=0) for _ in range(count)]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    model = conveyor_from_hf(make_tiny_hf_model("qwen3", seed=5))
    runner = ModelRunner(model, vocab_size=SMOLLM2_VOCAB, block_size=BLOCK, dtype=torch.float32,
                         device=torch.device("cpu"))
    runner.allocate_caches(64)
    return runner


def blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


def step(runner: ModelRunner, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
    """(logits [S, V], greedy tokens) of one step."""
    plan = build_step_plan(chunks, BLOCK)
    logits = runner.compute_logits(plan.forward).clone()
    return logits, runner.execute(plan).token_ids.tolist()


def prefill(runner: ModelRunner, prompt: list[int], table: list[int]) -> int:
    """Cache the prompt; returns its greedy next token."""
    return step(runner, [ScheduledChunk(prompt, 0, table, greedy_rows(1))])[1][0]


def single_steps(runner: ModelRunner, prompt: list[int], table: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode of k+1 tokens one per step: (the tokens fed, the logits of each step [k+1, V])."""
    token = prefill(runner, prompt, table)
    fed, logits = [], []
    for i in range(k + 1):
        fed.append(token)
        step_logits, tokens = step(runner, [ScheduledChunk([token], len(prompt) + i, table, greedy_rows(1))])
        logits.append(step_logits[0])
        token = tokens[0]
    return fed, torch.stack(logits)


PROMPT = [11, 523, 87, 4100, 9, 77, 1290, 3, 8000, 45, 612]
OTHER = [301, 302, 303, 304, 305, 306, 307]
NEW_PROMPT = [900, 901, 902, 903, 904, 905, 906, 907, 908]


@pytest.mark.parametrize("k", range(1, 8))
def test_k_plus_one_tokens_in_one_row_equal_k_plus_one_single_steps(runner: ModelRunner, k: int) -> None:
    table = blocks(1, len(PROMPT) + k + 1)
    fed, expected = single_steps(runner, PROMPT, table, k)

    verify_table = blocks(20, len(PROMPT) + k + 1)  # a fresh copy of the prompt's cache
    prefill(runner, PROMPT, verify_table)
    logits, tokens = step(runner, [ScheduledChunk(fed, len(PROMPT), verify_table, greedy_rows(k + 1),
                                                  logits_offsets=list(range(k + 1)))])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == fed[1:] + [int(expected[-1].argmax())]  # each position picks the next fed token


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_verify_row_beside_a_decode_row_and_a_prefill_chunk(runner: ModelRunner, k: int) -> None:
    table = blocks(1, len(PROMPT) + k + 1)
    fed, expected = single_steps(runner, PROMPT, table, k)
    other_table = blocks(20, len(OTHER) + 1)
    other_token = prefill(runner, OTHER, other_table)
    other_logits, _ = step(runner, [ScheduledChunk([other_token], len(OTHER), other_table, greedy_rows(1))])
    new_logits, _ = step(runner, [ScheduledChunk(NEW_PROMPT, 0, blocks(30, len(NEW_PROMPT)), greedy_rows(1))])

    verify_table = blocks(40, len(PROMPT) + k + 1)
    prefill(runner, PROMPT, verify_table)
    other_again = blocks(50, len(OTHER) + 1)
    prefill(runner, OTHER, other_again)
    logits, tokens = step(runner, [
        ScheduledChunk([other_token], len(OTHER), other_again, greedy_rows(1)),  # a decode row
        ScheduledChunk(fed, len(PROMPT), verify_table, greedy_rows(k + 1), logits_offsets=list(range(k + 1))),
        ScheduledChunk(NEW_PROMPT, 0, blocks(56, len(NEW_PROMPT)), greedy_rows(1)),  # a whole prompt
    ])
    torch.testing.assert_close(logits[0], other_logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:k + 2], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[k + 2], new_logits[0], atol=1e-4, rtol=1e-4)
    assert tokens[1:k + 2] == fed[1:] + [int(expected[-1].argmax())]


def test_a_verify_row_fed_from_the_previous_step_on_the_device(runner: ModelRunner) -> None:
    """The first token of a multi-token row may be one the previous step left on the device."""
    k = 3
    table = blocks(1, len(PROMPT) + k + 1)
    fed, expected = single_steps(runner, PROMPT, table, k)
    verify_table = blocks(20, len(PROMPT) + k + 1)
    previous = runner.launch(build_step_plan([ScheduledChunk(PROMPT, 0, verify_table, greedy_rows(1))], BLOCK))
    placeholder = [0] + fed[1:]
    plan = build_step_plan([ScheduledChunk(placeholder, len(PROMPT), verify_table, greedy_rows(k + 1), previous_row=0,
                                           logits_offsets=list(range(k + 1)))], BLOCK)
    logits = runner.compute_logits(plan.forward, previous.token_ids)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
