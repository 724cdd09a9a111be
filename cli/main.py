"""`conveyor` command line: `serve` (the OpenAI HTTP API), `generate` (stream to stdout / chat), `worker` (an
expert-parallel rank) and `top` (a running server's live figures in the terminal, cli/top.py).

It sits above the HTTP server and the engine (web/, pipeline/) and imports them only inside the commands, after
``prefer_passive_wait``: importing this module loads no torch."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from cli.top import add_top_parser, top_main
from pipeline.config import CPU_DEFAULTS, CUDA_DEFAULTS, CUDA_GRAPH_MAX_BATCH, EngineConfig
from pipeline.cpu_threads import prefer_passive_wait
from pipeline.errors import AdmissionRefused, InvalidRequest
from pipeline.request import RepetitionDetection, SamplingParams

if TYPE_CHECKING:
    from web.app import ServerSettings


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--device", default=defaults.device,
                        help="auto (CUDA when visible, else CPU), cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=defaults.kv_cache_memory_gib)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"sequences running at once (default: {CUDA_DEFAULTS.max_num_seqs} on CUDA, "
                             f"{CPU_DEFAULTS.max_num_seqs} on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"tokens per device step, decode rows and prefill chunks together (default: "
                             f"{CUDA_DEFAULTS.max_num_batched_tokens} on CUDA, "
                             f"{CPU_DEFAULTS.max_num_batched_tokens} on CPU)")
    parser.add_argument("--cuda-graph-max-batch", type=int, default=None,
                        help=f"largest decode batch replayed from a CUDA graph; larger ones run eager (default: "
                             f"max-num-seqs, at most {CUDA_GRAPH_MAX_BATCH})")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default=defaults.load_format,
                        help="dummy: random weights from config.json (benchmarks)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8: round a 16/32-bit checkpoint's projections to block FP8 (128x128 e4m3) at load; "
                             "FP8 checkpoints (fp8, compressed-tensors) load as they are without it")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=defaults.kv_cache_dtype,
                        help="fp8: KV blocks stored as e4m3 with per-layer scales (twice the tokens per GiB); "
                             "auto: the model's dtype")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--repetition-detection", default="1,64,32", metavar="MIN,MAX,COUNT|off",
                        help="the default loop guard: end outputs ending in a MIN..MAX-token pattern repeated COUNT "
                             "times (finish_reason length); requests may override it")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="compute every prompt in full (no reuse of cached prefix blocks)")
    parser.add_argument("--kv-offload-host-gib", type=float, default=0.0,
                        help="host memory (GiB) keeping cached prefix blocks the device evicts")
    parser.add_argument("--kv-offload-dir", default=None,
                        help="a directory keeping cached prefix blocks the host tier evicts "
                             "(with --kv-offload-disk-gib)")
    parser.add_argument("--kv-offload-disk-gib", type=float, default=0.0, help="disk space (GiB) for that tier")
    parser.add_argument("--state-snapshot-gib", type=float, default=defaults.state_snapshot_gib,
                        help="hybrid models: device memory for recurrent-state snapshots (where prefixes resume)")
    parser.add_argument("--state-snapshot-interval", type=int, default=defaults.state_snapshot_interval,
                        help="hybrid models: tokens between state snapshots inside a long prompt")
    parser.add_argument("--state-snapshot-host-gib", type=float, default=None,
                        help="hybrid models: the part of --kv-offload-host-gib holding the state snapshots the device "
                             "evicts (default: a quarter of it)")
    parser.add_argument("--speculative-method", choices=["ngram", "mtp", "dflash", "draft"], default=None,
                        help="draft tokens and verify them in the decode step's forward (exactly the output without): "
                             "ngram (prompt lookup), mtp (the checkpoint's MTP head), dflash (a DFlash block "
                             "drafter, --speculative-model), draft (a smaller model, --speculative-model)")
    parser.add_argument("--speculative-model", default=None, metavar="DIR",
                        help="the drafter's HF directory (--speculative-method dflash or draft; same tokenizer)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                        help="drafts a sequence offers per step (with --speculative-method)")
    parser.add_argument("--exact-speculation", action="store_true",
                        help="compute each verified token as a one-token decode row (GPU, dense models: output equal "
                             "to plain decoding's in bf16 too; verify rows cost more)")
    parser.add_argument("--prompt-lookup-min", type=int, default=defaults.prompt_lookup_min,
                        help="n-gram drafter: the shortest suffix it looks up in the prompt and output")
    parser.add_argument("--prompt-lookup-max", type=int, default=defaults.prompt_lookup_max,
                        help="n-gram drafter: the longest suffix it looks up")
    parser.add_argument("--ep-size", type=int, default=defaults.ep_size, metavar="N",
                        help="expert parallelism: split a mixture-of-experts model's experts over N ranks, one GPU "
                             "each (the N-1 local workers start with the server; across machines use torchrun's "
                             "environment and `conveyor worker` on the other ranks)")
    parser.add_argument("--ep-timeout", type=float, default=defaults.ep_timeout_s, metavar="SECONDS",
                        help="a collective waiting this long for another rank fails the engine")
    parser.add_argument("--ep-split-linear-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="hybrid models with --ep-size: each rank keeps its share of every Gated DeltaNet layer's "
                             "heads and recurrent states (one more all-reduce a layer; no host tier for state "
                             "snapshots). Default: on, unless a snapshot host tier is configured")
    parser.add_argument("--disable-run-ahead", action="store_true",
                        help="read each decode step's tokens before launching the next (no overlap)")
    parser.add_argument("--gc-young-threshold", type=int, default=defaults.gc_young_threshold,
                        help="Python's young-generation GC threshold while serving (pipeline/interpreter_tuning.py)")
    parser.add_argument("--gil-switch-interval", type=float, default=defaults.gil_switch_interval_s,
                        metavar="SECONDS", help="sys.setswitchinterval while serving (pipeline/interpreter_tuning.py)")
    parser.add_argument("--cpu-threads", type=positive_int, default=None, metavar="N",
                        help="CPU backend: compute threads (default: the cores this process may use; "
                             "pipeline/cpu_threads.py)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_repetition_detection(text: str) -> RepetitionDetection | None:
    if text.strip().lower() in ("off", "none", "false", "0"):
        return None
    try:
        detection = RepetitionDetection(*(int(part) for part in text.split(",")))
        detection.validate()
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--repetition-detection {text!r}: {exc}") from None
    return detection


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gib=args.kv_cache_memory_gib,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        cuda_graph_max_batch=args.cuda_graph_max_batch, load_format=args.load_format,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=not args.enforce_eager,
                        run_ahead=not args.disable_run_ahead, prefix_caching=not args.no_prefix_caching,
                        kv_offload_host_gib=args.kv_offload_host_gib, kv_offload_dir=args.kv_offload_dir,
                        kv_offload_disk_gib=args.kv_offload_disk_gib, state_snapshot_gib=args.state_snapshot_gib,
                        state_snapshot_interval=args.state_snapshot_interval,
                        state_snapshot_host_gib=args.state_snapshot_host_gib,
                        speculative_method=args.speculative_method, speculative_model=args.speculative_model,
                        num_speculative_tokens=args.num_speculative_tokens, exact_speculation=args.exact_speculation,
                        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                        ep_size=args.ep_size, ep_timeout_s=args.ep_timeout,
                        ep_split_linear_attention=args.ep_split_linear_attention,
                        gc_young_threshold=args.gc_young_threshold,
                        gil_switch_interval_s=args.gil_switch_interval,
                        cpu_threads=args.cpu_threads,
                        repetition_detection=parse_repetition_detection(args.repetition_detection))


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed, stop=list(args.stop),
                          ignore_eos=args.ignore_eos)


async def _stream(engine: Any, params: SamplingParams, **prompt: Any) -> str:
    text = []
    async for delta in engine.generate(params=params, **prompt):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text.append(delta.text)
    sys.stdout.write("\n")
    return "".join(text)


def refuse_checkpoint(config: EngineConfig) -> bool:
    """A checkpoint the engine cannot load as it is (its quantization, its scales) is one line and True, found from
    config.json and the safetensors headers before anything starts."""
    from pipeline.models.quantized_weights import checkpoint_problem

    problem = checkpoint_problem(config.model, config.load_format)
    if problem is not None:
        print(f"conveyor: error: {problem}", file=sys.stderr, flush=True)
    return problem is not None


async def generate_main(args: argparse.Namespace) -> int:
    from pipeline.engine import Engine

    if refuse_checkpoint(engine_config(args)):
        return 1
    engine = await Engine.create(engine_config(args), progress=lambda m: print(f"[conveyor] {m}", file=sys.stderr))
    params = sampling_params(args)
    try:
        if args.prompt is not None:
            prompt: dict[str, Any] = ({"prompt": args.prompt} if args.raw or engine.loaded.limits.chat_template is None
                                      else {"messages": [{"role": "user", "content": args.prompt}]})
            await _stream(engine, params, **prompt)
            return 0
        return await _chat_loop(engine, params)
    except (InvalidRequest, AdmissionRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await engine.shutdown()


async def _chat_loop(engine: Any, params: SamplingParams) -> int:
    """Interactive chat on stdin (what `make serve` runs until the HTTP server lands)."""
    history: list[dict[str, str]] = []
    print("[conveyor] chat with the model; an empty line or Ctrl-D quits", file=sys.stderr)
    loop = asyncio.get_running_loop()
    while True:
        sys.stdout.write("> ")
        sys.stdout.flush()
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = await _stream(engine, params, messages=history)
        history.append({"role": "assistant", "content": reply})


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from `serve` flags, with parsers the flags leave open taken from the model's family
    (pipeline/model_family.py; only config.json is read, so this is instant)."""
    from pipeline.model_family import model_family_defaults
    from web.app import ServerSettings

    names = args.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                              request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                              enforce_tool_grammar=not args.no_tool_grammar,
                              responses_store_size=args.responses_store_size,
                              header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                              write_timeout_s=args.write_timeout, max_header_bytes=args.max_header_bytes,
                              otlp_traces_endpoint=args.otlp_traces_endpoint)
    return settings.with_model_defaults(model_family_defaults(args.model))


