"""The expert-parallel process layout: which rank this process is, how the ranks find each other, and the head's
local workers.

``conveyor serve --ep-size N`` on one machine starts N-1 worker processes itself (rank r on GPU r;
pipeline/dist/local_worker.py) and meets them through a TCP store it opens on a free port. Across machines, every
process is started the torchrun way (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``):
rank 0 runs ``conveyor serve``, the others ``conveyor worker`` with the same engine flags. The ranks join one
torch.distributed group (NCCL on GPUs, gloo on CPUs) for the device bytes and the MoE all-reduces, and a gloo group
for the head's messages.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch

import envs
from pipeline.config import EngineConfig
from pipeline.dist.group import ExpertGroup, ExpertShard
from pipeline.request import RepetitionDetection

log = logging.getLogger("conveyor.dist")

# the longest wait for another rank: meeting (a worker process starting), then loading (a large model's shards, the
# profiling forwards); --ep-timeout applies once serving
MEETING_TIMEOUT_S = 120.0
LOADING_TIMEOUT_S = 900.0
READY_KEY = "conveyor/ready"  # + "/<rank>": a local worker has reached the meeting (its store client is up)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    addr: str
    port: int

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """torchrun's variables, or None when they are not set."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))
        except ValueError as exc:
            raise ValueError(f"the rendezvous environment (RANK, WORLD_SIZE, ...) is not valid: {exc}") from None

    def env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port)}


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(asdict(config))


def config_from_json(text: str) -> EngineConfig:
    fields = json.loads(text)
    if fields.get("repetition_detection") is not None:
        fields["repetition_detection"] = RepetitionDetection(**fields["repetition_detection"])
    return EngineConfig(**fields)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Rank r's device: GPU r of its machine (``--device cuda``), else the CPU."""
    if config.device.startswith("cuda"):
        return torch.device("cuda", local_rank)
    return torch.device(config.device)


@dataclass(slots=True)
class ParallelContext:
    """This rank's place in the split: its experts' group, the message group, its device, and (on a head that
    started them) the local worker processes."""

    group: ExpertGroup
    messages: Any  # the gloo group of the head's messages
    device: torch.device
    workers: list[subprocess.Popen] = field(default_factory=list)
    store: Any = None  # the head's rendezvous store (it lives as long as the groups)
    step_timeout_s: float = 60.0  # --ep-timeout: a collective's longest wait once serving
    shared_caches: int = 0  # the head's caches every rank holds (the first ones; the handshake finds it)
    closing: bool = False
    on_lost: Callable[[int, int], None] | None = None  # a local worker ended (None: abort the groups)

    @property
    def rank(self) -> int:
        return self.group.shard.rank

    @property
    def size(self) -> int:
        return self.group.shard.size

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    def agree(self, layout: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``layout`` (a startup handshake over the message group)."""
        import torch.distributed as dist

        layouts: list[Any] = [None] * self.size
        dist.all_gather_object(layouts, layout, group=self.messages)
        return layouts

    def set_timeout(self, seconds: float) -> None:
        """A collective that waits longer than this for another rank fails (from the next one on)."""
        import torch.distributed as dist

        dist.group.WORLD.set_timeout(timedelta(seconds=seconds))
        self.messages.set_timeout(timedelta(seconds=seconds))

    def watch(self) -> None:
        """A thread a local worker, waiting on its process: when one ends while the head is not closing,
        ``on_lost(rank, exit code)``, or while loading (no ``on_lost`` yet) the groups are aborted, so the head's
        collective waiting for it fails instead of waiting out the timeout."""
        for rank, process in enumerate(self.workers, start=1):
            def wait(rank: int = rank, process: subprocess.Popen = process) -> None:
                code = process.wait()
                if self.closing:
                    return
                log.error("expert-parallel rank %d ended (exit code %d)", rank, code)
                if self.on_lost is not None:
                    self.on_lost(rank, code)
                else:
                    self.abort()

            threading.Thread(target=wait, name=f"ep-worker-{rank}-watch", daemon=True).start()

    def abort(self) -> None:
        """A rank is gone: abort the groups so a collective waiting for it returns with an error (NCCL waits
        otherwise)."""
        import torch.distributed as dist

        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        # (gloo needs none: its collectives fail as soon as a peer's connection closes)
        if abort is not None and dist.is_initialized() and dist.get_backend() == "nccl":
            try:
                abort()
            except Exception:  # noqa: BLE001 (best effort: the engine is failing already)
                log.exception("aborting the expert-parallel groups")

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the groups and wait for the local workers (they stop on the head's STOP or its exit); kill those
        still running after ``timeout_s``."""
        import torch.distributed as dist

        self.closing = True
        for process in self.workers:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            try:
                if dist.get_backend() == "nccl":  # NCCL's orderly teardown can wait for a rank that has gone
                    self.abort()  # (which leaves every group too)
                else:
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                log.exception("leaving the expert-parallel groups")


def join_group(config: EngineConfig, rendezvous: Rendezvous, store: Any = None) -> ParallelContext:
    """Join the ranks' groups as ``rendezvous``'s rank: the head from ``start_head``, a worker from
    ``worker_main`` (pipeline/dist/worker.py)."""
    import torch.distributed as dist

    device = rank_device(config, rendezvous.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(config.ep_timeout_s, MEETING_TIMEOUT_S))
    if store is None and envs.LOCAL_WORKER.get():  # a worker of a head that opened the store itself
        store = dist.TCPStore(rendezvous.addr, rendezvous.port, rendezvous.world_size, is_master=False,
                              timeout=timeout)
        store.set(f"{READY_KEY}/{rendezvous.rank}", "1")  # the head waits for this or for the process to end
    kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rendezvous.rank,
                            world_size=rendezvous.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None, **kwargs)
    try:
        messages = dist.new_group(backend="gloo", timeout=timeout)
        context = ParallelContext(ExpertGroup(ExpertShard(rendezvous.rank, rendezvous.world_size)), messages, device,
                                  step_timeout_s=config.ep_timeout_s)
        context.set_timeout(max(config.ep_timeout_s, LOADING_TIMEOUT_S))
    except BaseException:
        dist.destroy_process_group()
        raise
    return context


