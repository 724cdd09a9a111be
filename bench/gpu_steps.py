"""bench/gpu.py's step section: where a decode step's time goes, at several batch sizes, and what a
multi-token (verify) step costs.

For each batch (every sequence at the same context length) on the engine's own runner, on its
device thread: the graph replay alone (CUDA events), a launch + wait loop (what step-by-step
decode costs), a run-ahead loop (launch N+1 fed from N, then wait for N), and the host time of a
launch. At the smallest and largest batch, the top kernels of three steps from torch.profiler; then one
prefill-sized step (16 prompts of 512 tokens, OFF's prompts) with its top kernels.

`component_shares`: where a decode step's device time goes by layer kind. Each component (all recurrent
mixers, all attention mixers, all MLP / MoE blocks, the norms, the lm_head) runs on the step's own inputs,
captured as one CUDA graph per component and replayed alone (every layer's weights arrive cold, as in the
step); their sum beside the whole step's replay shows what the split leaves out (embedding, sampling).

`verify_cost`: the forward of rows of q = K+1 tokens with logits at every position (what a
speculative verify step runs), q = 1..8, at batch 1 and 64, through the runner's CUDA graphs
(captured for q up to 8) and eagerly: its time against one decode step's.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pipeline.request import SamplingParams
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner.step_plan import ScheduledChunk, StepPlan, build_step_plan


def decode_plan(batch: int, context: int, block_size: int, fed: bool, query_len: int = 1) -> StepPlan:
    """`batch` rows of `query_len` tokens after `context` cached ones, logits at every token."""
    per_seq = -(-(context + query_len) // block_size)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    chunks = []
    for i in range(batch):
        rows = [SamplingRow(params, [], [], frozenset(), seed=i, counter=0) for _ in range(query_len)]
        blocks = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        chunks.append(ScheduledChunk([100 + i + j for j in range(query_len)], context, blocks, rows,
                                     previous_row=i * query_len + query_len - 1 if fed else -1,
                                     logits_offsets=list(range(query_len))))
    return build_step_plan(chunks, block_size)


def prefill_plan(prompts: int, prompt_len: int, block_size: int) -> StepPlan:
    """One prefill step: `prompts` whole prompts of `prompt_len` tokens, logits at each prompt's last token."""
    per_seq = -(-prompt_len // block_size)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    chunks = [ScheduledChunk([(7 * i + j) % 30000 + 100 for j in range(prompt_len)], 0,
                             list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
                             [SamplingRow(params, [], [], frozenset(), seed=i, counter=0)],
                             previous_row=-1, logits_offsets=[prompt_len - 1]) for i in range(prompts)]
    return build_step_plan(chunks, block_size)


