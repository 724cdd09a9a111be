"""Engine configuration: one flat dataclass that the CLI, the server and tests fill in.

Fields left at None take their device's default when the engine starts (`resolved`): a GPU wants a
large batch and step budget, a CPU small ones. The CUDA figures were chosen on an H100 with the
Qwen3-8B shape (bench/README.md, "Device defaults").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.request import RepetitionDetection
from pipeline.tracing import DEFAULT_TRACE_EVENTS


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf path; None: the embedded SmolLM2 GGUF
    device: str = "auto"  # auto: cuda when a CUDA device is visible, else cpu
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's max positions, capped by the KV pool
    max_num_seqs: int | None = None  # sequences holding a seat (prefilling or decoding) at once
    max_num_batched_tokens: int | None = None  # per-step token budget (decode tokens + prefill chunk)
    cuda_graph_max_batch: int | None = None  # CUDA: largest decode batch replayed from a graph (larger: eager)
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    stage_queue_size: int = 256  # bound of every stage inbox that is not sized by seats
    output_channel_cap_bytes: int = 1 << 20  # per-request unread output before it is aborted
    seed: int | None = None  # seeds request seeds when a request has none (tests)
    load_format: str = "auto"  # "dummy": random weights built on the device (benchmarks without weight files)
    # "fp8": a 16/32-bit checkpoint's projections rounded to block FP8 at load (pipeline/models/quantization.py)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "fp8": K/V stored as e4m3 with per-layer scales; auto: the model's dtype
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights + activations + KV pool
    cuda_graphs: bool = True  # CUDA: replay captured graphs for decode steps
    repetition_detection: RepetitionDetection | None = field(default_factory=RepetitionDetection)  # loop guard
    run_ahead: bool = True  # launch decode step N+1 before reading step N's tokens (overlap scheduling)
    prefix_caching: bool = True  # reuse the KV of full blocks an earlier prompt computed (dense models)
    kv_offload_host_gib: float = 0.0  # host memory for cached blocks the device evicts (0: none)
    kv_offload_dir: str | None = None  # a directory for cached blocks the host tier evicts (needs the host tier)
    kv_offload_disk_gib: float = 0.0  # disk space for them under kv_offload_dir
    state_snapshot_gib: float = 4.0  # hybrid models: device memory for recurrent-state snapshots (prefix caching)
    state_snapshot_interval: int = 4096  # hybrid models: tokens between snapshots inside a long prompt
    # hybrid models with a host tier: the part of kv_offload_host_gib that holds the snapshots the device evicts
    # (None: a quarter of it; pipeline/memory/snapshot_tiers.py)
    state_snapshot_host_gib: float | None = None
    # drafts verified in the decode step's forward (pipeline/spec/): "ngram" (prompt lookup), "mtp" (the checkpoint's
    # multi-token-prediction head), "dflash" (a DFlash block drafter, speculative_model), "draft" (a smaller model,
    # speculative_model)
    speculative_method: str | None = None
    speculative_model: str | None = None  # the drafter's HF directory (speculative_method "dflash" or "draft")
    num_speculative_tokens: int = 0  # drafts a sequence offers per step (K)
    # verify rows computed as one-token decode rows (kernels/dispatch.py rows_as_decode): on a GPU in bf16 a dense
    # model's output with speculation then equals plain decoding's bit for bit; its verify rows cost more
    exact_speculation: bool = False
    prompt_lookup_min: int = 2  # n-gram drafter: the shortest suffix it looks up
    prompt_lookup_max: int = 4  # and the longest
    chat_template: str | None = None  # a template file (or the template itself) overriding the model's
    ep_size: int = 1  # expert parallelism: ranks sharing the experts (rank 0 serves, pipeline/dist/)
    ep_timeout_s: float = 60.0  # a collective waiting this long for another rank fails (and the engine with it)
    # hybrid models under expert parallelism: each rank keeps its share of every Gated DeltaNet layer's heads and
    # recurrent states (one more all-reduce a layer; no host tier for state snapshots). None: split unless a
    # snapshot host tier is configured (pipeline/loading.py split_linear_attention)
    ep_split_linear_attention: bool | None = None
    wedged_step_s: float = 120.0  # a device step running longer than this makes /health fail
    # structured output (pipeline/grammar/compiler.py): grammars compile in a bounded pool of daemon threads, off the
    # requests that need none; a source's size, a compile's time and the compiled grammars' memory are bounded
    max_grammar_concurrency: int = 2
    max_grammar_bytes: int = 1 << 20  # a grammar's source (canonical schema JSON, regex, EBNF, structural tag)
    max_grammar_seconds: float = 10.0  # a request waiting longer for its grammar gets a 400
    grammar_cache_bytes: int = 256 << 20  # compiled grammars kept for reuse (xgrammar's memory_size_bytes), LRU
    wedged_intake_s: float = 60.0  # intake holding one request this long makes /health fail
    gc_young_threshold: int = 20_000  # Python's gen-0 GC threshold while serving (its default is 700)
    gil_switch_interval_s: float = 0.001  # sys.setswitchinterval while serving (Python's default is 5 ms)
    cpu_threads: int | None = None  # CPU: torch intra-op threads; None: the cores this process may use
    # request traces (pipeline/tracing.py): the ring's size, and with trace_dir the rotating files it is written to
    # (pipeline/trace_files.py: a file every trace_file_seconds or per half ring, the newest trace_max_files kept)
    trace_buffer_events: int = DEFAULT_TRACE_EVENTS
    trace_dir: str | None = None
    trace_file_seconds: float = 60.0
    trace_max_files: int = 10

    def resolved(self) -> EngineConfig:
        """A copy with the device named and every None default filled in for it."""
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        defaults = device_defaults(device)
        seqs = self.max_num_seqs or defaults.max_num_seqs
        graph_batch = self.cuda_graph_max_batch or min(seqs, CUDA_GRAPH_MAX_BATCH)
        threads = self.cpu_threads
        if threads is None and device == "cpu":
            from pipeline.cpu_threads import usable_cores

            threads = usable_cores()
        return replace(self, device=device, max_num_seqs=seqs, cuda_graph_max_batch=graph_batch,
                       max_num_batched_tokens=self.max_num_batched_tokens or defaults.max_num_batched_tokens,
                       cpu_threads=threads)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or none), got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.gc_young_threshold < 1:
            raise ValueError("gc_young_threshold must be at least 1")
        if not 1e-5 <= self.gil_switch_interval_s <= 0.1:
            raise ValueError(f"gil_switch_interval_s must be in [1e-5, 0.1], got {self.gil_switch_interval_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2 (block 0 is reserved)")
        if self.state_snapshot_gib < 0 or self.state_snapshot_interval < self.block_size:
            raise ValueError("state_snapshot_gib must be >= 0 and state_snapshot_interval at least one block")
        if self.kv_offload_host_gib < 0 or self.kv_offload_disk_gib < 0:
            raise ValueError("kv_offload_host_gib and kv_offload_disk_gib must be >= 0")
        if (self.kv_offload_dir is None) != (self.kv_offload_disk_gib == 0):
            raise ValueError("the disk tier needs both kv_offload_dir and kv_offload_disk_gib")
        share = self.state_snapshot_host_gib
        if share is not None and not 0 <= share <= self.kv_offload_host_gib:
            raise ValueError("state_snapshot_host_gib is a part of kv_offload_host_gib: between 0 and it")
        if self.kv_offload_dir is not None and self.kv_offload_host_gib == 0:
            raise ValueError("the disk tier takes the blocks the host tier evicts: set kv_offload_host_gib too")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method {self.speculative_method!r}: the drafters are "
                             f"{', '.join(repr(m) for m in SPECULATIVE_METHODS if m)}")
        if (self.speculative_method in ("draft", "dflash")) != (self.speculative_model is not None):
            raise ValueError("speculative_method 'draft' and 'dflash' need speculative_model (the drafter's "
                             "directory), and only they take one")
        if (self.speculative_method is None) != (self.num_speculative_tokens == 0):
            raise ValueError("speculation needs both speculative_method and num_speculative_tokens >= 1")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 0 and {MAX_SPECULATIVE_TOKENS}")
        if self.ep_size < 1 or self.ep_timeout_s <= 0:
            raise ValueError("ep_size must be at least 1 and ep_timeout_s positive")
        if self.ep_split_linear_attention and self.ep_size < 2:
            raise ValueError("ep_split_linear_attention splits heads over expert-parallel ranks: it needs ep_size >= 2")
        if self.exact_speculation and self.speculative_method is None:
            raise ValueError("exact_speculation applies to speculation: set speculative_method too")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.max_grammar_concurrency < 1 or self.max_grammar_bytes < 1 or self.max_grammar_seconds <= 0:
            raise ValueError("max_grammar_concurrency and max_grammar_bytes must be at least 1 and "
                             "max_grammar_seconds positive")
        if self.grammar_cache_bytes < 0 or self.wedged_intake_s <= 0:
            raise ValueError("grammar_cache_bytes must be >= 0 and wedged_intake_s positive")
        if self.trace_buffer_events < 1024 or self.trace_file_seconds <= 0 or self.trace_max_files < 1:
            raise ValueError("trace_buffer_events must be at least 1024, trace_file_seconds positive and "
                             "trace_max_files at least 1")
        if self.output_channel_cap_bytes < 1 or self.max_waiting_requests < 0 or self.max_waiting_tokens < 0:
            raise ValueError("output_channel_cap_bytes must be at least 1, max_waiting_requests and "
                             "max_waiting_tokens >= 0")


SPECULATIVE_METHODS = (None, "ngram", "mtp", "dflash", "draft")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
MAX_SPECULATIVE_TOKENS = 15  # a verify row of K + 1 tokens stays within the decode CUDA graphs' rows of q <= 16


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int


# CUDA: 256 seats gave OFF +30% over 64; a 2,048-token budget gave the SERVE ladder +35% at concurrency 64
# over 512 with the best TTFT, while 4,096 and 8,192 added nothing there and doubled / tripled ITL p99.
CUDA_DEFAULTS = DeviceDefaults(max_num_seqs=256, max_num_batched_tokens=2048)
CPU_DEFAULTS = DeviceDefaults(max_num_seqs=64, max_num_batched_tokens=512)
CUDA_GRAPH_MAX_BATCH = 512  # graphs for 1, 2, 4, 8, 16, ... up to min(max_num_seqs, this); a larger batch runs eager


def device_defaults(device: str) -> DeviceDefaults:
    return CUDA_DEFAULTS if device.startswith("cuda") else CPU_DEFAULTS
