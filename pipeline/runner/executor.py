"""The device executor: one thread owns the device; stages await step results as futures.

The thread owns everything device-side from the start: the engine loads the model through
`call()`, so weights, KV cache and the thread's math library state live where the steps run
(loading in another thread measured ~25% slower CPU steps here). The event loop never blocks on
compute. When several stages have a plan waiting (decode's batch and prefill's chunk), the thread
merges them into one forward: that is the mixed step.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import StepPlan, merge_plans, split_output

T = TypeVar("T")


@dataclass(slots=True)
class _Step:
    plan: StepPlan
    future: asyncio.Future[SamplerOutput]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Call:
    function: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


_STOP = object()


class DeviceExecutor:
    def __init__(self, execute: Callable[[StepPlan], SamplerOutput] | None = None,
                 name: str = "conveyor-device") -> None:
        self._execute = execute
        self._jobs: queue.SimpleQueue[_Step | _Call | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.steps = 0
        self.merged_steps = 0
        self.busy_since: float | None = None  # monotonic start of the job running now (health checks)
        self._thread.start()

    def bind(self, execute: Callable[[StepPlan], SamplerOutput]) -> None:
        """Set the step function (the model runner's execute) once it was built on this thread."""
        self._execute = execute

    async def call(self, function: Callable[[], T]) -> T:
        """Run any function on the device thread (model loading, cache setup)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Call(function, future, loop))
        return await future

    async def submit(self, plan: StepPlan) -> SamplerOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SamplerOutput] = loop.create_future()
        self._jobs.put(_Step(plan, future, loop))
        return await future

    def shutdown(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        pending: list[object] = []
        while True:
            job = pending.pop(0) if pending else self._jobs.get()
            if job is _STOP:
                return
            self.busy_since = time.monotonic()
            if isinstance(job, _Call):
                self._run_call(job)
                self.busy_since = None
                continue
            steps = [job]
            while True:  # take every plan already waiting: they run as one forward
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(more, _Step):
                    steps.append(more)
                else:
                    pending.append(more)
                    break
            self._run_steps(steps)  # type: ignore[arg-type]
            self.busy_since = None

    @staticmethod
    def _run_call(job: _Call) -> None:
        try:
            result = job.function()
        except BaseException as exc:
            job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
        else:
            job.loop.call_soon_threadsafe(_set_result, job.future, result)

    def _run_steps(self, jobs: list[_Step]) -> None:
        plans = [job.plan for job in jobs]
        try:
            if self._execute is None:
                raise RuntimeError("the device executor has no model bound")
            output = self._execute(merge_plans(plans))
            parts = split_output(output, plans)
        except BaseException as exc:  # delivered to every waiting stage, never lost in the thread
            for job in jobs:
                job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            return
        self.steps += 1
        self.merged_steps += len(jobs) > 1
        for job, part in zip(jobs, parts):
            job.loop.call_soon_threadsafe(_set_result, job.future, part)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
