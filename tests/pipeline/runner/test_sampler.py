"""Sampler: greedy and filtered picks, stateless reproducible randomness, raw logprobs, one pipeline."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.request import SamplingParams as P
from pipeline.runner import sampler as sampler_module
from pipeline.runner.logits_pipeline import apply_logits_pipeline
from pipeline.runner.sampler import Sampler, gumbel_noise
from pipeline.runner.sampling_batch import SamplingBatch, SamplingRow

CPU = torch.device("cpu")
V = 1000


def row(params: P, seed: int = 0, counter: int = 0, prompt=(), output=(), eos=frozenset()) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), frozenset(eos), seed, counter)


def sample(rows: list[SamplingRow], logits: torch.Tensor):
    return Sampler()(logits, SamplingBatch.from_rows(rows, logits.shape[1], CPU))


def randn(s: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(s, v, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_of_processed_logits():
    logits = randn(4)
    rows = [row(P(temperature=0.0)), row(P(temperature=0.0, top_k=7, top_p=0.3)),
            row(P(temperature=0.0, logit_bias={5: 100.0})),
            row(P(temperature=0.0, repetition_penalty=1e6), prompt=[int(logits[3].argmax())])]
    out = sample(rows, logits)
    assert out.token_ids.dtype == np.int64
    assert out.token_ids[:2].tolist() == logits[:2].argmax(-1).tolist()
    assert out.token_ids[2] == 5
    assert out.token_ids[3] == int(logits[3].topk(2).indices[1])  # the penalized argmax moved


@pytest.mark.parametrize("params", [P(top_k=1), P(temperature=1.5, top_p=1e-6), P(min_p=1.0)],
                         ids=["top_k=1", "tiny_top_p", "min_p=1"])
def test_filters_that_keep_only_the_top_token(params):
    logits = randn(16)
    out = sample([row(params, seed=i) for i in range(16)], logits)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_draws_stay_inside_the_filters():
    logits = randn(1, 50).expand(400, 50).contiguous()
    rows = [row(P(top_k=5, min_p=0.0), seed=i) for i in range(200)]
    rows += [row(P(min_p=0.3), seed=i) for i in range(200)]
    tokens = sample(rows, logits).token_ids
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(tokens[:200].tolist()) <= top5 and len(set(tokens[:200].tolist())) > 1
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(tokens[200:].tolist()) <= allowed


def test_min_tokens_holds_back_eos_in_sampling():
    logits = torch.zeros(64, 10)
    logits[:, 2] = 50.0  # eos is overwhelmingly likely
    rows = [row(P(min_tokens=4), seed=i, output=[3] * (i % 6), eos={2}) for i in range(64)]
    tokens = sample(rows, logits).token_ids
    for i, token in enumerate(tokens):
        assert (token == 2) == (i % 6 >= 4)


def test_same_seed_and_counter_same_token_in_any_batch():
    logits = randn(1)
    target = P(temperature=1.0, top_k=200, top_p=0.95)
    for seed, counter in [(0, 0), (7, 3), (2**40 + 5, 12345), (-3, 1)]:
        alone = sample([row(target, seed, counter)], logits).token_ids[0]
        for position in (0, 7, 15):
            gen = torch.Generator().manual_seed(seed % 1000 + position)
            neighbours = randn(16, seed=seed % 1000 + position + 1)
            neighbours[position] = logits[0]
            temps = (torch.rand(16, generator=gen) * 2).tolist()
            ks = torch.randint(0, 50, (16,), generator=gen).tolist()
            seeds = torch.randint(0, 10**6, (16,), generator=gen).tolist()
            rows = [row(P(temperature=temps[j], top_k=ks[j]), seed=seeds[j], counter=j) for j in range(16)]
            rows[3] = row(P(temperature=0.0))
            rows[position] = row(target, seed, counter)
            assert sample(rows, neighbours).token_ids[position] == alone


def test_different_counters_and_seeds_give_different_draws():
    flat = torch.zeros(1, V)
    by_counter = {int(sample([row(P(), 42, c)], flat).token_ids[0]) for c in range(50)}
    by_seed = {int(sample([row(P(), s, 0)], flat).token_ids[0]) for s in range(50)}
    assert len(by_counter) > 40 and len(by_seed) > 40


def test_noise_is_gumbel_and_depends_only_on_key():
    keys = torch.tensor([[1, 2], [3, 4], [1, 2]])
    noise = gumbel_noise(keys, 50_000)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772) < 0.02  # Euler-Mascheroni
    assert abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.02


def chi_square(tokens: np.ndarray, probs: torch.Tensor) -> float:
    counts = np.bincount(tokens, minlength=probs.numel())
    expected = probs.double().numpy() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing drawn outside the support
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


@pytest.mark.parametrize("params, expected", [
    (P(temperature=1.0), lambda x: x.softmax(-1)),
    (P(temperature=0.5, top_k=4), lambda x: torch.where(x >= x.topk(4).values[-1], x / 0.5, -math.inf).softmax(-1)),
])
def test_sampling_matches_softmax_statistically(params, expected):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    draws = 6000
    rows = [row(params, seed=i // 3, counter=i % 3) for i in range(draws)]
    tokens = sample(rows, logits.expand(draws, 8).contiguous()).token_ids
    # fixed seeds: deterministic; 7 degrees of freedom, 0.999 quantile is 24.3
    assert chi_square(tokens, expected(logits)) < 24.3


def test_logprobs_are_raw_log_softmax():
    logits = randn(5)
    raw = torch.log_softmax(logits, -1)
    rows = [row(P(temperature=0.7, top_k=30, logprobs=5, repetition_penalty=1.5), seed=1, prompt=[1, 2, 3]),
            row(P(temperature=0.0, logprobs=2, logit_bias={9: 50.0})),
            row(P(logprobs=0), seed=2),
            row(P(logprobs=None), seed=3),
            row(P(temperature=0.0, logprobs=20))]
    out = sample(rows, logits)
    assert out.logprobs.dtype == np.float32 and out.top_ids.shape == (5, 20)
    expected_top = raw.topk(20, -1)
    np.testing.assert_allclose(out.top_logprobs, expected_top.values.numpy(), rtol=1e-6)
    assert out.top_ids.tolist() == expected_top.indices.tolist()
    assert (np.diff(out.top_logprobs, axis=1) <= 0).all()  # best first
    chosen = raw.gather(1, torch.from_numpy(out.token_ids)[:, None]).squeeze(1)
    np.testing.assert_allclose(out.logprobs, chosen.numpy(), rtol=1e-6)
    assert out.token_ids[1] == 9  # biased, but its logprob is still the raw one
    first = out.token_logprob(0)
    assert first.token_id == out.token_ids[0] and len(first.top) == 5
    assert [t for t, _ in first.top] == expected_top.indices[0, :5].tolist()
    assert len(out.token_logprob(1).top) == 2
    zero = out.token_logprob(2)
    assert zero.top == [] and zero.logprob == pytest.approx(float(chosen[2]))
    assert out.token_logprob(3) is None


def test_no_logprobs_requested():
    out = sample([row(P()), row(P(temperature=0.0))], randn(2))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert out.token_logprob(0) is None


def test_only_zero_alternatives_requested():
    out = sample([row(P(logprobs=0)), row(P())], randn(2))
    assert out.logprobs is not None and out.top_ids is None
    assert out.token_logprob(0).top == [] and out.token_logprob(1) is None


def test_sampler_goes_through_the_pipeline(monkeypatch):
    calls = []

    def spy(logits, batch):
        calls.append(batch)
        return apply_logits_pipeline(logits, batch)

    monkeypatch.setattr(sampler_module, "apply_logits_pipeline", spy)
    rows = [row(P(temperature=0.0, logit_bias={3: 1e4})), row(P(min_tokens=1), eos={4})]
    logits = torch.zeros(2, 8)
    logits[1, 4] = 1e4
    out = Sampler()(logits, SamplingBatch.from_rows(rows, 8, CPU))
    assert len(calls) == 1 and calls[0].num_rows == 2
    assert out.token_ids[0] == 3 and out.token_ids[1] != 4  # the pipeline's edits decided the tokens


def test_device_sample_keeps_tokens_on_device_until_to_host():
    rows = [row(P(logprobs=1), seed=5), row(P(temperature=0.0))]
    logits = randn(2)
    device_sample = Sampler().sample(logits, SamplingBatch.from_rows(rows, V, CPU))
    assert isinstance(device_sample.token_ids, torch.Tensor)
    out = device_sample.to_host()
    assert out.token_ids.tolist() == device_sample.token_ids.tolist()


def test_half_precision_logits_and_empty_batch():
    logits = randn(3).to(torch.bfloat16)
    out = sample([row(P(temperature=0.0, logprobs=1)) for _ in range(3)], logits)
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    empty = sample([], torch.zeros(0, V))
    assert empty.token_ids.shape == (0,) and empty.logprobs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_greedy_rows_take_the_greedy_kernels(monkeypatch):
    """On the GPU, a greedy batch without logprobs is picked by kernels/triton_greedy.py: the tokens equal torch's
    argmax of the processed logits (logit_bias included), over several calls; asking for logprobs takes the torch
    path (the kernels are not called)."""
    calls: list[int] = []
    logits = (torch.randn(5, 151936, generator=torch.Generator().manual_seed(3)) * 2).cuda()
    rows = [row(P(temperature=0.0)), row(P(temperature=0.0, logit_bias={5: 100.0}))] + [row(P(temperature=0.0))] * 3
    sampler = Sampler()
    original = sampler._greedy.__class__.__call__
    monkeypatch.setattr(sampler._greedy.__class__, "__call__", lambda self, x: calls.append(1) or original(self, x))
    for step in range(3):
        batch = SamplingBatch.from_rows(rows, logits.shape[1], torch.device("cuda"))
        out = sampler(logits + step, batch)
        expected = apply_logits_pipeline(logits + step, batch).argmax(-1).tolist()
        assert out.token_ids.tolist() == expected and out.token_ids[1] == 5
    assert len(calls) == 3
    logprob_rows = [row(P(temperature=0.0, logprobs=2))] * 2
    out = sampler(logits[:2], SamplingBatch.from_rows(logprob_rows, logits.shape[1], torch.device("cuda")))
    assert out.token_ids.tolist() == logits[:2].argmax(-1).tolist() and len(calls) == 3
