"""Expert parallelism's communication on two GPUs: the all-reduce of a mixture-of-experts block's partial output
(``pipeline/dist/group.py``), [T tokens, hidden] bf16, eager and as one decode step's worth of them (one a layer)
replayed in a CUDA graph, the way the decode graphs would issue them. JSON out.

    python3 bench/ep_allreduce.py --hidden 2048 --layers 40 --tokens 1 16 64 256 --out $OUT/ep-allreduce.json

NVLink multicast stays off (NCCL_NVLS_ENABLE=0: the device notes say why).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, each synchronised."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, a: argparse.Namespace) -> None:
    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    rows = []
    try:
        for tokens in a.tokens:
            x = torch.randn(tokens, a.hidden, dtype=torch.bfloat16, device="cuda") * 1e-3
            for _ in range(20):
                dist.all_reduce(x)
            eager = _timed(lambda: dist.all_reduce(x), 200)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(a.layers):
                        dist.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            for _ in range(5):
                graph.replay()
            step = _timed(graph.replay, 50)
            rows.append({"tokens": tokens, "bytes": x.numel() * x.element_size(), "eager_us": eager * 1e6,
                         "graph_step_us": step * 1e6, "graph_per_all_reduce_us": step * 1e6 / a.layers})
        if rank == 0:
            report = {"device": torch.cuda.get_device_name(0), "hidden": a.hidden, "layers": a.layers,
                      "commit": a.commit, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "env": SAFE_ENV, "runs": rows}
            with open(a.out, "w") as handle:
                json.dump(report, handle, indent=1)
            for row in rows:
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=40, help="all-reduces a decode step issues (MoE layers)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="ep-allreduce.json")
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    os.environ.update(SAFE_ENV)
    mp.start_processes(_rank, args=(a,), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