def start_head(config: EngineConfig, say: Callable[[str], None] = lambda m: None) -> ParallelContext:
    """Rank 0 of ``config.ep_size``: with torchrun's environment, join the others; without it, start the local
    workers and meet them."""
    import torch.distributed as dist

    size = config.ep_size
    rendezvous = Rendezvous.from_env()
    if rendezvous is not None:
        if rendezvous.world_size != size or rendezvous.rank != 0:
            raise ValueError(f"--ep-size {size} on rank {rendezvous.rank} of {rendezvous.world_size}: the head is "
                             f"rank 0 of a world of --ep-size ranks (the others run `conveyor worker`)")
        return join_group(config, rendezvous)
    if config.device.startswith("cuda") and torch.cuda.device_count() < size:
        raise ValueError(f"--ep-size {size} needs {size} GPUs, {torch.cuda.device_count()} visible")
    timeout = timedelta(seconds=max(config.ep_timeout_s, MEETING_TIMEOUT_S))
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
    workers = []
    say(f"starting {size - 1} expert-parallel worker(s)")
    for rank in range(1, size):
        env = {**os.environ, **Rendezvous(rank, size, rank, "127.0.0.1", store.port).env(),
               **envs.LOCAL_WORKER.setting(True)}
        workers.append(subprocess.Popen([sys.executable, "-m", "pipeline.dist.local_worker", config_to_json(config)],
                                        env=env))
    try:
        await_local_workers(store, workers, timeout.total_seconds())
        context = join_group(config, Rendezvous(0, size, 0, "127.0.0.1", store.port), store)
    except BaseException:
        for process in workers:
            process.kill()
        raise
    context.workers, context.store = workers, store
    context.watch()
    return context


def await_local_workers(store: Any, workers: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until every local worker has reached the meeting, or one has ended first: a worker that fails while it
    starts (a bad flag, no device, an import error) fails the head's start at once instead of after the meeting
    timeout. One thread waits on the store for the workers' ready keys, one per worker on its process."""
    done = threading.Event()
    failures: list[str] = []

    def ready() -> None:
        try:
            store.wait([f"{READY_KEY}/{rank}" for rank in range(1, len(workers) + 1)], timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 (the store's timeout error)
            failures.append(f"the expert-parallel workers did not start within {timeout_s:.0f} s ({exc})")
        done.set()

    def ended(rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not done.is_set():
            failures.append(f"expert-parallel worker {rank} exited with code {code} before the ranks met")
            done.set()

    threading.Thread(target=ready, name="ep-meeting", daemon=True).start()
    for rank, process in enumerate(workers, start=1):
        threading.Thread(target=ended, args=(rank, process), name=f"ep-worker-{rank}-start", daemon=True).start()
    done.wait()
    if failures:
        raise RuntimeError(failures[0])


def end_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it ends (a local worker outlives no head)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
