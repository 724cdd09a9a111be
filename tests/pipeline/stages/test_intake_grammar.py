"""Intake with grammars to compile: a compile never holds up other requests, a client that leaves while its grammar
compiles is dropped unadmitted, and /health reports an intake (or a compile pool) that is stuck."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pipeline.engine import Engine
from pipeline.errors import InvalidRequest
from pipeline.grammar.spec import GrammarSpec
from pipeline.request import FinishReason, SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.pipeline.grammar.test_structured_output import SCHEMA


class Gate:
    """Stands in for xgrammar's compile: each call blocks until the test releases it, then compiles for real."""

    def __init__(self, engine: Engine) -> None:
        compiler = engine.grammar_compiler()
        self.release = threading.Event()
        self.entered = 0
        self._compile = compiler._compile
        compiler._compile = self  # type: ignore[method-assign]

    def __call__(self, spec: GrammarSpec):
        self.entered += 1
        assert self.release.wait(30), "the test never released the compile"
        return self._compile(spec)


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.005)


def constrained(engine: Engine, **params):
    settings = dict(max_tokens=40, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA)) | params
    return collect(engine, prompt_token_ids=[100, 200, 300], params=SamplingParams(**settings))


def plain(engine: Engine):
    return collect(engine, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4, temperature=0.0))


def test_a_request_compiling_its_grammar_does_not_hold_up_a_plain_one(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        gate = Gate(engine)
        try:
            slow = asyncio.ensure_future(constrained(engine))
            await until(lambda: gate.entered == 1)
            fast = await asyncio.wait_for(plain(engine), 20)  # admitted and finished while the compile blocks
            compiling_meanwhile = not slow.done()
            gate.release.set()
            samples = await asyncio.wait_for(slow, 30)
            await settle(engine)
            assert_no_leaks(engine)
            return fast, compiling_meanwhile, samples
        finally:
            gate.release.set()
            await engine.shutdown()

    fast, compiling_meanwhile, samples = run_async(main())
    assert fast[0].finish_reason is FinishReason.LENGTH and len(fast[0].token_ids) == 4
    assert compiling_meanwhile
    assert samples[0].finish_reason is not None


def test_a_client_leaving_while_its_grammar_compiles_is_dropped_unadmitted(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        gate = Gate(engine)
        try:
            client = asyncio.ensure_future(constrained(engine))
            await until(lambda: gate.entered == 1)
            client.cancel()  # the client disconnects: the generator closes
            await asyncio.gather(client, return_exceptions=True)
            # the request stops waiting at once, before the compile ends
            await until(lambda: engine.stats()["stages"]["intake"].get("waiting_for_grammar") == 0, 5)
            gate.release.set()
            await until(lambda: not engine.grammar_compiler().pool.running())
            await asyncio.sleep(0.05)  # anything the compile's end would still set off
            await settle(engine)
            assert_no_leaks(engine)
            stats = engine.stats()
            after = await plain(engine)
            return stats, dict(engine._live), engine.num_requests, after
        finally:
            gate.release.set()
            await engine.shutdown()

    stats, live, in_flight, after = run_async(main())
    assert stats["stages"]["prefill"]["items_in"] == 0  # never admitted
    assert stats["running"] == 0 and stats["waiting"] == {"requests": 0, "tokens": 0}
    assert live == {} and in_flight == 0
    assert after[0].finish_reason is FinishReason.LENGTH


def test_health_fails_while_every_compile_thread_is_held_past_the_bound_then_recovers(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, wedged_intake_s=0.2, max_grammar_seconds=0.2,
                                                max_grammar_concurrency=1))
        gate = Gate(engine)
        try:
            assert engine.health() is None
            with pytest.raises(InvalidRequest) as timed_out:
                await constrained(engine)
            await until(lambda: engine.health() is not None)
            wedged = engine.health()
            served = await plain(engine)  # requests without a grammar are still served
            gate.release.set()
            await until(lambda: engine.health() is None)
            await settle(engine)
            assert_no_leaks(engine)
            return str(timed_out.value), wedged, served
        finally:
            gate.release.set()
            await engine.shutdown()

    timed_out, wedged, served = run_async(main())
    assert "timed out after 0.2 s" in timed_out
    assert "grammar compile threads" in wedged
    assert served[0].finish_reason is FinishReason.LENGTH


def test_health_fails_while_intake_is_stuck_on_a_request_then_recovers(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, wedged_intake_s=0.2))
        prefill, unblock = engine.intake.prefill, asyncio.Event()

        class StalledPrefill:  # prefill stops taking requests until the test says
            async def put(self, request) -> None:
                await unblock.wait()
                await prefill.put(request)

        engine.intake.prefill = StalledPrefill()
        try:
            request = asyncio.ensure_future(plain(engine))
            await until(lambda: engine.health() is not None)
            stalled = engine.health()
            unblock.set()
            samples = await asyncio.wait_for(request, 20)
            healthy = engine.health()
            await settle(engine)
            assert_no_leaks(engine)
            return stalled, healthy, samples
        finally:
            unblock.set()
            await engine.shutdown()

    stalled, healthy, samples = run_async(main())
    assert "intake has been on one request" in stalled
    assert healthy is None and samples[0].finish_reason is FinishReason.LENGTH