async def serve_main(args: argparse.Namespace) -> int:
    from web.serve import run_server

    config = engine_config(args)
    if refuse_checkpoint(config):  # before the port is bound
        return 1
    config.max_waiting_requests = args.max_waiting_requests
    config.max_waiting_tokens = args.max_waiting_tokens
    config.chat_template = args.chat_template
    set_grammar_bounds(config, args)
    set_trace_options(config, args)
    config.output_channel_cap_bytes = args.max_output_buffer_bytes
    return await run_server(config, server_settings(args), args.host, args.port, args.drain_timeout)


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """Bounds on structured output's grammar compilation (pipeline/grammar/compiler.py)."""
    defaults = EngineConfig()
    parser.add_argument("--max-grammar-concurrency", type=int, default=defaults.max_grammar_concurrency, metavar="N",
                        help="grammar compilations running at once, off the requests that need none (daemon threads)")
    parser.add_argument("--max-grammar-bytes", type=int, default=defaults.max_grammar_bytes, metavar="BYTES",
                        help="the largest grammar source (JSON schema, tool set, regex, EBNF) compiled; larger: 400")
    parser.add_argument("--max-grammar-seconds", type=float, default=defaults.max_grammar_seconds, metavar="SECONDS",
                        help="how long a request waits for its grammar (400 after); a schema that compiled past it "
                             "is refused at once from then on")
    parser.add_argument("--max-grammar-cache-bytes", type=int, default=defaults.grammar_cache_bytes, metavar="BYTES",
                        help="memory of compiled grammars kept for reuse (least recently used evicted)")


