"""Engine configuration: one flat dataclass that the CLI, the server and tests fill in."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.request import RepetitionDetection


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf path; None: the embedded SmolLM2 GGUF
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's max positions, capped by the KV pool
    max_num_seqs: int = 64  # sequences holding a seat (prefilling or decoding) at once
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunk)
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    stage_queue_size: int = 256  # bound of every stage inbox that is not sized by seats
    output_channel_cap_bytes: int = 1 << 20  # per-request unread output before it is aborted
    seed: int | None = None  # seeds request seeds when a request has none (tests)
    load_format: str = "auto"  # "dummy": random weights built on the device (benchmarks without weight files)
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights + activations + KV pool
    cuda_graphs: bool = True  # CUDA: replay captured graphs for decode steps
    repetition_detection: RepetitionDetection | None = field(default_factory=RepetitionDetection)  # loop guard
    run_ahead: bool = True  # launch decode step N+1 before reading step N's tokens (overlap scheduling)
    chat_template: str | None = None  # a template file (or the template itself) overriding the model's
    wedged_step_s: float = 120.0  # a device step running longer than this makes /health fail
    gc_young_threshold: int = 20_000  # Python's gen-0 GC threshold while serving (its default is 700)
    gil_switch_interval_s: float = 0.001  # sys.setswitchinterval while serving (Python's default is 5 ms)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.gc_young_threshold < 1:
            raise ValueError("gc_young_threshold must be at least 1")
        if not 1e-5 <= self.gil_switch_interval_s <= 0.1:
            raise ValueError(f"gil_switch_interval_s must be in [1e-5, 0.1], got {self.gil_switch_interval_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2 (block 0 is reserved)")
