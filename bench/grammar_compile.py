"""How long xgrammar takes to compile the grammars requests bring, on this machine: one object of N properties
(optional or required) and tool sets of T tools of P properties under tool_choice "required". What the grammar
bounds' defaults (--max-grammar-seconds, --max-grammar-bytes, --max-grammar-cache-bytes) are judged against.

    .venv/bin/python bench/grammar_compile.py [--model DIR] [--properties 100,1000] [--tools 50x20]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.embedded import embedded_model_path  # noqa: E402
from pipeline.grammar.compiler import GrammarCompiler  # noqa: E402
from pipeline.grammar.spec import GrammarSpec  # noqa: E402
from pipeline.tokenizer import Tokenizer  # noqa: E402
from web.tool_grammar import tool_call_grammar  # noqa: E402


def properties(n: int, required: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
            "required": [f"p{i}" for i in range(required)]}


def tools(count: int, props: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{t}", "description": "a tool",
                                              "parameters": properties(props, 3)}} for t in range(count)]


def timed(compiler: GrammarCompiler, label: str, spec: GrammarSpec) -> None:
    started = time.perf_counter()
    compiled = compiler.compile_now(spec)
    print(json.dumps({"grammar": label, "source_bytes": len(spec.source.encode()),
                      "seconds": round(time.perf_counter() - started, 3),
                      "memory_bytes": compiled.memory_size_bytes}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model whose tokenizer to use (default: the embedded one)")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--properties", default="10,100,300,500,1000", help="object sizes, comma separated")
    parser.add_argument("--tools", default="1x20,10x20,50x20,100x20", help="TOOLSxPROPERTIES, comma separated")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_pretrained(args.model or embedded_model_path())
    compiler = GrammarCompiler(tokenizer, args.vocab_size or tokenizer.vocab_size, [])
    for n in (int(x) for x in args.properties.split(",") if x):
        timed(compiler, f"object of {n} optional properties", GrammarSpec.json_schema(properties(n, 3)))
        timed(compiler, f"object of {n} required properties", GrammarSpec.json_schema(properties(n, n)))
    for shape in (x for x in args.tools.split(",") if x):
        count, props = (int(v) for v in shape.split("x"))
        timed(compiler, f"{count} tools of {props} properties", tool_call_grammar("hermes", tools(count, props),
                                                                                  "required"))
    compiler.close()


if __name__ == "__main__":
    main()
