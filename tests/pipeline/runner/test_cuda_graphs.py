"""Decode CUDA graphs: the captured batch sizes, and (on a GPU) graphs == eager greedy tokens."""
import pytest

from pipeline.request import SamplingParams
from pipeline.runner.cuda_graphs import graph_batch_sizes
from tests.conftest import run_async
from tests.engine_utils import collect, config_for


@pytest.mark.parametrize("max_num_seqs,expected", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                                   (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_graph_batch_sizes_cover_every_batch(max_num_seqs, expected):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == expected
    assert all(any(s >= b for s in sizes) for b in range(1, max_num_seqs + 1))


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
