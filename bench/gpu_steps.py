"""bench/gpu.py's step section: where a decode step's time goes, at several batch sizes.

For each batch (every sequence at the same context length) on the engine's own runner, on its
device thread: the graph replay alone (CUDA events), a launch + wait loop (what step-by-step
decode costs), a run-ahead loop (launch N+1 fed from N, then wait for N), and the host time of a
launch. At the largest batch, the top kernels of one step from torch.profiler.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pipeline.request import SamplingParams
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner.step_plan import ScheduledChunk, StepPlan


def decode_plan(batch: int, context: int, block_size: int, fed: bool) -> StepPlan:
    per_seq = -(-(context + 1) // block_size)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    chunks = []
    for i in range(batch):
        row = SamplingRow(params, [], [], frozenset(), seed=i, counter=0)
        blocks = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        chunks.append(ScheduledChunk([100 + i], context, blocks, [row], previous_row=i if fed else -1))
    return StepPlan(chunks)


def profile_runner(runner, batches: list[int], context: int, iters: int = 20) -> dict:
    """Runs on the device thread (the runner's owner)."""
    results: dict = {}
    for batch in batches:
        plain = decode_plan(batch, context, runner.block_size, fed=False)
        fed = decode_plan(batch, context, runner.block_size, fed=True)
        for _ in range(3):
            runner.launch(plain).to_host()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            runner.launch(plain).to_host()
        stepwise_ms = (time.perf_counter() - start) * 1e3 / iters

        previous = runner.launch(plain)
        host_launch = []
        start = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            current = runner.launch(fed, previous.token_ids)
            host_launch.append(time.perf_counter() - t)
            previous.to_host()
            previous = current
        previous.to_host()
        ahead_ms = (time.perf_counter() - start) * 1e3 / iters

        replay_ms = None
        if runner.graphs is not None and runner.graphs.fits(batch, len(plain.chunks[0].block_ids)):
            from ext import load

            inputs = load("step_inputs").build_step_inputs(
                [c.token_ids for c in plain.chunks], [c.start_pos for c in plain.chunks],
                [c.block_ids for c in plain.chunks], runner.block_size)
            ids, pos, slots, _, lens, tables = inputs
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            runner.graphs.run(ids, pos, slots, lens, tables)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(iters):
                runner.graphs.run(ids, pos, slots, lens, tables)
            end.record()
            torch.cuda.synchronize()
            replay_ms = begin.elapsed_time(end) / iters
        results[str(batch)] = {"stepwise_ms": stepwise_ms, "run_ahead_ms": ahead_ms, "graph_replay_ms": replay_ms,
                               "host_launch_ms_p50": float(np.median(host_launch)) * 1e3}
    for batch in (batches[0], batches[-1]):
        plan = decode_plan(batch, context, runner.block_size, fed=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.launch(plan).to_host()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        results[f"top_kernels_3_steps_batch{batch}"] = {
            "total_device_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "kernels": [{"name": e.key[:90], "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3}
                        for e in events[:20]]}
    results["context"] = context
    return results


async def step_profile(engine, batches: list[int], context: int) -> dict:
    runner = engine.loaded.runner
    return await engine.executor.call(lambda: profile_runner(runner, batches, context))
