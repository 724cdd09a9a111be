"""Prepare, on this machine, what a GPU machine without network needs for bench/gpu.py and the GPU tests.

    .venv/bin/python bench/device_prepare.py [--wheels ../shared/wheels/cp312] [--peer ../shared/tools/hf_peer.py]

Writes (all git-ignored, sent with the working tree or carried):
  .peer/tokenizer/  the embedded SmolLM2 tokenizer as an HF directory (the GPU benchmarks' model
                    directories and the tiny test models use it where the GGUF is not installed)
  .peer/hf_peer.py  the transformers baseline that bench/gpu.py runs last (when given)
  .whl/             the wheels the device image lacks (gguf, orjson, xgrammar and its needs)
Then on the GPU machine: `bash bench/device_setup.sh` (carry `.whl`).
"""
from __future__ import annotations

import argparse
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=os.path.join(ROOT, "..", "shared", "wheels", "cp312"))
    parser.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "tools", "hf_peer.py"))
    args = parser.parse_args()
    import transformers

    from pipeline.embedded import embedded_model_path

    directory, name = os.path.split(embedded_model_path())
    tokenizer_dir = os.path.join(ROOT, ".peer", "tokenizer")
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tokenizer_dir)
    print(f"tokenizer -> {tokenizer_dir}")
    if os.path.isfile(args.peer):
        shutil.copy(args.peer, os.path.join(ROOT, ".peer", "hf_peer.py"))
        print("peer baseline -> .peer/hf_peer.py")
    wheels = os.path.join(ROOT, ".whl")
    os.makedirs(wheels, exist_ok=True)
    for wheel in sorted(os.listdir(args.wheels)) if os.path.isdir(args.wheels) else []:
        if wheel.endswith(".whl"):
            shutil.copy(os.path.join(args.wheels, wheel), wheels)
            print(f"wheel -> .whl/{wheel}")


if __name__ == "__main__":
    main()
