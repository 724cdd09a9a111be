"""Grammar-constrained decoding: where a constrained step's time goes (--host), and what structured output and tool
calls cost end to end on a server (--serve), the figures of issue 57.

    .venv/bin/python bench/grammar.py --host [--batches 1 16 64 256] [--vocabs 151936 248320]
        # writes bench/results/grammar-host-<device>-<commit>.json
    PYTHONUNBUFFERED=1 python3 bench/grammar.py --serve [--shapes qwen3-8b qwen3.5-35b-a3b]
        # on the GPU machine: writes bench/results/grammar-h200-<commit>.json (and a copy into $OUT)
    .venv/bin/python bench/grammar.py --serve --smoke    # the --serve control flow on the CPU, embedded model

--host times the runner's own code for one step at a time of a batch of constrained rows, on a vocabulary of the
real size (the embedded SmolLM2 tokenizer padded with synthetic tokens as bench/gpu.py pads it): the mask
computation (xgrammar's accept and fill), the bitmask's copy to the device, applying it to the logits, the Python
around them, and whether the step waits on the previous step's tokens before its fill (grammar_host.py says how).
--serve starts `conveyor serve` with random weights of each shape and runs the issue's matrix over HTTP
(grammar_serve.py). Both assert nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

REAL_VOCABS = (151936, 248320)  # Qwen3 and Qwen3.5


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "unknown"


def embedded_tokenizer_dir() -> str:
    """The embedded SmolLM2 tokenizer as a directory of tokenizer.json and tokenizer_config.json (what
    bench/device_prepare.py leaves in .peer/tokenizer, without transformers)."""
    from pipeline.embedded import embedded_model_path
    from pipeline.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(embedded_model_path())
    path = tempfile.mkdtemp(prefix="conveyor-grammar-tokenizer-")
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
              "chat_template": tokenizer.chat_template}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as handle:
        json.dump(config, handle)
    return path


def tokenizer_dir(requested: str | None) -> str:
    """The tokenizer directory a model directory is made from: the one asked for, else .peer/tokenizer when it is
    there (the GPU machine), else the embedded tokenizer."""
    default = os.path.join(ROOT, ".peer", "tokenizer")
    if requested:
        return requested
    if os.path.isfile(os.path.join(default, "tokenizer.json")):
        return default
    return embedded_tokenizer_dir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--host", action="store_true", help="the host cost of a constrained step, by part")
    mode.add_argument("--serve", action="store_true", help="the issue's SERVE matrix over HTTP")
    parser.add_argument("--smoke", action="store_true",
                        help="with --serve: one tiny level of each workload on the CPU with the embedded model")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: .peer/tokenizer, "
                                                          "else the embedded one)")
    parser.add_argument("--device", default=None, help="--host: where the logits live (default: cuda if any)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(REAL_VOCABS))
    parser.add_argument("--steps", type=int, default=48, help="--host: timed steps per configuration")
    parser.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3.5-35b-a3b"])
    parser.add_argument("--server-args", default="", help="--serve: more `conveyor serve` arguments")
    parser.add_argument("--repeats", type=int, default=3, help="--serve: runs of each workload (the median counts)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.host:
        from grammar_host import run_host

        run_host(a)
    else:
        from grammar_serve import run_serve

        run_serve(a)


if __name__ == "__main__":
    main()
