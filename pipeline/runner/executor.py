"""The device executor: one thread owns the device; stages await step results as futures.

The event loop never blocks on compute. When several stages have a plan waiting (decode's batch
and prefill's chunk), the thread merges them into one forward: that is the mixed step.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import StepPlan, merge_plans, split_output


@dataclass(slots=True)
class _Job:
    plan: StepPlan
    future: asyncio.Future[SamplerOutput]
    loop: asyncio.AbstractEventLoop


_STOP = object()


class DeviceExecutor:
    def __init__(self, execute: Callable[[StepPlan], SamplerOutput], name: str = "conveyor-device") -> None:
        self._execute = execute
        self._jobs: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.steps = 0
        self.merged_steps = 0
        self._thread.start()

    async def submit(self, plan: StepPlan) -> SamplerOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SamplerOutput] = loop.create_future()
        self._jobs.put(_Job(plan, future, loop))
        return await future

    def shutdown(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            first = self._jobs.get()
            if first is _STOP:
                return
            jobs = [first]
            while True:  # take every plan already waiting: they run as one forward
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._jobs.put(_STOP)
                    break
                jobs.append(more)
            self._run(jobs)  # type: ignore[arg-type]

    def _run(self, jobs: list[_Job]) -> None:
        plans = [job.plan for job in jobs]
        try:
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


def _set_result(future: asyncio.Future[SamplerOutput], value: SamplerOutput) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[SamplerOutput], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
