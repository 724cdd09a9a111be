"""The engine with its experts split over two ranks (``ep_size=2``): this process is the head, the engine starts the
second rank as a `conveyor worker` process and drives it through the comm stage's messages (gloo on the CPU). Greedy
output equals one rank's, token for token, on a tiny Qwen3-MoE and a hybrid Qwen3.5-MoE: batches of 1..8 with
chunked prefill, a prefix-cache hit (device and host tier), n-gram and MTP speculation. Faults: a worker that is
killed or hangs fails the requests in flight and turns health bad within the stated bound, and a stopped head
stops its worker."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from pipeline.engine import Engine
from pipeline.errors import EngineDead
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BATCH_SIZES = (1, 3, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def moe_dir(make_model_dir):
    return make_model_dir("qwen3_moe", seed=3, num_experts=8)


@pytest.fixture(scope="module")
def hybrid_dir(make_model_dir):
    return make_model_dir("qwen3_5_moe_text", seed=5, num_experts=8)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def workload(engine: Engine) -> list[list[int]]:
    """Batches of 1, 3 and 8 prompts at once, then a prompt that shares a cached prefix with an earlier one."""
    outputs: list[list[int]] = []
    for size in BATCH_SIZES:
        batch = prompts(size, seed=size)
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy()) for p in batch])
        outputs += [r[0].token_ids for r in results]
    shared = prompts(1, seed=99)[0] * 3  # long enough for full cached blocks
    for tail in ([7, 8, 9], [70, 80]):
        outputs.append((await collect(engine, prompt_token_ids=shared + tail, params=greedy()))[0].token_ids)
    await settle(engine)
    assert_no_leaks(engine)
    return outputs


async def run_batch(config, batch: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], dict]:
    """Every prompt at once on an engine of ``config``: each one's tokens and the stats (settled, nothing leaked)."""
    engine = await Engine.create(config)
    try:
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q) for p, q in zip(batch, params)])
        await settle(engine)
        assert_no_leaks(engine)
        return [r[0].token_ids for r in results], engine.stats()
    finally:
        await engine.shutdown()


async def run_engine(model_dir, **overrides) -> tuple[list[list[int]], dict]:
    engine = await Engine.create(config_for(model_dir, max_num_batched_tokens=24, state_snapshot_interval=8,
                                            **overrides))
    try:
        return await workload(engine), engine.stats()
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("model,split", [("moe_dir", None), ("hybrid_dir", False), ("hybrid_dir", None)])
def test_two_ranks_give_one_ranks_tokens(request, model, split):
    """``split`` None: the default, which for a hybrid model keeps half of every Gated DeltaNet layer's heads and
    states on each rank; False: every rank holds them all."""
    model_dir = request.getfixturevalue(model)
    one, _ = run_async(run_engine(model_dir))
    two, stats = run_async(run_engine(model_dir, ep_size=2, ep_split_linear_attention=split))
    assert two == one
    parallel = stats["expert_parallel"]
    assert parallel["size"] == 2 and parallel["messages"] > 20 and parallel["workers"][0]["exit_code"] is None
    assert parallel["split_linear_attention"] == (model == "hybrid_dir" and split is None)
    assert stats["prefix_cache"]["hit_tokens"] > 0


BASE = prompts(1, seed=9)[0] * 2
OTHERS = [prompts(1, seed=60 + i)[0] * 3 for i in range(4)]


async def tiers_workload(model_dir, **overrides) -> tuple[list[list[int]], dict]:
    """A device pool that evicts BASE's blocks while other prompts run; BASE again resumes from the tiers."""
    engine = await Engine.create(config_for(model_dir, num_kv_blocks=30, max_num_seqs=2, state_snapshot_interval=8,
                                            **overrides))
    try:
        results = [(await collect(engine, prompt_token_ids=BASE, params=greedy()))[0].token_ids]
        for prompt in OTHERS:
            results.append((await collect(engine, prompt_token_ids=prompt, params=greedy()))[0].token_ids)
        for prompt in (BASE, BASE + results[0] + [11, 12]):
            results.append((await collect(engine, prompt_token_ids=prompt, params=greedy()))[0].token_ids)
        await settle(engine)
        assert_no_leaks(engine)
        return results, engine.stats()
    finally:
        await engine.shutdown()


def test_blocks_and_snapshots_the_tiers_restore_reach_the_worker(hybrid_dir, tmp_path):
    """The workers keep no tiers: what the head's host and disk tiers restore reaches them from its device."""
    off, _ = run_async(tiers_workload(hybrid_dir, prefix_caching=False))
    tiers = dict(kv_offload_host_gib=1 / 1024, kv_offload_dir=str(tmp_path), kv_offload_disk_gib=64 / 1024)
    two, stats = run_async(tiers_workload(hybrid_dir, ep_size=2, **tiers))
    assert two == off
    assert stats["kv_offload"]["restored_blocks"] > 0 and stats["state_snapshots"]["restored"] > 0