def prefill_step(runner, prompts: int, prompt_len: int, iters: int = 5) -> dict:
    """A prefill-sized step (eager: no graph holds it): device ms, tokens/s and its top kernels."""
    forward = prefill_plan(prompts, prompt_len, runner.block_size).forward
    ms = _device_ms(lambda: runner.compute_logits(forward), iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.compute_logits(forward)
        torch.cuda.synchronize()
    return {"prompts": prompts, "prompt_len": prompt_len, "device_ms": ms,
            "tok_s": prompts * prompt_len / ms * 1e3, "top_kernels": top_kernels(prof)}


def top_kernels(prof, count: int = 20) -> dict:
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"total_device_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "kernels": [{"name": e.key[:90], "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3}
                        for e in events[:count]]}


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
        if runner.graphs is not None and runner.graphs.fits(batch, 1, plain.forward.block_tables.shape[1]):
            replay_ms = _device_ms(lambda: runner.graphs.run(plain.forward), iters)
        results[str(batch)] = {"stepwise_ms": stepwise_ms, "run_ahead_ms": ahead_ms, "graph_replay_ms": replay_ms,
                               "host_launch_ms_p50": float(np.median(host_launch)) * 1e3}
    for batch in (batches[0], batches[-1]):
        plan = decode_plan(batch, context, runner.block_size, fed=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.launch(plan).to_host()
        results[f"top_kernels_3_steps_batch{batch}"] = top_kernels(prof)
    results["context"] = context
    results["components"] = component_shares(runner, batches, context)
    results["prefill"] = prefill_step(runner, 16, 512)
    return results


def _graph_ms(fn, iters: int) -> float:
    """Device ms of one replay of ``fn`` captured as a CUDA graph (warmed up eagerly first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _device_ms(graph.replay, iters)


@torch.inference_mode()
def component_shares(runner, batches: list[int], context: int, iters: int = 20) -> dict:
    """Per batch: device ms of each layer kind's share of a decode step, and of the whole step (graph replay)."""
    model = runner.model
    layers = list(model.model.layers)
    hidden = model.model.embed_tokens.weight.shape[1]
    dtype = model.model.embed_tokens.weight.dtype
    results: dict = {}
    for batch in batches:
        forward = decode_plan(batch, context, runner.block_size, fed=False).forward
        saved, runner.graphs = runner.graphs, None  # the eager context of the same batch
        try:
            prepared = runner.prepare(forward)
        finally:
            runner.graphs = saved
        ctx = prepared.context
        model.prepare_context(prepared.positions, ctx)
        x = torch.randn(batch, hidden, device=runner.device, dtype=dtype)
        residual = x.clone()
        groups = {
            "recurrent_mixers": [lambda m=l.linear_attn: m(x, ctx) for l in layers
                                 if getattr(l, "linear_attn", None) is not None],
            "attention_mixers": [lambda m=l.self_attn: m(x, ctx) for l in layers
                                 if getattr(l, "self_attn", None) is not None],
            "mlp_or_moe": [lambda m=l.mlp: m(x) for l in layers],
            "norms": [lambda m=n: m(x, residual) for l in layers
                      for n in (l.input_layernorm, l.post_attention_layernorm)]
            + [lambda: model.model.norm(x)],
            "lm_head": [lambda: model.compute_logits(x)],
        }
        row: dict = {}
        for name, calls in groups.items():
            if calls:
                row[name] = _graph_ms(lambda calls=calls: [c() for c in calls], iters)
        step = (_device_ms(lambda: runner.graphs.run(forward), iters)
                if runner.graphs is not None and runner.graphs.fits(batch, 1, forward.block_tables.shape[1]) else None)
        total = sum(row.values())
        results[str(batch)] = {"ms": row, "sum_ms": total, "step_replay_ms": step,
                               "share": {k: v / total for k, v in row.items()}}
    return results


def _device_ms(step, iters: int) -> float:
    """Mean device time of `step()` over `iters` back-to-back calls (CUDA events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def verify_cost(runner, batches: list[int], context: int, max_query_len: int = 8, iters: int = 20) -> dict:
    """Forward time of rows of q tokens (logits at all q) against q = 1, per batch: graph and eager.
    Runs on the device thread; captures graphs for q <= max_query_len first if the runner has none."""
    if runner.graphs is None or runner.graphs.max_query_len < max_query_len:
        max_model_len = runner.graphs.max_blocks * runner.block_size if runner.graphs else context + 64
        runner.capture_decode_graphs(max(batches), max_model_len, max_query_len)
    results: dict = {"context": context}
    for batch in batches:
        rows: dict = {}
        for q in range(1, max_query_len + 1):
            forward = decode_plan(batch, context, runner.block_size, fed=False, query_len=q).forward
            graphs = runner.graphs
            graph_ms = (_device_ms(lambda: graphs.run(forward), iters)
                        if graphs.fits(batch, q, forward.block_tables.shape[1]) else None)
            saved, runner.graphs = runner.graphs, None  # the eager path for the same batch
            try:
                eager_ms = _device_ms(lambda: runner.compute_logits(forward), iters)
            finally:
                runner.graphs = saved
            rows[str(q)] = {"graph_ms": graph_ms, "eager_ms": eager_ms}
        base = rows["1"]["graph_ms"] or rows["1"]["eager_ms"]
        for entry in rows.values():
            entry["vs_decode_step"] = (entry["graph_ms"] or entry["eager_ms"]) / base
        results[f"batch{batch}"] = rows
    return results


async def verify_profile(engine, batches: list[int], context: int) -> dict:
    runner = engine.loaded.runner
    return await engine.executor.call(lambda: verify_cost(runner, batches, context))


async def step_profile(engine, batches: list[int], context: int) -> dict:
    runner = engine.loaded.runner
    return await engine.executor.call(lambda: profile_runner(runner, batches, context))
