"""--max-model-len is said out loud: above the model's positions it is refused, above what the KV cache holds for one
sequence it is served shorter with a warning, never cut without a word."""
import pytest

from pipeline.engine import Engine
from tests.conftest import run_async
from tests.engine_utils import config_for


def test_a_context_beyond_the_models_positions_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--max-model-len 4096 is more than .* \(1024 positions"):
        run_async(Engine.create(config_for(tiny_model_dir, max_model_len=4096)))


def test_a_context_beyond_the_kv_cache_is_served_shorter_with_a_warning(tiny_model_dir):
    said: list[str] = []

    async def main() -> int:
        engine = await Engine.create(config_for(tiny_model_dir, max_model_len=1024, num_kv_blocks=64),
                                     progress=said.append)
        try:
            return engine.loaded.limits.max_model_len
        finally:
            await engine.shutdown()

    assert run_async(main()) == 63 * 4
    assert any(m.startswith("warning: --max-model-len 1024") for m in said), said