@pytest.fixture(scope="module")
def mtp_dir(make_model_dir):
    from tests.model_utils import add_mtp_weights

    directory = make_model_dir("qwen3_5_moe_text", seed=5, num_experts=8)
    add_mtp_weights(directory, "qwen3_5_moe_text", seed=5, num_experts=8)
    return directory


@pytest.fixture(scope="module")
def drafter_dirs(make_model_dir, mtp_dir, tmp_path_factory) -> dict:
    """The drafters' directories: a DFlash drafter of the hybrid model, a small dense draft model."""
    import json

    from tests.model_utils import write_dflash_drafter

    dflash = tmp_path_factory.mktemp("dflash")
    write_dflash_drafter(dflash, json.loads((mtp_dir / "config.json").read_text()), [0, 2], seed=13)
    return {"dflash": str(dflash), "draft": str(make_model_dir("llama", seed=11))}


@pytest.mark.parametrize("method", ["ngram", "mtp", "dflash", "draft"])
def test_speculation_under_two_ranks_gives_plain_tokens(moe_dir, mtp_dir, drafter_dirs, method):
    """Verify rows (and, for a hybrid model, their kept states and restores) run on both ranks; the drafter on the
    head alone (the MTP head holds all its experts there; the DFlash and draft models' caches follow the target's
    in the head's blocks)."""
    model_dir = moe_dir if method == "ngram" else mtp_dir
    drafter = {"speculative_model": drafter_dirs[method]} if method in drafter_dirs else {}
    batch = [p * 3 + p[:2] for p in prompts(4, seed=21)]  # repeats: the n-gram drafter finds drafts

    def run(**overrides) -> tuple[list[list[int]], dict]:
        config = config_for(model_dir, state_snapshot_interval=8, **overrides)
        return run_async(run_batch(config, batch, [greedy(40)] * len(batch)))

    plain, _ = run()
    spec, stats = run(ep_size=2, speculative_method=method, num_speculative_tokens=3, prompt_lookup_min=1, **drafter)
    assert spec == plain and stats["speculation"]["drafted_tokens"] > 0


def test_a_model_without_experts_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="no experts"):
        run_async(Engine.create(config_for(tiny_model_dir, ep_size=2)))


def test_split_states_keep_half_the_heads_unless_a_snapshot_host_tier_needs_them_whole(hybrid_dir):
    async def state_bytes(**overrides) -> int:
        engine = await Engine.create(config_for(hybrid_dir, ep_size=2, **overrides))
        try:
            return engine.loaded.runner.state_bytes
        finally:
            await engine.shutdown()

    host_tier = dict(kv_offload_host_gib=1 / 1024)
    whole = run_async(state_bytes(ep_split_linear_attention=False))
    assert run_async(state_bytes()) * 2 == whole
    assert run_async(state_bytes(**host_tier)) == whole
    with pytest.raises(ValueError, match="host tier"):
        run_async(Engine.create(config_for(hybrid_dir, ep_size=2, ep_split_linear_attention=True, **host_tier)))


async def first_delta_then_rest(engine: Engine) -> asyncio.Task:
    """A long request, once it has streamed its first delta; the task streams the rest."""
    deltas = engine.generate(prompt_token_ids=[5, 6, 7], params=greedy(1000))
    await deltas.__anext__()

    async def rest() -> None:
        async for _ in deltas:
            pass

    return asyncio.ensure_future(rest())


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_worker_fails_requests_and_health_within_the_bound(moe_dir, fault):
    """A killed worker is seen at once (its process ends); a hung one when a collective has waited ep_timeout_s.
    Either way the request in flight ends with an error, health turns bad, new requests are refused, and the head
    shuts down without waiting on the lost rank."""
    bound_s = 3.0

    async def main() -> None:
        engine = await Engine.create(config_for(moe_dir, ep_size=2, ep_timeout_s=bound_s, wedged_step_s=bound_s))
        worker = engine.parallel.workers[0]
        try:
            assert engine.health() is None
            task = await first_delta_then_rest(engine)
            lost_at = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            with pytest.raises(Exception) as failure:
                await asyncio.wait_for(task, 4 * bound_s)  # the bound, with room for a slow machine
            assert time.monotonic() - lost_at < 4 * bound_s
            assert isinstance(failure.value, (EngineDead, RuntimeError)) and not isinstance(
                failure.value, asyncio.TimeoutError)
            assert engine.health() is not None
            with pytest.raises(EngineDead):
                await collect(engine, prompt_token_ids=[1, 2], params=greedy())
        finally:
            if worker.poll() is None:
                worker.kill()
            started = time.monotonic()
            await engine.shutdown()
            assert time.monotonic() - started < 2 * bound_s + 30

    run_async(main())


