"""What the live history (pipeline/live_stats.py) reads from the engine once a second, and what the engine's
capacities are. The engine imports this module only where it starts its sampler: the history's types know nothing
of the engine."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.live_stats import EngineReading, StageReading

if TYPE_CHECKING:
    from pipeline.engine import Engine


def read_engine(engine: Engine) -> EngineReading:
    """One reading. Decode counts a row of a sequence that ended during its step as picked (one a finish, at most)."""
    stages = {stage.name: StageReading(stage.metrics.items_in, stage.metrics.items_out, stage.inbox_depth,
                                       tuple(stage.metrics.queue_wait.counts), tuple(stage.metrics.service_time.counts))
              for stage in engine.stages}
    cache, spec = engine.cache, engine.decode.spec
    snapshots = cache.snapshots
    picked = (engine.decode.metrics.items_out + engine.prefill.metrics.items_out + spec.accepted_tokens
              + spec.filler_accepted)
    return EngineReading(stages, len(engine.decode.running), len(engine.prefill.waiting), engine.waiting.requests,
                         engine.waiting.tokens, engine.seats.held, cache.num_used, cache.num_state_slots_used,
                         len(snapshots) if snapshots is not None else 0, picked, cache.prefix_queried_tokens,
                         cache.prefix_hit_tokens, spec.drafted_tokens, spec.accepted_tokens, engine.decode.preemptions)


def engine_info(engine: Engine) -> dict[str, Any]:
    """What does not change while the engine runs: the stages and the capacities the gauges fill."""
    runner, cache = engine.loaded.runner, engine.cache
    return {
        "stages": [stage.name for stage in engine.stages],
        "kv_blocks_total": cache.capacity,
        "block_size": cache.block_size,
        "seats_total": engine.seats.capacity,
        "state_slots_total": max(0, runner.num_state_slots - 1),
        "snapshots_total": cache.snapshots.capacity if cache.snapshots is not None else 0,
        "prefix_caching": cache.prefix_caching,
        "speculation": engine.config.speculative_method if engine.decode.drafter is not None else None,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }
