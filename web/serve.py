"""`conveyor serve`: listen, load the model (health answers 503 meanwhile), serve, drain on SIGTERM.

Drain: stop admitting (503 with Retry-After, /health 503), let in-flight requests finish within
the drain timeout, cut whatever is left (each says so: `drain`), close the listener, exit 0. A model or
flag the server cannot serve is one line and exit 1.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable

from aiohttp import web

from kernels.dispatch import use_triton
from pipeline.config import EngineConfig
from pipeline.engine import Engine
from web.app import ServerSettings, ServerState, build_app
from web.connections import make_runner
from web.metrics import ServerMetrics
from web.otel_spans import TelemetryUnavailable, request_spans_for

log = logging.getLogger("conveyor.serve")


def banner(engine: Engine, url: str, settings: ServerSettings | None = None) -> str:
    loaded, config = engine.loaded, engine.config
    arch = loaded.arch
    lines = [
        f"model        {loaded.path}",
        f"architecture {arch.model_type}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size}",
        f"device       {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}"
        + (f"; weights {loaded.weight_format}, {'kept in fp8' if use_triton(loaded.device) else 'dequantized'})"
           if loaded.weight_format else ")"),
        *([f"CPU threads  {engine.cpu_threads.describe()}"] if engine.cpu_threads is not None else []),
        f"KV cache     {loaded.num_blocks} blocks x {config.block_size} tokens, "
        f"{str(loaded.kv_dtype or loaded.dtype).removeprefix('torch.')}",
        f"max length   {loaded.limits.max_model_len} tokens",
        f"batching     up to {config.max_num_seqs} sequences, {config.max_num_batched_tokens} tokens per step"
        + (f", CUDA graphs up to batch {config.cuda_graph_max_batch}" if loaded.runner.graphs is not None else ""),
        f"listening    {url}  (OpenAI API under {url}/v1)",
    ]
    if settings is not None:
        lines.insert(-1, f"parsers      tool calls {settings.tool_call_parser or 'as the chat template writes'}, "
                         f"reasoning {settings.reasoning_parser or 'off'}")
    if config.trace_dir is not None:
        lines.insert(-1, f"traces       into {config.trace_dir}: a file every {config.trace_file_seconds:g}s "
                         f"(sooner when {config.trace_buffer_events // 2} events wait), "
                         f"the newest {config.trace_max_files} kept")
    if settings is not None and settings.otlp_traces_endpoint:
        lines.insert(-1, f"telemetry    an OpenTelemetry span per request to {settings.otlp_traces_endpoint}")
    return "\n".join("[conveyor] " + line for line in lines)


CUT_GRACE_S = 2.0  # after the drain timeout: how long the cancelled requests get to write their last events


async def run_server(config: EngineConfig, settings: ServerSettings, host: str, port: int, drain_timeout_s: float,
                     say: Callable[[str], None] = lambda m: print(f"[conveyor] {m}", file=sys.stderr, flush=True),
                     stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set, where a caller gives one); the exit code."""
    try:
        request_spans = request_spans_for(settings.otlp_traces_endpoint)  # the SDK loads only for the flag
    except TelemetryUnavailable as exc:
        return startup_error(str(exc))
    state = ServerState(settings, ServerMetrics(lambda: state.engine.stats() if state.engine else {},
                                                settings.served_model_names[0]), request_spans=request_spans)
    runner = make_runner(build_app(state), settings)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        return startup_error(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    url = f"http://{host}:{port}"
    say(f"listening on {url}; loading the model (GET /health answers 503 until ready)")
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    load = asyncio.ensure_future(Engine.create(config, progress=say))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # signalled while loading
        load.cancel()
        await runner.cleanup()
        return 0
    try:
        state.engine = engine = load.result()
    except Exception as exc:  # noqa: BLE001 - a model or flag the server cannot serve: one line, no traceback
        stopped.cancel()
        await runner.cleanup()
        log.debug("loading the model failed", exc_info=exc)
        return startup_error(str(exc) if isinstance(exc, (ValueError, OSError)) else
                             f"loading the model failed: {type(exc).__name__}: {exc}")
    say(f"ready in {time.monotonic() - started:.1f}s")
    print(banner(engine, url, settings), file=sys.stderr, flush=True)
    await stopped
    await drain(engine, drain_timeout_s, say)
    await engine.shutdown()
    await runner.cleanup()  # a handler still running gets SHUTDOWN_TIMEOUT_S (web/connections.py), then is cancelled
    if request_spans is not None:
        await asyncio.to_thread(request_spans.shutdown)  # the spans still queued go out
    say("stopped")
    return 0


async def drain(engine: Engine, timeout_s: float, say: Callable[[str], None]) -> None:
    """Stop admitting, let the requests in flight finish within the timeout, then cut what is left: a cut stream's
    choices end with finish_reason "length", then an error event (code server_shutting_down) and [DONE]; a cut
    non-streaming request is a 503 with that code (web/generation.py)."""
    say(f"draining: {engine.num_requests} request(s) in flight, up to {timeout_s:g}s")
    engine.begin_drain()
    if await engine.wait_drained(timeout_s):
        return
    say(f"drain timeout: cutting {engine.num_requests} request(s)")
    engine.cancel_in_flight()
    if not await engine.wait_drained(CUT_GRACE_S):
        say(f"{engine.num_requests} request(s) did not end within {CUT_GRACE_S:g}s: closing their connections")


def startup_error(message: str) -> int:
    print(f"conveyor: error: {message}", file=sys.stderr, flush=True)
    return 1
