"""The process the head starts for each of its local expert-parallel ranks (pipeline/dist/ranks.py ``start_head``):
``python -m pipeline.dist.local_worker CONFIG_JSON``, the head's engine config as JSON.

The engine starts its own ranks through this entry, never through the command line above the pipeline; ``conveyor
worker`` runs the same ``worker_main`` for a rank started the torchrun way.
"""
from __future__ import annotations

import logging
import sys

from pipeline.cpu_threads import prefer_passive_wait


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python -m pipeline.dist.local_worker CONFIG_JSON (started by the expert-parallel "
                         "head; use `conveyor worker` to start a rank by hand)")
    prefer_passive_wait()  # before anything loads torch: the imports below do
    logging.basicConfig(level=logging.INFO, format="[conveyor worker] %(levelname)s %(name)s: %(message)s")
    from pipeline.dist.ranks import config_from_json
    from pipeline.dist.worker import worker_main

    return worker_main(config_from_json(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