def set_grammar_bounds(config: EngineConfig, args: argparse.Namespace) -> None:
    config.max_grammar_concurrency = args.max_grammar_concurrency
    config.max_grammar_bytes = args.max_grammar_bytes
    config.max_grammar_seconds = args.max_grammar_seconds
    config.grammar_cache_bytes = args.max_grammar_cache_bytes


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """Request traces (pipeline/tracing.py, GET /debug/trace) and OpenTelemetry spans (web/otel_spans.py)."""
    defaults = EngineConfig()
    parser.add_argument("--trace-dir", default=None, metavar="DIR",
                        help="record request traces all the time into rotating Chrome trace files in DIR (Perfetto "
                             "opens them): a file every --trace-file-seconds, or sooner when half the ring is new")
    parser.add_argument("--trace-file-seconds", type=float, default=defaults.trace_file_seconds, metavar="SECONDS",
                        help="with --trace-dir: the longest stretch one file covers")
    parser.add_argument("--trace-max-files", type=int, default=defaults.trace_max_files, metavar="N",
                        help="with --trace-dir: the newest N files are kept, older ones deleted")
    parser.add_argument("--trace-buffer-events", type=int, default=defaults.trace_buffer_events, metavar="N",
                        help="trace events kept in memory (GET /debug/trace windows and --trace-dir files hold at "
                             "most this many)")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export one OpenTelemetry span per request to this OTLP collector (gRPC, or "
                             "http/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); needs the otel extra")