def test_sigterm_on_a_serving_head_stops_its_worker(moe_dir):
    """`conveyor serve --ep-size 2` starts its worker; SIGTERM on the server ends both processes."""
    from tests.web.test_serve_process import free_port, wait_healthy

    port = free_port()
    command = [sys.executable, "-m", "cli", "serve", "--model", str(moe_dir), "--port", str(port),
               "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256",
               "--ep-size", "2", "--drain-timeout", "5"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"

        async def worker_pid() -> int:
            await wait_healthy(url, server)
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/debug/stages") as response:
                    workers = (await response.json())["expert_parallel"]["workers"]
            return workers[0]["pid"]

        pid = run_async(worker_pid())
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the process table; the deadline only turns a hang into a failure
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: ended, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_ranks_started_the_torchrun_way_give_one_ranks_tokens(moe_dir, monkeypatch):
    """Across machines every rank is started with torchrun's environment: the head (`serve`, rank 0) joins a
    `conveyor worker` rank it did not start, and the tokens are one rank's."""
    from tests.web.test_serve_process import free_port

    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    config = config_for(moe_dir, max_num_batched_tokens=24, ep_size=2)
    worker = subprocess.Popen([sys.executable, "-m", "cli", "worker", "--model", str(moe_dir),
                               "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512",
                               "--max-num-seqs", "16", "--max-num-batched-tokens", "24", "--ep-size", "2"],
                              env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "0"}, cwd=ROOT)
    try:
        for name, value in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)

        async def main() -> list[list[int]]:
            engine = await Engine.create(config)
            try:
                assert engine.parallel.workers == []  # not started by this head
                batch = prompts(3, seed=3)
                results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy()) for p in batch])
                return [r[0].token_ids for r in results]
            finally:
                await engine.shutdown()

        two = run_async(main())
        assert worker.wait(60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
    monkeypatch.delenv("RANK")
    one, _ = run_async(run_batch(config_for(moe_dir, max_num_batched_tokens=24), prompts(3, seed=3), [greedy()] * 3))
    assert two == one


def test_preemption_grammars_and_sampling_under_two_ranks(hybrid_dir):
    """A pool small enough to preempt (states recomputed, slots released and given again), grammar-constrained and
    seeded sampled requests, and n-gram verify rows, at once: two ranks give one rank's tokens."""
    from pipeline.grammar.spec import GrammarSpec
    from tests.pipeline.grammar.test_structured_output import SCHEMA

    batch = [p * 2 for p in prompts(6, seed=5)]
    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA))] * 2

    def run(**overrides) -> tuple[list[list[int]], dict]:
        config = config_for(hybrid_dir, num_kv_blocks=24, max_num_batched_tokens=16, speculative_method="ngram",
                            num_speculative_tokens=3, prompt_lookup_min=1, **overrides)
        return run_async(run_batch(config, batch, params))

    one, _ = run()
    two, stats = run(ep_size=2)
    assert two == one and stats["preemptions"] > 0


def test_a_worker_that_fails_to_load_fails_the_start_and_leaves_nothing(moe_dir, monkeypatch):
    """A worker that cannot load its shard (here: told a model path that does not exist) ends; the head's start
    fails at its next collective instead of waiting out a timeout, and a later engine starts cleanly."""
    import dataclasses

    from pipeline.dist import ranks

    real = ranks.config_to_json
    monkeypatch.setattr(ranks, "config_to_json", lambda config: real(dataclasses.replace(config, model="/nonexistent")))
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (the error is the collective's: the peer's connection closed)
        run_async(Engine.create(config_for(moe_dir, ep_size=2)))
    assert time.monotonic() - started < 60
    monkeypatch.setattr(ranks, "config_to_json", real)
    two = run_async(run_engine(moe_dir, ep_size=2))[0]
    assert two == run_async(run_engine(moe_dir))[0]


def test_a_worker_that_ends_before_the_ranks_meet_fails_the_start_at_once(moe_dir, monkeypatch):
    """A local worker that cannot even start (here its interpreter is /bin/false: exit code 1 at once) fails the
    head's start with its exit code, well inside the two-minute meeting timeout."""
    import sys

    monkeypatch.setattr(sys, "executable", "/bin/false")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 exited with code 1 before the ranks met"):
        run_async(Engine.create(config_for(moe_dir, ep_size=2)))
    assert time.monotonic() - started < 30
