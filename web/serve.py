"""`conveyor serve`: listen, load the model (health answers 503 meanwhile), serve, drain on SIGTERM.

Drain: stop admitting (503 with Retry-After, /health 503), let in-flight requests finish within
the drain timeout, cancel whatever is left, close the listener, exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable

from aiohttp import web

from pipeline.config import EngineConfig
from pipeline.engine import Engine
from web.app import ServerSettings, ServerState, build_app
from web.metrics import ServerMetrics

log = logging.getLogger("conveyor.serve")


def banner(engine: Engine, url: str, settings: ServerSettings | None = None) -> str:
    loaded, config = engine.loaded, engine.config
    arch = loaded.arch
    lines = [
        f"model        {loaded.path}",
        f"architecture {arch.model_type}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size}",
        f"device       {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}"
        + (f"; weights {loaded.weight_format}, dequantized)" if loaded.weight_format else ")"),
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
    return "\n".join("[conveyor] " + line for line in lines)


async def run_server(config: EngineConfig, settings: ServerSettings, host: str, port: int, drain_timeout_s: float,
                     say: Callable[[str], None] = lambda m: print(f"[conveyor] {m}", file=sys.stderr, flush=True)
                     ) -> int:
    state = ServerState(settings, ServerMetrics(lambda: state.engine.stats() if state.engine else {},
                                                settings.served_model_names[0]))
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    url = f"http://{host}:{port}"
    say(f"listening on {url}; loading the model (GET /health answers 503 until ready)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    load = asyncio.ensure_future(Engine.create(config, progress=say))
    await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # signalled while loading
        load.cancel()
        await runner.cleanup()
        return 0
    state.engine = engine = load.result()
    say(f"ready in {time.monotonic() - started:.1f}s")
    print(banner(engine, url, settings), file=sys.stderr, flush=True)
    await stop.wait()
    say(f"draining: {engine.num_requests} request(s) in flight, up to {drain_timeout_s:g}s")
    engine.begin_drain()
    if not await engine.wait_drained(drain_timeout_s):
        say(f"drain timeout: cancelling {engine.num_requests} request(s)")
    await engine.shutdown()
    await runner.cleanup()
    say("stopped")
    return 0
