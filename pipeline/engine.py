"""The engine: builds the stage graph from a config and serves generate() / abort() / shutdown().

    generate() ─▶ Intake ─▶ Prefill ─▶ Decode ─▶ Detokenize ─▶ Stream ─▶ OutputChannel ─▶ caller
                                 ▲        │  (preempted sequences go back to prefill)
                                 └────────┘
Prefill and decode share one device through the DeviceExecutor thread and one KV cache manager
(which owns the KV block pool: the stages ask it, they never touch the pool). What each device step
holds is decided in one place, the StepPlanner, from both stages' offers.

With expert parallelism (``ep_size`` > 1) this process is rank 0: its runner's comm stage sends every step to the
worker ranks before running it (pipeline/dist/), and a worker that ends fails the engine.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pipeline.config import EngineConfig
from pipeline.cpu_threads import CpuThreads, set_cpu_threads
from pipeline.dist.ranks import ParallelContext, start_head
from pipeline.errors import AdmissionRefused, EngineDead, InvalidRequest
from pipeline.interpreter_tuning import InterpreterSettings, restore, tune_for_serving
from pipeline.live_stats import LiveStats
from pipeline.loading import LoadedModel, load_model
from pipeline.memory.cache_manager import CacheManager
from pipeline.memory.kv_offload import kv_offload, offload_stats
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.memory.snapshot_tiers import snapshot_pool
from pipeline.memory.state_snapshots import snapshot_stats
from pipeline.memory.state_slots import StateSlotPool
from pipeline.messages import IntakeItem
from pipeline.output_channel import OutputChannel
from pipeline.prompt import PromptRenderer
from pipeline.request import CancelReason, OutputDelta, Request, SamplingParams, new_request_id
from pipeline.runner.executor import DeviceExecutor
from pipeline.scheduler import SeatPool, WaitingGauge
from pipeline.spec.budget import draft_token_cost
from pipeline.stage import Stage
from pipeline.stages.decode import DecodeStage
from pipeline.stages.detokenize import DetokenizeStage
from pipeline.stages.intake import IntakeStage
from pipeline.stages.prefill import PrefillStage
from pipeline.stages.stream import StreamStage
from pipeline.stages.verify import VerifyStage
from pipeline.step_planner import StepPlanner
from pipeline.trace_files import TraceFiles, prepare_trace_dir
from pipeline.tracing import CudaClock, TraceRecorder

if TYPE_CHECKING:
    from pipeline.grammar.compiler import GrammarCompiler

log = logging.getLogger("conveyor.engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, executor: DeviceExecutor,
                 parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.loaded = loaded
        self.parallel = parallel
        self.tokenizer = loaded.tokenizer
        states = StateSlotPool(loaded.runner.num_state_slots - 1) if loaded.runner.num_state_slots else None
        snapshots = loaded.runner.snapshots[0].shape[0] if loaded.runner.snapshots else 0
        on_gpu = str(loaded.runner.device).startswith("cuda")  # pinned host tiers; priced exact verify rows
        self.cache = CacheManager(KVBlockPool(loaded.num_blocks, config.block_size), states, config.prefix_caching,
                                  kv_offload(config, loaded.runner.paged_caches, bool(loaded.runner.bytes_per_snapshot),
                                             on_gpu),
                                  snapshot_pool(config, snapshots, loaded.runner.bytes_per_snapshot, on_gpu)
                                  if snapshots else None)
        self.seats = SeatPool(config.max_num_seqs)
        self.waiting = WaitingGauge(config.max_waiting_requests, config.max_waiting_tokens)
        self.executor = executor
        executor.bind(loaded.runner.launch)
        seat_bound = config.max_num_seqs + config.stage_queue_size  # never full: see scheduler.py
        self.stream = StreamStage(config.stage_queue_size)
        self.detokenize = DetokenizeStage(config.stage_queue_size, tokenizer=self.tokenizer, stream=self.stream)
        shared = dict(cache=self.cache, seats=self.seats, executor=self.executor, detokenize=self.detokenize)
        self.live = LiveStats()  # the dashboard's history (web/dashboard.py)
        self.planner = StepPlanner(cache=self.cache, seats=self.seats, executor=self.executor,
                                   token_budget=config.max_num_batched_tokens, live=self.live)
        self.verify = VerifyStage(config.stage_queue_size, drafter=loaded.drafter, executor=self.executor)
        self.decode = DecodeStage(seat_bound, planner=self.planner, run_ahead=config.run_ahead, verify=self.verify,
                                  num_speculative_tokens=config.num_speculative_tokens,
                                  draft_token_cost=draft_token_cost(config.exact_speculation, on_gpu), **shared)
        self.prefill = PrefillStage(seat_bound, waiting_gauge=self.waiting, planner=self.planner,
                                    decode=self.decode, **shared)
        self.planner.bind(decode=self.decode, prefill=self.prefill)
        self.renderer = PromptRenderer(self.tokenizer, loaded.limits.chat_template, loaded.limits.vocab_size)
        self.intake = IntakeStage(config.stage_queue_size, renderer=self.renderer, limits=loaded.limits,
                                  waiting_gauge=self.waiting, prefill=self.prefill, seed=config.seed,
                                  grammars=self.grammar_compiler)
        self.stages: list[Stage] = [self.intake, self.prefill, self.decode, self.verify, self.detokenize,
                                    self.stream]
        # request traces (GET /debug/trace, --trace-dir): every stage, the planner and the device thread record into it
        self.trace = TraceRecorder(config.trace_buffer_events, CudaClock(loaded.runner.device) if on_gpu else None)
        for part in (*self.stages, self.planner, executor):
            part.trace = self.trace
        self._trace_files = (TraceFiles(self.trace, config.trace_dir, config.trace_file_seconds, config.trace_max_files,
                                        tuple(stage.name for stage in self.stages))
                             if config.trace_dir is not None else None)
        self._trace_writer: asyncio.Task[None] | None = None
        self._live: dict[str, Request] = {}
        self._channels: dict[str, OutputChannel] = {}
        self._aborted_before_admission: set[str] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.draining = False
        self.stopping = False  # the drain ran out of time: what was in flight is cancelled (cancel_in_flight)
        self._tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._live_sampler: asyncio.Task[None] | None = None
        self._interpreter: InterpreterSettings | None = None  # what create() replaced (shutdown restores it)
        self.cpu_threads: CpuThreads | None = None  # the CPU backend's threads (shutdown restores the count)
        self.failure: BaseException | None = None
        self._grammars: GrammarCompiler | None = None

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer, made on first use (its xgrammar side is built by the
        first compilation, on a compile thread)."""
        if self._grammars is None:
            from pipeline.grammar.compiler import GrammarCompiler, GrammarLimits

            limits, config = self.loaded.limits, self.config
            bounds = GrammarLimits(concurrency=config.max_grammar_concurrency, max_bytes=config.max_grammar_bytes,
                                   max_seconds=config.max_grammar_seconds, cache_bytes=config.grammar_cache_bytes)
            self._grammars = GrammarCompiler(self.tokenizer, limits.vocab_size, sorted(limits.eos_token_ids), bounds)
        return self._grammars

    @classmethod
    async def create(cls, config: EngineConfig, progress: Callable[[str], None] | None = None) -> Engine:
        """Load the model on the device thread (off the event loop), then start every stage."""
        config = config.resolved()
        config.validate()
        if config.trace_dir is not None:  # a directory it cannot write is refused before the model loads
            prepare_trace_dir(config.trace_dir)
        executor = DeviceExecutor()
        parallel: ParallelContext | None = None
        threads = None
        try:
            if config.cpu_threads is not None:  # OpenMP counts per thread: this one and the device thread
                threads = set_cpu_threads(config.cpu_threads)
                await executor.call(lambda: set_cpu_threads(config.cpu_threads))
            if config.ep_size > 1:
                parallel = await executor.call(lambda: start_head(config, progress or (lambda m: None)))
            loaded = await executor.call(lambda: load_model(config, progress, parallel))
        except BaseException:
            if parallel is not None:
                parallel.abort()
                await asyncio.to_thread(parallel.close, 5.0)
            await asyncio.to_thread(executor.shutdown)
            if threads is not None:
                threads.restore()
            raise
        engine = cls(config, loaded, executor, parallel)
        engine.cpu_threads = threads
        engine.start()
        if parallel is not None:
            loop = asyncio.get_running_loop()
            parallel.on_lost = lambda rank, code: loop.call_soon_threadsafe(engine.rank_lost, rank, code)
            for rank, process in enumerate(parallel.workers, start=1):  # one that ended while loading finished
                if process.poll() is not None:
                    engine.rank_lost(rank, process.returncode)
        engine._interpreter = tune_for_serving(config.gc_young_threshold, config.gil_switch_interval_s)
        return engine

    def start(self) -> None:
        from pipeline.live_reading import read_engine  # it reads an Engine: imported here, not in a circle

        self._tasks = [asyncio.create_task(stage.run(), name=f"stage-{stage.name}") for stage in self.stages]
        self._watchdog = asyncio.create_task(self._watch(), name="engine-watchdog")
        if self._trace_files is not None:
            self.trace.set_continuous(True)
            self._trace_writer = asyncio.create_task(self._trace_files.run(), name="trace-files")
        self._live_sampler = asyncio.create_task(self.live.run(lambda: read_engine(self)), name="live-stats")

    async def _watch(self) -> None:
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                self.failure = task.exception()
                log.error("stage %s failed", task.get_name(), exc_info=self.failure)
                break
        error = EngineDead(f"engine stopped: {self.failure!r}" if self.failure else "engine stopped")
        for channel in self._channels.values():
            channel.fail(error)

    def rank_lost(self, rank: int, exit_code: int) -> None:
        """An expert-parallel worker ended: every step needs it, so the engine fails (requests in flight get the
        error, /health turns 503) and the groups are aborted, so a collective waiting for the rank returns."""
        if self.failure is not None:
            return
        self.failure = EngineDead(f"expert-parallel rank {rank} ended (exit code {exit_code})")
        log.error("%s", self.failure)
        for channel in self._channels.values():
            channel.fail(self.failure)
        for task in self._tasks:
            task.cancel()
        if self.parallel is not None:
            self.parallel.abort()

    @property
    def alive(self) -> bool:
        return self.failure is None and bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """Stream output deltas (one per sample per step, merged if the caller reads slowly).

        Raises InvalidRequest / AdmissionRefused before the first delta. Closing the iterator early
        cancels the request, which frees its sequences within one step.
        """
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.failure!r}")
        params = params or SamplingParams()
        if self.draining:
            raise AdmissionRefused("the server is shutting down")
        request_id = request_id or new_request_id()
        if request_id in self._channels:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        channel = OutputChannel(params.n, self.config.output_channel_cap_bytes)
        self._channels[request_id] = channel
        self._drained.clear()
        item = IntakeItem(request_id, channel, params, prompt, prompt_token_ids, messages,
                          dict(chat_template_kwargs or {}), on_admitted=self._on_admitted)
        complete = False
        try:
            await self.intake.put(item)
            while (delta := await channel.next_delta()) is not None:
                yield delta
            complete = True
        finally:
            self._channels.pop(request_id, None)
            if not self._channels:
                self._drained.set()
            request = self._live.pop(request_id, None)
            if self.trace.recording:
                self.trace.request_ended(request_id, request, complete)
            if not complete:  # the admitted Request's flag too; intake drops a request it has not admitted yet
                item.cancel.cancel(CancelReason.CLIENT_DISCONNECTED)

    def _on_admitted(self, request: Request) -> None:
        self._live[request.request_id] = request
        if request.request_id in self._aborted_before_admission:
            self._aborted_before_admission.discard(request.request_id)
            request.cancel.cancel(CancelReason.ABORTED)

    def admitted(self, request_id: str) -> Request | None:
        """The admitted Request of a request in flight (its timings and counts, read when it ends: web/otel_spans.py);
        None before admission and after its last delta."""
        return self._live.get(request_id)

    def abort(self, request_id: str, reason: CancelReason = CancelReason.ABORTED) -> bool:
        """Cancel a request; its sequences end and free their blocks at the owning stage's next step."""
        request = self._live.get(request_id)
        if request is not None:
            request.cancel.cancel(reason)
            return True
        if request_id in self._channels:
            self._aborted_before_admission.add(request_id)
            return True
        return False

    @property
    def num_requests(self) -> int:
        """Requests between generate() and their last delta (admitted or not yet)."""
        return len(self._channels)

    def begin_drain(self) -> None:
        """Stop admitting: new requests get AdmissionRefused; in-flight ones go on."""
        self.draining = True
        self.intake.draining = True

    def cancel_in_flight(self) -> None:
        """The drain ran out of time: cancel every request in flight. Each admitted sample ends within one step with
        finish_reason abort ("length" on the wire, invariant 2), so its handler still writes its last events; one
        not admitted yet is refused (the engine is draining)."""
        self.stopping = True
        for request_id in list(self._channels):
            self.abort(request_id, CancelReason.SHUTDOWN)

    async def wait_drained(self, timeout_s: float) -> bool:
        """True when every in-flight request finished within the timeout."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def health(self) -> str | None:
        """None when healthy, else why not (stopped, draining, a device step that hangs, intake stuck on a request,
        or every grammar compile thread held by a compilation that outran its bounds)."""
        if not self.alive:
            return f"engine stopped: {self.failure!r}" if self.failure else "engine stopped"
        if self.draining:
            return "draining"
        busy_since = self.executor.busy_since
        if busy_since is not None and time.monotonic() - busy_since > self.config.wedged_step_s:
            return f"a device step has been running for {time.monotonic() - busy_since:.0f}s"
        now, config = time.monotonic(), self.config
        stalled = self.intake.stalled(now, config.wedged_intake_s)
        if stalled is None and self._grammars is not None:
            stalled = self._grammars.wedged(now, max(config.wedged_intake_s, config.max_grammar_seconds))
        return stalled

    def tokenize(self, prompt: str | None = None, *, messages: list[dict[str, Any]] | None = None,
                 add_special_tokens: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.renderer.token_ids(prompt=prompt, messages=messages, chat_template_kwargs=chat_template_kwargs,
                                       add_special_tokens=add_special_tokens)

    def stats(self) -> dict[str, Any]:
        return {
            "stages": {stage.name: stage.snapshot() for stage in self.stages},
            "kv_blocks": {"total": self.cache.capacity, "used": self.cache.num_used, "free": self.cache.num_free,
                          "cached_free": self.cache.num_cached_free},
            "prefix_cache": {"enabled": self.cache.prefix_caching, "queried_tokens": self.cache.prefix_queried_tokens,
                             "hit_tokens": self.cache.prefix_hit_tokens, "evictions": self.cache.prefix_evictions},
            "kv_offload": offload_stats(self.cache.offload),
            "state_snapshots": snapshot_stats(self.cache.snapshots),
            "seats": {"capacity": self.seats.capacity, "held": self.seats.held},
            "state_slots_used": self.cache.num_state_slots_used,
            "waiting": {"requests": self.waiting.requests, "tokens": self.waiting.tokens},
            "running": len(self.decode.running),
            "decode_in_flight": int(self.decode.in_flight is not None),
            "decode_steps_ahead": self.decode.steps_ahead,
            "prefilling": len(self.prefill.waiting),
            "preemptions": self.decode.preemptions,
            "device_steps": self.executor.steps,
            "mixed_steps": self.planner.mixed_steps,
            "speculation": {"method": self.config.speculative_method, **asdict(self.decode.spec)},
            "expert_parallel": self._parallel_stats(),
            "grammar": self._grammars.stats() if self._grammars is not None else None,
        }

    def _parallel_stats(self) -> dict[str, Any]:
        parallel, comm = self.parallel, self.loaded.runner.comm
        if parallel is None or comm is None:
            return {"size": 1}
        return {"size": parallel.size, "split_linear_attention": self.loaded.arch.linear_head_shard.size > 1,
                "messages": comm.number, "message_bytes": comm.bytes_sent,
                "workers": [{"rank": rank, "pid": p.pid, "exit_code": p.poll()}
                            for rank, p in enumerate(parallel.workers, start=1)]}

    async def shutdown(self) -> None:
        for request in list(self._live.values()):
            request.cancel.cancel(CancelReason.SHUTDOWN)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watchdog is not None:
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._live_sampler is not None:
            self._live_sampler.cancel()
            await asyncio.gather(self._live_sampler, return_exceptions=True)
        if self._trace_writer is not None:  # the last file: what was recorded since the previous one
            self._trace_writer.cancel()
            await asyncio.gather(self._trace_writer, return_exceptions=True)
            await self._trace_files.write()
            self.trace.set_continuous(False)
        if self._grammars is not None:
            self._grammars.close()  # its threads never hold the process: a compile xgrammar cannot stop ends alone
        runner = self.loaded.runner
        if self._interpreter is not None:
            restore(self._interpreter)
        parallel = self.parallel
        if parallel is None:
            await self.executor.call(lambda: (gc.collect(), runner.release()))  # frees device memory on its thread
        else:  # the workers stop on STOP; a device thread stuck on a lost rank is not waited for long
            def stop() -> None:
                if self.failure is None and runner.comm is not None:
                    runner.comm.stop()
                gc.collect()
                runner.release()

            try:
                await asyncio.wait_for(self.executor.call(stop), self.config.ep_timeout_s)
            except Exception:  # noqa: BLE001 (a lost rank: the engine failed already)
                log.exception("stopping the expert-parallel workers")
            await asyncio.to_thread(parallel.close, 30.0)
        await asyncio.to_thread(self.executor.shutdown)
        if self.cpu_threads is not None:
            self.cpu_threads.restore()
        if self.cache.offload is not None:
            self.cache.offload.close()
