"""The grammar compiler's bounds: source size, compile time (with what a timed-out compile still holds), the
compiled-grammar cache's bytes, and a pool whose threads never keep the process alive."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pipeline.grammar.cache import GrammarCache
from pipeline.grammar.compiler import GrammarCompiler, GrammarLimits, GrammarTimedOut, GrammarTooLarge
from pipeline.grammar.pool import CompilePool
from pipeline.grammar.spec import GrammarSpec
from pipeline.tokenizer import Tokenizer
from tests.conftest import run_async


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(str(tiny_model_dir))


def schema(n: int) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                                    "required": [f"p{i}" for i in range(n)]})


class Gate:
    """Stands in for xgrammar's compile: blocks each call until released, then compiles for real."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.release = threading.Event()
        self.entered: list[GrammarSpec] = []
        self._compile = compiler._compile
        compiler._compile = self  # type: ignore[method-assign]

    def __call__(self, spec: GrammarSpec):
        self.entered.append(spec)
        assert self.release.wait(30), "the test never released the compile"
        return self._compile(spec)


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.005)


def test_the_cache_is_bounded_by_bytes_least_recently_used_out_first():
    cache = GrammarCache(max_bytes=1000)
    a, b, c, huge = GrammarSpec("regex", "a"), GrammarSpec("regex", "b"), GrammarSpec("regex", "c"), \
        GrammarSpec("regex", "d")
    assert cache.put(a, "A", 400) and cache.put(b, "B", 400)
    assert cache.get(a) == "A"  # b is now the least recently used
    assert cache.put(c, "C", 400)
    assert b not in cache and a in cache and c in cache and cache.evictions == 1
    assert cache.bytes == 802  # the grammars and their one-character sources
    assert not cache.put(huge, "D", 5000)  # larger than the whole cache: not kept, nothing evicted for it
    assert len(cache) == 2 and cache.bytes == 802


def test_compiled_grammars_are_evicted_by_their_memory_size(tokenizer):
    async def main():
        probe = GrammarCompiler(tokenizer, 49152, [2])
        sizes = [(await probe.compile(schema(n))).memory_size_bytes + len(schema(n).source) for n in (1, 2, 3)]
        assert sizes[0] <= sizes[2]
        # room for schema(2) and schema(3), not for all three
        compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(cache_bytes=sizes[1] + sizes[2] + 10))
        try:
            for spec in (schema(1), schema(1), schema(2), schema(3)):
                await compiler.compile(spec)
            return compiler.cache, compiler.compilations
        finally:
            compiler.close()
            probe.close()

    cache, compilations = run_async(main())
    assert compilations == 3  # the repeated spec was a hit
    assert schema(1) not in cache and schema(2) in cache and schema(3) in cache
    assert cache.evictions == 1 and cache.bytes <= cache.max_bytes


def test_a_source_over_max_bytes_is_refused_before_compiling(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(max_bytes=100))
    spec = schema(20)
    with pytest.raises(GrammarTooLarge) as info:
        compiler.lookup(spec)
    message = str(info.value)
    assert f"{len(spec.source)} bytes" in message and "limit of 100 bytes" in message
    assert "--max-grammar-bytes" in message
    assert compiler.compilations == 0


def test_a_compile_past_max_seconds_times_out_and_its_spec_is_refused_at_once(tokenizer):
    async def main():
        compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(concurrency=1, max_seconds=0.3))
        gate = Gate(compiler)
        try:
            started = time.monotonic()
            with pytest.raises(GrammarTimedOut) as first:
                await compiler.compile(schema(4))
            waited = time.monotonic() - started
            await until(lambda: compiler.pool.running()[0].running_for(time.monotonic()) > 0.3)
            with pytest.raises(GrammarTimedOut) as again:  # still compiling past the bound: refused, not queued
                compiler.lookup(schema(4))
            gate.release.set()
            await until(lambda: not compiler.pool.running())
            await asyncio.sleep(0.05)  # the result reaches the loop
            late = compiler.lookup(schema(4))  # its late result is cached and served
            compiler.cache = GrammarCache(compiler.limits.cache_bytes)  # evicted: the spec stays refused
            with pytest.raises(GrammarTimedOut):
                compiler.lookup(schema(4))
            return str(first.value), waited, str(again.value), late, compiler.stats(), len(gate.entered)
        finally:
            gate.release.set()
            compiler.close()

    first, waited, again, late, stats, entered = run_async(main())
    assert "timed out after 0.3 s" in first and "--max-grammar-seconds" in first
    assert 0.3 <= waited < 5.0
    assert "not compiled again" in again
    assert late is not None and entered == 1
    assert stats["timeouts"] == 1 and stats["refused_specs"] == 1


def test_a_queued_compile_nobody_waits_for_never_runs(tokenizer):
    async def main():
        compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(concurrency=1, max_seconds=30))
        gate = Gate(compiler)
        try:
            holder = asyncio.ensure_future(compiler.compile(schema(1)))
            await until(lambda: len(gate.entered) == 1)
            queued = asyncio.ensure_future(compiler.compile(schema(2)))
            await until(lambda: compiler.pool.queued == 1)
            queued.cancel()  # its only waiter left
            await asyncio.gather(queued, return_exceptions=True)
            gate.release.set()
            await holder
            shared = await asyncio.gather(*[compiler.compile(schema(3)) for _ in range(3)])
            return gate.entered, shared, compiler.compilations
        finally:
            gate.release.set()
            compiler.close()

    entered, shared, compilations = run_async(main())
    assert entered == [schema(1), schema(3)]  # schema(2) never took the thread
    assert shared[0] is shared[1] is shared[2] and compilations == 2


def test_the_pool_runs_at_most_size_jobs_in_daemon_threads_and_cancels_queued_ones_on_shutdown():
    pool = CompilePool(2)
    gate = threading.Event()
    jobs = [pool.submit(lambda: gate.wait(30)) for _ in range(3)]
    deadline = time.monotonic() + 10
    while len(pool.running()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert pool.queued == 1 and all(t.daemon for t in pool._threads)
    pool.shutdown()  # returns at once although two jobs are running
    assert jobs[2].future.cancelled()
    gate.set()
    assert jobs[0].future.result(10) is True and jobs[1].future.result(10) is True
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
