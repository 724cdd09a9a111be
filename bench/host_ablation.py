"""Does a compiled host-path module pay? The serving ladder (bench/serve.py) with each one turned off.

Each variant is one fresh server, run one after another in the order given (so variants alternate
with the baseline that opens and closes the list); a variant names the compiled modules it swaps
for their pure-Python twins (CONVEYOR_PURE_PYTHON) and any extra `conveyor serve` arguments.

    python bench/host_ablation.py --out ablation.json [--model DIR] [--server-args "..."] [--json-schema]
        [--variants base twin-penalties none base ...]

A variant is `base` (everything compiled), `twin-NAME` (module NAME's twin) or `none` (every module
in EXT_MODULES a twin).
Prints JSON: each run's ladder, and per variant the change of every level's output tok/s, TTFT p50
and ITL p50 against the mean of the baseline runs. Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXT_MODULES = ("bitmask", "penalties", "repetition", "stop_strings", "step_inputs", "grammar_rows", "grammar_step")


def variant_setup(variant: str) -> tuple[str, list[str]]:
    """(CONVEYOR_PURE_PYTHON, extra server arguments) of a variant."""
    if variant == "base":
        return "", []
    if variant == "none":
        return ",".join(EXT_MODULES), []
    if variant.removeprefix("twin-") in EXT_MODULES:
        return variant.removeprefix("twin-"), []
    raise SystemExit(f"unknown variant {variant!r}: base, none or twin-MODULE ({', '.join(EXT_MODULES)})")


def default_variants() -> list[str]:
    """Every module's twin, and none, with a baseline run before, between every three, and after."""
    variants = [*(f"twin-{m}" for m in EXT_MODULES), "none"]
    order = ["base"]
    for i in range(0, len(variants), 3):
        order += [*variants[i:i + 3], "base"]
    return order


def run_ladder(args: argparse.Namespace, variant: str) -> dict:
    twins, extra = variant_setup(variant)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, os.path.join(ROOT, "bench", "serve.py"), "--out", out.name,
                   "--server-args=" + " ".join([args.server_args, *extra]).strip(),
                   "--max-concurrency", str(args.max_concurrency), "--prompt-tokens", str(args.prompt_tokens),
                   "--output-tokens", str(args.output_tokens)]
        if args.model:
            command += ["--model", args.model]
        if args.json_schema:
            command.append("--json-schema")
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=dict(os.environ, CONVEYOR_PURE_PYTHON=twins), check=True,
                       stdout=subprocess.DEVNULL, timeout=args.timeout)
        with open(out.name) as handle:
            report = json.load(handle)
    print(f"[host_ablation] {variant}: {time.perf_counter() - started:.0f}s, "
          + " ".join(f"c{lv['concurrency']}={lv['output_tok_s']}" for lv in report["levels"]), file=sys.stderr)
    return {"variant": variant, "twins": twins, "server_args": extra, "levels": report["levels"],
            "machine": report["machine"], "commit": report["commit"]}


def change_table(runs: list[dict]) -> dict:
    """Per variant and level: (variant / mean of the base runs) - 1 for tok/s, TTFT p50 and ITL p50."""
    base = [r for r in runs if r["variant"] == "base"]
    if not base:
        return {}

    def mean(rows: list[dict], pick) -> float | None:  # noqa: ANN001
        values = [pick(row) for row in rows if pick(row) is not None]
        return sum(values) / len(values) if values else None

    picks = {"output_tok_s": lambda lv: lv["output_tok_s"], "ttft_p50": lambda lv: lv["ttft_ms"]["p50"],
             "itl_p50": lambda lv: lv["itl_ms"]["p50"]}
    table: dict = {}
    for run in runs:
        rows = table.setdefault(run["variant"], {})
        for i, level in enumerate(run["levels"]):
            reference = [r["levels"][i] for r in base]
            for name, pick in picks.items():
                ref, value = mean(reference, pick), pick(level)
                if ref and value is not None:
                    rows.setdefault(f"c{level['concurrency']}", {}).setdefault(name, []).append(round(value / ref - 1, 4))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--json-schema", action="store_true", help="grammar-constrained outputs (see serve.py)")
    parser.add_argument("--variants", nargs="+", default=default_variants())
    parser.add_argument("--timeout", type=float, default=900, help="seconds one ladder may take")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for variant in args.variants:
        variant_setup(variant)
    runs = [run_ladder(args, variant) for variant in args.variants]
    emit_json({"benchmark": "host_ablation", "date": time.strftime("%Y-%m-%d"), "machine": runs[0]["machine"],
               "commit": runs[0]["commit"], "model": args.model or "embedded SmolLM2-135M",
               "server_args": args.server_args, "prompt_tokens": args.prompt_tokens,
               "output_tokens": args.output_tokens, "json_schema": args.json_schema,
               "change_vs_base": change_table(runs), "runs": runs}, args.out)


if __name__ == "__main__":
    main()
