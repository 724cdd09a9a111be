"""The numeric command-line flags' ranges, in one table checked right after parsing: a value out of range is a usage
error naming the flag (argparse's own: the usage line, one error line, exit 2), never a traceback from deep inside
startup. Cross-flag rules stay in `EngineConfig.validate`, which the CLI runs next."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.config import MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True, slots=True)
class Range:
    low: float
    high: float = math.inf
    open_low: bool = False  # low itself is refused (a timeout of 0 s means nothing)

    def problem(self, value: float) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if value < self.low or (self.open_low and value == self.low) or value > self.high:
            return f"must be {self.describe()}, got {value}"
        return None

    def describe(self) -> str:
        if self.high == math.inf:
            return f"more than {self.low:g}" if self.open_low else f"at least {self.low:g}"
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"


AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, open_low=True)

# argparse dest -> its range (the flag is `--` + dest with dashes). A dest a command lacks is skipped.
FLAG_RANGES: dict[str, Range] = {
    # serve
    "port": Range(0, 65535),
    "max_waiting_requests": AT_LEAST_1,
    "max_waiting_tokens": AT_LEAST_1,
    "request_timeout": POSITIVE,
    "drain_timeout": NON_NEGATIVE,
    "header_timeout": POSITIVE,
    "body_timeout": POSITIVE,
    "write_timeout": POSITIVE,
    "max_header_bytes": Range(256),
    "max_body_bytes": AT_LEAST_1,
    "max_output_buffer_bytes": AT_LEAST_1,
    "responses_store_size": NON_NEGATIVE,
    "max_grammar_concurrency": AT_LEAST_1,
    "max_grammar_bytes": AT_LEAST_1,
    "max_grammar_seconds": POSITIVE,
    "max_grammar_cache_bytes": NON_NEGATIVE,
    "trace_file_seconds": POSITIVE,
    "trace_max_files": AT_LEAST_1,
    "trace_buffer_events": Range(1024),
    # the engine (serve, generate, worker)
    "block_size": AT_LEAST_1,
    "num_kv_blocks": Range(2),
    "kv_cache_memory_gib": POSITIVE,
    "max_model_len": AT_LEAST_1,
    "max_num_seqs": AT_LEAST_1,
    "max_num_batched_tokens": AT_LEAST_1,
    "cuda_graph_max_batch": AT_LEAST_1,
    "gpu_memory_utilization": Range(0, 1, open_low=True),
    "kv_offload_host_gib": NON_NEGATIVE,
    "kv_offload_disk_gib": NON_NEGATIVE,
    "state_snapshot_gib": NON_NEGATIVE,
    "state_snapshot_interval": AT_LEAST_1,
    "state_snapshot_host_gib": NON_NEGATIVE,
    "num_speculative_tokens": Range(0, MAX_SPECULATIVE_TOKENS),
    "prompt_lookup_min": AT_LEAST_1,
    "prompt_lookup_max": AT_LEAST_1,
    "ep_size": AT_LEAST_1,
    "ep_timeout": POSITIVE,
    "gc_young_threshold": AT_LEAST_1,
    "gil_switch_interval": POSITIVE,
    "cpu_threads": AT_LEAST_1,
}


def flag_range_problem(values: dict[str, Any]) -> str | None:
    """The first flag out of its range, as argparse words it ("argument --x: ..."); None when all are in range."""
    for dest, allowed in FLAG_RANGES.items():
        value = values.get(dest)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = allowed.problem(value)
            if problem is not None:
                return f"argument --{dest.replace('_', '-')}: {problem}"
    return None
