"""The device executor: one thread owns the device; stages await step results as futures.

The thread owns everything device-side from the start: the engine loads the model through
`call()`, so weights, KV cache and the thread's math library state live where the steps run
(loading in another thread measured ~25% slower CPU steps here). The event loop never blocks on
compute. Each launch is one forward: what a step holds (decode rows, prompt chunks: a mixed step)
was decided before, by the step planner.

Launching and fetching are apart, so a stage can queue step N+1 before it waits for step N's
tokens: a second thread waits for step N's device->host copy while this one launches step N+1.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from torch import Tensor

from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import StepPlan
from pipeline.tracing import TRACE_OFF, TraceRecorder

T = TypeVar("T")
log = logging.getLogger("conveyor.executor")


class LaunchedSample(Protocol):
    """What a launch returns: tokens left on the device, and the host copy on demand."""

    token_ids: Tensor

    def is_ready(self) -> bool: ...

    def to_host(self) -> SamplerOutput: ...


# (plan, the feeding lane's previous device tokens, a getter of the same tokens on the host)
Launch = Callable[[StepPlan, "Tensor | None", "Callable[[], np.ndarray] | None"], LaunchedSample]


@dataclass(slots=True)
class LaunchedStep:
    """A stage's plan, queued on the device. Its results are fetched with `DeviceExecutor.fetch`,
    usually after the stage has launched its next step (one step ahead)."""

    plan: StepPlan
    lane: str  # the launching stage: `previous_row` refers to that stage's previous step
    launched: asyncio.Future[LaunchedSample]
    loop: asyncio.AbstractEventLoop
    number: int = 0  # launches numbered from 1 (what a trace joins a step's makeup and its timing by)


@dataclass(slots=True)
class _Call:
    function: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Post:
    function: Callable[[], None]


_STOP = object()


class DeviceExecutor:
    def __init__(self, launch: Launch | None = None, name: str = "conveyor-device") -> None:
        self._launch = launch
        self._jobs: queue.SimpleQueue[LaunchedStep | _Call | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        # Waits for device->host copies, so the device thread can launch the next step meanwhile.
        self._copy_waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-copies")
        # each lane's last launch; its tokens feed the lane's next step
        self._lane_samples: dict[str, LaunchedSample] = {}
        self.steps = 0
        self.launches = 0  # steps queued
        self.trace: TraceRecorder = TRACE_OFF  # the engine's recorder (pipeline/tracing.py): each job's span
        self._launching_since: float | None = None
        self._copy_waiting_since: float | None = None
        self._thread.start()

    @property
    def busy_since(self) -> float | None:
        """Monotonic start of the oldest device work still running (health checks)."""
        times = [t for t in (self._launching_since, self._copy_waiting_since) if t is not None]
        return min(times, default=None)

    def bind(self, launch: Launch) -> None:
        """Set the step function (the model runner's launch) once it was built on this thread."""
        self._launch = launch

    async def call(self, function: Callable[[], T]) -> T:
        """Run any function on the device thread (model loading, cache setup)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Call(function, future, loop))
        return await future

    def post(self, function: Callable[[], None]) -> None:
        """Queue ``function`` on the device thread and return at once; nothing waits for it. Jobs run in the order
        they are queued, so a step launched afterwards runs after it. ``function`` keeps its own errors (promised
        drafts record theirs, pipeline/spec/device_drafts.py): one that escapes is logged."""
        self._jobs.put(_Post(function))

    def launch(self, plan: StepPlan, lane: str) -> LaunchedStep:
        """Queue a step; returns at once."""
        loop = asyncio.get_running_loop()
        self.launches += 1
        step = LaunchedStep(plan, lane, loop.create_future(), loop, self.launches)
        self._jobs.put(step)
        return step

    async def fetch(self, step: LaunchedStep) -> SamplerOutput:
        """The launched step's host results; waits for the device to finish that step only."""
        sample = await step.launched
        if sample.is_ready():
            return sample.to_host()
        return await step.loop.run_in_executor(self._copy_waiter, self._wait_for_copy, sample)

    async def submit(self, plan: StepPlan, lane: str = "default") -> SamplerOutput:
        """Launch and wait: a step with nothing to overlap."""
        return await self.fetch(self.launch(plan, lane))

    def shutdown(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)
        self._copy_waiter.shutdown(wait=False)

    def _wait_for_copy(self, sample: LaunchedSample) -> SamplerOutput:
        self._copy_waiting_since = time.monotonic()
        try:
            return sample.to_host()
        finally:
            self._copy_waiting_since = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            started = self._launching_since = time.monotonic()
            trace = self.trace
            device_started = trace.device_mark() if trace.recording else None
            if isinstance(job, _Call):
                _settle(job.loop, job.future, job.function)
            elif isinstance(job, _Post):
                try:
                    job.function()
                except Exception:
                    log.exception("a job posted to the device thread failed")
            else:
                self._launch_step(job)  # type: ignore[arg-type]
            if trace.recording:
                trace.device_work(job, started, device_started)
            self._launching_since = None

    def _launch_step(self, step: LaunchedStep) -> None:
        try:
            if self._launch is None:
                raise RuntimeError("the device executor has no model bound")
            previous, previous_host = None, None
            if len(step.plan.forward.feed_targets):
                last = self._lane_samples.get(step.lane)
                if last is not None:
                    previous, previous_host = last.token_ids, lambda: last.to_host().token_ids
            sample = self._launch(step.plan, previous, previous_host)
        except BaseException as exc:  # delivered to the step's fetch, never lost in the thread
            self._lane_samples.pop(step.lane, None)
            step.loop.call_soon_threadsafe(_set_exception, step.launched, exc)
            return
        self.steps += 1
        self._lane_samples[step.lane] = sample
        step.loop.call_soon_threadsafe(_set_result, step.launched, sample)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], function: Callable[[], Any]) -> None:
    try:
        result = function()
    except BaseException as exc:
        loop.call_soon_threadsafe(_set_exception, future, exc)
    else:
        loop.call_soon_threadsafe(_set_result, future, result)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
