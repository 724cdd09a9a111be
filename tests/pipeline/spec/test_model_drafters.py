"""The model drafters (pipeline/spec/): the MTP head against transformers' layer on the same weights, its drafts
against the head recomputed from scratch after every step, and both drafters through the engine, where the output
equals plain decoding and a draft model that is the target itself (the oracle) has every draft accepted."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from pipeline.engine import Engine
from pipeline.models.attention import build_attention_metadata
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext
from pipeline.models.loader import iter_weights, load_hf_config
from pipeline.models.registry import build_model
from pipeline.request import SamplingParams
from pipeline.runner.model_runner import ModelRunner
from pipeline.models.attention import AttentionMetadata
from pipeline.models.forward_context import allocate_caches
from pipeline.spec.draft_model import DraftModelDrafter
from pipeline.spec.model_drafts import DraftGraphs
from pipeline.spec.mtp import MtpDrafter, _HeadInput
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.model_utils import add_mtp_weights, make_tiny_hf_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

HYBRID = "qwen3_5_moe_text"


@pytest.fixture(scope="module")
def mtp_dir(make_model_dir):
    directory = make_model_dir(HYBRID, seed=5)
    add_mtp_weights(directory, HYBRID, seed=5)
    return directory


def load_with_mtp(directory) -> tuple[torch.nn.Module, ModelRunner]:
    arch = ModelArchConfig.from_hf(load_hf_config(str(directory)))
    model = build_model(arch, iter_weights(str(directory)), torch.float32, "cpu", mtp=True)
    runner = ModelRunner(model, vocab_size=arch.vocab_size, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), max_num_seqs=2)
    runner.allocate_caches(32)
    return model, runner


def test_mtp_head_equals_transformers_layer_with_the_fc_and_norms(mtp_dir):
    """The head's forward over a sequence: the two zero-centred norms, fc over [embedding, hidden], transformers'
    own decoder layer (gated attention, MoE), the final norm; fp32."""
    model, runner = load_with_mtp(mtp_dir)
    weights = dict(iter_weights(str(mtp_dir)))
    donor = make_tiny_hf_model(HYBRID, seed=1005)
    layer = donor.model.layers[list(donor.config.layer_types).index("full_attention")]
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in weights.items() if k.startswith("mtp.layers.0.")})
    eps = donor.config.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weights[f"mtp.{name}.weight"])

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40000, (9,), generator=gen)
    hidden = torch.randn(9, donor.config.hidden_size, generator=gen)
    positions = torch.arange(9)
    x = torch.cat([norm(model.model.embed_tokens(tokens), "pre_fc_norm_embedding"),
                   norm(hidden, "pre_fc_norm_hidden")], -1) @ weights["mtp.fc.weight"].T
    cos_sin = donor.model.rotary_emb(x[None], positions[None])
    mask = torch.full((9, 9), -math.inf).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions[None])
    expected = norm(out[0] if isinstance(out, tuple) else out[0], "norm")
    meta = build_attention_metadata([9], [9], [[1, 2, 3]], 4)
    kv = runner.caches[model.hidden_cache_index - 1]
    got = model.mtp_forward(tokens, positions, hidden, ForwardContext(meta, [kv]))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class EagerReplay:
    """DecodeGraphs' interface, run eagerly on the CPU: the drafters' replayed path (uniform rows, fed picks, the
    head's carried hidden states) without CUDA."""

    def __init__(self, model, caches: list[torch.Tensor], max_query_len: int) -> None:
        self.model, self.caches, self.max_query_len = model, caches, max_query_len
        self.replays = 0

    def fits(self, batch: int, query_len: int, blocks: int) -> bool:
        return query_len <= self.max_query_len

    def run(self, batch, feed) -> torch.Tensor:
        self.replays += 1
        ids = torch.from_numpy(batch.input_ids.copy())
        if feed is not None:
            feed.apply(ids)
        rows = len(batch.seq_lens)
        q = batch.num_tokens // rows
        meta = AttentionMetadata(torch.from_numpy(batch.slot_mapping), torch.from_numpy(batch.query_start_loc),
                                 torch.from_numpy(batch.seq_lens), torch.from_numpy(batch.block_tables),
                                 batch.query_start_loc.tolist(), batch.seq_lens.tolist(), q,
                                 int(batch.seq_lens.max()), q == 1)
        return self.model.compute_logits(self.model(ids, torch.from_numpy(batch.positions),
                                                    ForwardContext(meta, self.caches)))


def replayed_mtp(drafter: MtpDrafter, model, runner) -> tuple[EagerReplay, EagerReplay]:
    size = model.arch.hidden_size
    carried, hidden_out = torch.zeros(8, size), torch.zeros(8 * 4, size)
    kv = [runner.caches[drafter.hidden_index - 1]]
    first = EagerReplay(_HeadInput(model, runner.caches[drafter.hidden_index], carried, hidden_out), kv, 4)
    step = EagerReplay(_HeadInput(model, None, carried, hidden_out), kv, 1)
    drafter.graphs = DraftGraphs(first, step, carried, hidden_out)
    return first, step


@pytest.mark.parametrize("replayed", [False, True])
def test_mtp_drafts_equal_the_head_recomputed_from_scratch(mtp_dir, replayed):
    """Two rounds of drafting on a sequence whose target forwards write the hidden-state cache: each round's drafts
    equal the head run from position 0 without caches, on the target's hidden states and then its own. Replayed:
    the forwards go the way of the CUDA graphs (the first one's rows of K + 1 positions start before the unseen
    ones), run eagerly."""
    model, runner = load_with_mtp(mtp_dir)
    drafter = MtpDrafter(model, runner, 4)
    replays = replayed_mtp(drafter, model, runner) if replayed else ()
    seq = SimpleNamespace(token_ids=[7, 300, 4000, 51, 9000, 12, 613], block_ids=[1, 2, 3, 4, 5], preemptions=0,
                          draft_history=None)
    states = torch.zeros(1, dtype=torch.int32) + 1
    hidden_so_far: list[torch.Tensor] = []

    def target(start: int, end: int) -> None:  # the target feeds positions start .. end - 1
        meta = build_attention_metadata([end - start], [end], [seq.block_ids], 4)
        ids = torch.tensor(seq.token_ids[start:end])
        hidden_so_far.append(model(ids, torch.arange(start, end), ForwardContext(meta, runner.caches,
                                                                                state_slots=states)))

    def reference(k: int) -> list[int]:
        tokens = list(seq.token_ids)
        hidden = torch.cat(hidden_so_far)[:len(tokens) - 1]
        drafts: list[int] = []
        for _ in range(k):
            n = len(hidden)
            kv = torch.zeros_like(runner.caches[model.hidden_cache_index - 1])
            meta = build_attention_metadata([n], [n], [list(range(1, 1 + -(-n // 4)))], 4)
            out = model.mtp_forward(torch.tensor(tokens[1:n + 1]), torch.arange(n), hidden, ForwardContext(meta, [kv]))
            drafts.append(int(model.compute_logits(out[-1:]).argmax()))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts

    target(0, len(seq.token_ids) - 1)  # the prompt but its last token (decode feeds that)
    first = drafter.draft(drafter.plan([(seq, 3)]))[0]
    assert first == reference(3)
    seq.token_ids += [first[0], 77]  # one draft accepted, then another token
    target(6, 8)  # the verify row's positions that were kept
    second = drafter.draft(drafter.plan([(seq, 3)]))[0]
    assert second == reference(3) and seq.draft_history.seen == len(seq.token_ids) - 1
    if replayed:  # the first round's first forward was too long to replay; the second's was not
        assert replays[0].replays == 1 and replays[1].replays == 4
    seq.token_ids += [second[0], 5, 6, 7, 8, 9]  # a longer gap: the first forward feeds 6 positions
    target(8, 14)
    third = drafter.draft(drafter.plan([(seq, 3)]))[0]
    assert third == reference(3)
    if replayed:  # as two replays of rows of 4 positions (the first two seen already)
        assert replays[0].replays == 3 and replays[1].replays == 6


@pytest.mark.parametrize("replayed", [False, True])
def test_the_target_as_draft_model_drafts_its_greedy_continuation(tiny_model_dir, replayed):
    """A draft model that is the target drafts what the target picks, batch of two sequences of different lengths,
    after drafts partly accepted (its cache of the accepted ones kept, of the rest written over)."""
    arch = ModelArchConfig.from_hf(load_hf_config(str(tiny_model_dir)))
    model = build_model(arch, iter_weights(str(tiny_model_dir)), torch.float32, "cpu")
    runner = SimpleNamespace(caches=[], device=torch.device("cpu"))
    runner.caches = allocate_caches(model.cache_specs(torch.float32) * 2, 40, 4)
    drafter = DraftModelDrafter(model, runner, arch.num_layers, 4)
    replay = EagerReplay(model, runner.caches[arch.num_layers:], 5)
    if replayed:
        drafter.graphs = DraftGraphs(replay, replay)

    def greedy_after(tokens: list[int], k: int) -> list[int]:
        out = list(tokens)
        for _ in range(k):
            n = len(out)
            meta = build_attention_metadata([n], [n], [list(range(1, 1 + -(-n // 4)))], 4)
            caches = allocate_caches(model.cache_specs(torch.float32), 1 + -(-n // 4), 4)
            hidden = model(torch.tensor(out), torch.arange(n), ForwardContext(meta, caches))
            out.append(int(model.compute_logits(hidden[-1:]).argmax()))
        return out[len(tokens):]

    seqs = [SimpleNamespace(token_ids=[5 + i, 900, 31, 4000 + i, 77, 12][:4 + i], block_ids=list(range(1 + 9 * i,
            10 + 9 * i)), preemptions=0, draft_history=None) for i in range(2)]
    drafts = drafter.draft(drafter.plan([(s, 4) for s in seqs]))
    assert drafts == [greedy_after(s.token_ids, 4) for s in seqs]
    seqs[0].token_ids += drafts[0][:2] + [99]  # two accepted, then another token
    seqs[1].token_ids += [drafts[1][0] + 1]  # none accepted
    assert [s.draft_history.computed(s.token_ids) for s in seqs] == [6, 5]
    drafts = drafter.draft(drafter.plan([(s, 4) for s in seqs]))
    assert drafts == [greedy_after(s.token_ids, 4) for s in seqs]
    if replayed:  # the first round: the first forward eager (a row shorter than the longest run), then replays
        assert replay.replays == 3 + 4


def greedy(max_tokens: int = 200, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


async def run(model_dir, batch: list[list[int]], params: list[SamplingParams], groups: int = 1,
              **overrides) -> tuple[list, dict]:
    """Each sample's tokens (the batch in ``groups`` waves: a later wave meets the earlier ones' cached prefixes)."""
    engine = await Engine.create(config_for(model_dir, **overrides))
    try:
        results, size = [], -(-len(batch) // groups)
        for first in range(0, len(batch), size):
            results += await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                              for p, q in zip(batch[first:first + size], params[first:first + size])])
        await settle(engine)
        assert_no_leaks(engine)
        return [[s.token_ids for s in r] for r in results], engine.stats()
    finally:
        await engine.shutdown()


def prompts(count: int, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randint(100, 40000, (length + i,), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_mtp_speculation_equals_plain_decoding(mtp_dir, batch_size):
    batch = prompts(batch_size)
    params = [greedy() for _ in batch]
    plain, _ = run_async(run(mtp_dir, batch, params))
    spec, stats = run_async(run(mtp_dir, batch, params, speculative_method="mtp", num_speculative_tokens=3))
    assert spec == plain
    counted = stats["speculation"]
    assert counted["method"] == "mtp" and counted["drafted_tokens"] > 0
    assert counted["device_drafts"] > 0  # verify rows fed the drafts on the device


@pytest.fixture(scope="module")
def draft_dir(make_model_dir):
    return make_model_dir("llama", seed=11)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_draft_model_speculation_equals_plain_decoding(tiny_model_dir, draft_dir, batch_size):
    batch = prompts(batch_size)
    params = [greedy() for _ in batch]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    spec, stats = run_async(run(tiny_model_dir, batch, params, speculative_method="draft",
                                speculative_model=str(draft_dir), num_speculative_tokens=4))
    assert spec == plain and stats["speculation"]["drafted_tokens"] > 0


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(tiny_model_dir):
    """The oracle: a draft model equal to the target proposes its greedy continuation, so every draft is accepted,
    through rows of K + 1 tokens, and the output is plain decoding's."""
    batch = prompts(3)
    params = [greedy(150) for _ in batch]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    spec, stats = run_async(run(tiny_model_dir, batch, params, speculative_method="draft",
                                speculative_model=str(tiny_model_dir), num_speculative_tokens=5))
    counted = stats["speculation"]
    assert spec == plain and counted["accepted_tokens"] == counted["drafted_tokens"] > 0
    assert counted["accepted_per_row"][5] > 0.8 * counted["verify_rows"]
    # the drafts were fed on the device and read after their verify step: accepted, so read right
    assert counted["device_drafts"] > 0.8 * counted["drafted_tokens"]


def test_draft_model_options_are_checked(tiny_model_dir, mtp_dir):
    with pytest.raises(ValueError, match="speculative_model"):
        config_for(tiny_model_dir, speculative_method="draft", num_speculative_tokens=2).validate()
    with pytest.raises(ValueError, match="hybrid draft model"):
        run_async(run(tiny_model_dir, [[5, 6]], [greedy(2)], speculative_method="draft",
                      speculative_model=str(mtp_dir), num_speculative_tokens=2))
    with pytest.raises(ValueError, match="no MTP head"):
        run_async(run(tiny_model_dir, [[5, 6]], [greedy(2)], speculative_method="mtp", num_speculative_tokens=2))


@pytest.mark.gpu
def test_gpu_model_drafters_through_cuda_graphs(mtp_dir, tiny_model_dir):
    """On CUDA (fp32): the MTP head on a hybrid target (the graphs store the hidden states it reads) and the target
    as its own draft model give plain decoding's tokens; the oracle's drafts are all accepted."""
    batch = prompts(4)
    params = [greedy(120) for _ in batch]
    for model_dir, spec in ((mtp_dir, dict(speculative_method="mtp", num_speculative_tokens=3)),
                            (tiny_model_dir, dict(speculative_method="draft", speculative_model=str(tiny_model_dir),
                                                  num_speculative_tokens=4))):
        plain, _ = run_async(run(model_dir, batch, params, device="cuda"))
        got, stats = run_async(run(model_dir, batch, params, device="cuda", **spec))
        counted = stats["speculation"]
        assert got == plain and counted["drafted_tokens"] > 0
        if spec["speculative_method"] == "draft":
            assert counted["accepted_tokens"] == counted["drafted_tokens"]
