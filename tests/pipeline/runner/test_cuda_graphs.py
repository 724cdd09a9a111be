"""Decode CUDA graphs: the captured batch sizes, and (on a GPU) graphs == eager greedy tokens."""
import pytest

from pipeline.request import SamplingParams
from kernels.triton_decode_attention import decode_num_splits
from pipeline.runner.cuda_graphs import decode_plan, graph_batch_sizes
from tests.conftest import run_async
from tests.engine_utils import collect, config_for


@pytest.mark.parametrize("max_num_seqs,expected", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                                   (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_graph_batch_sizes_cover_every_batch(max_num_seqs, expected):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == expected
    assert all(any(s >= b for s in sizes) for b in range(1, max_num_seqs + 1))


@pytest.mark.parametrize("rows,graph_size", [(1, 1), (3, 4), (5, 8), (9, 12), (12, 12), (13, 13)])
def test_an_eager_decode_step_splits_keys_as_its_graph_does(rows, graph_size):
    """The split count of an eager decode step is its graph's (padded size, longest possible context), not the
    step's own heuristic (its rows, its longest context), so graphs and eager sum a sequence's keys alike."""
    plan = decode_plan(rows, max_batch=12, num_kv_heads=2, max_model_len=40960, num_sms=132)
    assert plan.num_splits == decode_num_splits(graph_size, 2, 40960, 132)
    assert decode_num_splits(1, 2, 40960, 132) != decode_num_splits(1, 2, 75, 132)  # what the heuristic would differ by


@pytest.mark.gpu
def test_graphed_decode_equals_eager_on_cuda(tiny_model_dir):
    async def main(graphs: bool, graph_max_batch: int | None = None):
        from pipeline.engine import Engine

        engine = await Engine.create(config_for(tiny_model_dir, device="cuda", cuda_graphs=graphs, max_num_seqs=8,
                                                cuda_graph_max_batch=graph_max_batch))
        assert (engine.loaded.runner.graphs is not None) == graphs
        try:
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            prompts = [[100 + 7 * i + j for j in range(3 + 5 * i)] for i in range(5)]
            import asyncio

            return [r[0].token_ids for r in await asyncio.gather(
                *[collect(engine, prompt_token_ids=p, params=params) for p in prompts])]
        finally:
            await engine.shutdown()

    eager = run_async(main(False))
    assert run_async(main(True)) == eager
    assert run_async(main(True, graph_max_batch=2)) == eager  # batches past the largest graph run eager


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_multi_token_rows_equal_eager_on_cuda(batch):
    """Rows of q = K+1 tokens with logits at each (a verify step) replay from graphs as they run eagerly."""
    import torch

    from pipeline.runner.model_runner import ModelRunner
    from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
    from tests.model_utils import SMOLLM2_VOCAB, conveyor_from_hf, make_tiny_hf_model

    device = torch.device("cuda")
    model = conveyor_from_hf(make_tiny_hf_model("qwen3", seed=2), dtype=torch.bfloat16, device=device)
    runner = ModelRunner(model, vocab_size=SMOLLM2_VOCAB, block_size=16, dtype=torch.bfloat16, device=device)
    runner.allocate_caches(64)
    prompt = [[200 + 13 * b + i for i in range(20 + 7 * b)] for b in range(batch)]
    tables = [list(range(1 + 4 * b, 5 + 4 * b)) for b in range(batch)]
    runner.execute(build_step_plan([ScheduledChunk(p, 0, t, []) for p, t in zip(prompt, tables)], 16))
    runner.capture_decode_graphs(max_batch=4, max_model_len=64, max_query_len=4)
    for q in (1, 2, 4):
        chunks = [ScheduledChunk([7 + b + i for i in range(q)], len(p), t, [None] * q, logits_offsets=list(range(q)))
                  for b, (p, t) in enumerate(zip(prompt, tables))]
        forward = build_step_plan(chunks, 16).forward
        assert runner.prepare(forward).graph
        graphed = runner.compute_logits(forward).clone()
        graphs, runner.graphs = runner.graphs, None
        eager = runner.compute_logits(forward)
        runner.graphs = graphs
        torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)
        assert torch.equal(graphed.argmax(-1), eager.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_hybrid_decode_equals_eager_bitwise_on_cuda(batch):
    """A hybrid model's decode step (recurrent state slots) replays from a graph exactly as it runs eagerly: same
    logits and same new states, bit for bit, from the same starting states (restored between the two runs). The
    null slot (0) is scratch: a graph padded past the batch (3 rows in the 4-row graph) writes its padding row
    there, an eager step does not."""
    import torch

    from pipeline.models.forward_context import StateSlotSpec
    from pipeline.runner.model_runner import ModelRunner
    from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
    from tests.model_utils import SMOLLM2_VOCAB, conveyor_from_hf, make_tiny_hf_model

    device = torch.device("cuda")
    model = conveyor_from_hf(make_tiny_hf_model("qwen3_5_moe_text", seed=2), dtype=torch.bfloat16, device=device)
    runner = ModelRunner(model, vocab_size=SMOLLM2_VOCAB, block_size=16, dtype=torch.bfloat16, device=device,
                         max_num_seqs=4)
    runner.allocate_caches(64)
    prompt = [[200 + 13 * b + i for i in range(20 + 7 * b)] for b in range(batch)]
    tables = [list(range(1 + 4 * b, 5 + 4 * b)) for b in range(batch)]
    slots = [1 + b for b in range(batch)]
    runner.execute(build_step_plan([ScheduledChunk(p, 0, t, []) for p, t in zip(prompt, tables)], 16, slots))
    runner.capture_decode_graphs(max_batch=4, max_model_len=64)
    chunks = [ScheduledChunk([7 + b], len(p), t, [None]) for b, (p, t) in enumerate(zip(prompt, tables))]
    forward = build_step_plan(chunks, 16, slots).forward
    before = [c.clone() for c in runner.caches]
    assert runner.prepare(forward).graph
    graphed = runner.compute_logits(forward).clone()
    graphed_caches = [c.clone() for c in runner.caches]
    for cache, saved in zip(runner.caches, before):
        cache.copy_(saved)
    graphs, runner.graphs = runner.graphs, None
    eager = runner.compute_logits(forward)
    runner.graphs = graphs
    assert torch.equal(graphed, eager)
    for index, (g, e, spec) in enumerate(zip(graphed_caches, runner.caches, runner.cache_specs)):
        live = slice(1, None) if isinstance(spec, StateSlotSpec) else slice(None)
        assert torch.equal(g[live], e[live]), f"cache {index} differs"