def set_trace_options(config: EngineConfig, args: argparse.Namespace) -> None:
    config.trace_dir = args.trace_dir
    config.trace_file_seconds = args.trace_file_seconds
    config.trace_max_files = args.trace_max_files
    config.trace_buffer_events = args.trace_buffer_events


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    defaults = EngineConfig()
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", action="extend", nargs="+", default=None,
                       help="name(s) clients use for the model (default: the model path, or the embedded name); "
                            "a name with * is a pattern: 'claude-*' answers the names Claude Code sends")
    serve.add_argument("--responses-store-size", type=int, default=256, metavar="N",
                       help="Responses API responses kept for previous_response_id and GET (least recent dropped)")
    serve.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests)
    serve.add_argument("--max-waiting-tokens", type=int, default=defaults.max_waiting_tokens)
    serve.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is aborted")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1")
    serve.add_argument("--chat-template", default=None, help="a chat template file overriding the model's")
    serve.add_argument("--max-body-bytes", type=int, default=32 << 20)
    serve.add_argument("--tool-call-parser", choices=["hermes", "qwen3_coder"], default=None,
                       help="tool-call format (default: the model family's, else the one the chat template writes)")
    serve.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1", "none"], default=None,
                       help="split <think> blocks into reasoning_content (default: the model family's, e.g. qwen3 "
                            "for Qwen3.5 / Qwen3-Next; none: never split)")
    serve.add_argument("--no-tool-grammar", action="store_true",
                       help="do not constrain tool calls with a grammar (parse only)")
    add_grammar_args(serve)
    add_connection_args(serve)
    add_trace_args(serve)
    add_engine_args(serve)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Every connection's deadlines and limits (web/connections.py)."""
    parser.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a request's line and headers must arrive within this long of connecting or of the "
                             "previous response, else the connection closes (so does an idle keep-alive one)")
    parser.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a request's body must arrive within this long of its headers (else 408)")
    parser.add_argument("--write-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="response bytes a client leaves unread this long cut its connection and cancel its "
                             "request (a stream whose client stopped reading)")
    parser.add_argument("--max-header-bytes", type=int, default=8192, metavar="BYTES",
                        help="the longest request line or header; longer ones (or over 128 headers) get 431")
    parser.add_argument("--max-output-buffer-bytes", type=int, default=EngineConfig().output_channel_cap_bytes,
                        metavar="BYTES", help="generated text a request's client has not taken yet; past it the "
                                              "request ends with an error")


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad value is a usage error (exit 2, one line under the usage line), never a traceback from startup: the
    numeric flags' ranges (pipeline/flag_ranges.py), then the engine config's own rules."""
    from pipeline.flag_ranges import flag_range_problem

    problem = flag_range_problem(vars(args))
    if problem is None:
        try:
            engine_config(args).validate()
        except (ValueError, argparse.ArgumentTypeError) as exc:
            problem = str(exc)
    if problem is not None:
        parser.error(problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    gen = commands.add_parser("generate", help="stream a completion to stdout (interactive chat without --prompt)")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--raw", action="store_true", help="complete the prompt as plain text (no chat template)")
    add_engine_args(gen)
    add_sampling_args(gen)
    worker = commands.add_parser("worker", help="an expert-parallel worker rank (torchrun's environment; the same "
                                                "engine flags as the head's `serve`)")
    add_engine_args(worker)
    add_top_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "top":  # a client of a running server: no engine flags to check, no torch
        return top_main(args)
    check_flags(commands.choices[args.command], args)
    prefer_passive_wait()  # before anything loads torch
    if args.command == "worker":
        from pipeline.dist.worker import worker_main

        logging.basicConfig(level=logging.INFO, format="[conveyor worker] %(levelname)s %(name)s: %(message)s")
        return worker_main(engine_config(args))
    import uvloop

    if args.command == "generate":
        return uvloop.run(generate_main(args))
    if args.command == "serve":
        logging.basicConfig(level=logging.INFO, format="[conveyor] %(levelname)s %(name)s: %(message)s")
        return uvloop.run(serve_main(args))
    return 2

