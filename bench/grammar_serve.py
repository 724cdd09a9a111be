"""bench/grammar.py --serve: structured output and tool calls end to end, issue 57's SERVE matrix.

Per shape (random weights, `--load-format dummy`, the server's defaults otherwise) one `conveyor serve`, then
streamed chat requests of 128 output tokens at temperature 1 (ignore_eos, no loop guard: random weights repeat
themselves), each workload max(32, c) requests so every level reaches its concurrency:

- levels, c = 16 and 64: no constraint, and `response_format` json_schema (one long string field, the schema of
  bench/serve.py --json-schema, so an output cannot complete before its token budget and every step is a
  constrained one);
- tools, c = 16: 8 function tools with tool_choice "auto" (the model writes text: the tool grammar waits for its
  trigger), "required" (every request is one or more calls from its first token) and "none" (the same prompt with
  nothing enforced: unconstrained_tok_s), and no tools at all with the user message padded to the same prompt
  length (prompt_tokens).

Throughput is completion tokens (the server's usage) over the workload's wall time, the median of --repeats runs
(interleaved), after a warm-up that compiles every grammar (its first request's wait is cold_ttft_ms in the
detail; a grammar is compiled once per schema and tool set, then cached). Writes the issue's schema,
a list with one object per shape, to bench/results/grammar-<gpu>-<commit>.json and every workload's detail (token
counts, finish reasons, TTFT and inter-token latency, errors) beside it as ...-detail.json; with $OUT set, copies
of both there. --smoke runs one tiny level of every workload on the CPU with the embedded model.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from grammar import ROOT, commit, tokenizer_dir
from serve import LONG_STRING_SCHEMA, percentile, wait_ready

OUTPUT_TOKENS = 128
TOOL_CONCURRENCY = 16
PROMPT_WORDS = 160
WORDS = ("the of and to in is was for on are with as his they be at one have this from by hot word but what some "
         "we can out other were all there when up use your how said an each she which do their time if will way "
         "about many then them write would like so these her long make thing see him two has look more day could "
         "go come did number sound no most people my over know water than call first who may down side been now "
         "find").split()


def _string(description: str) -> dict:
    return {"type": "string", "description": description}


def _tool(name: str, description: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


# an agent's tool set: every call's arguments start with a string, which a random-weight model rarely closes
TOOLS = [
    _tool("write_file", "Write a file in the workspace.", path=_string("relative path"), content=_string("text")),
    _tool("read_file", "Read a file of the workspace.", path=_string("relative path")),
    _tool("edit_file", "Replace text in a file.", path=_string("relative path"), old_text=_string("text to replace"),
          new_text=_string("replacement")),
    _tool("run_command", "Run a shell command.", command=_string("the command line"),
          timeout_s={"type": "integer", "minimum": 1, "maximum": 600}),
    _tool("search_code", "Search the workspace.", query=_string("a regular expression"), path=_string("a folder")),
    _tool("list_directory", "List a folder.", path=_string("relative path")),
    _tool("fetch_url", "Fetch a web page as text.", url=_string("an http(s) URL")),
    _tool("ask_user", "Ask the user a question.", question=_string("the question")),
]


_ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "status": {"enum": ["open", "closed", "blocked"]},
                                         "done": {"type": "boolean"}, "title": {"type": "string", "maxLength": 12}},
         "required": ["id", "status", "done", "title"], "additionalProperties": False}
COMPLETING_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": _ITEM}}, "required": ["rows"],
                     "additionalProperties": False}
STRUCTURED_SCHEMA = {**COMPLETING_SCHEMA, "properties": {"rows": {"type": "array", "items": _ITEM, "minItems": 100}}}


@dataclass(slots=True)
class Workload:
    name: str
    concurrency: int
    requests: int
    extra: dict = field(default_factory=dict)  # body fields beside the messages
    pad_words: int = 0  # filler words before each user message (equal prompt length without tools)


def user_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) for _ in range(count)]


def chat_body(model: str, text: str, workload: Workload, max_tokens: int) -> dict:
    # the filler leads, as the tools do (the template puts them first): a prefix every request shares
    content = "the " * workload.pad_words + text
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 1.0, "ignore_eos": True, "repetition_detection": False, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False},
            **workload.extra}


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    finish = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return {"error": f"{response.status}: {(await response.text())[:300]}"}
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                    stamps.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - start if stamps else None, "gaps": gaps, "end": time.perf_counter(),
            "completion_tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens"),
            "finish_reason": finish}


async def run_workload(url: str, model: str, workload: Workload, texts: list[str], max_tokens: int) -> dict:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts[:workload.requests]:
        queue.put_nowait(text)
    results: list[dict] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            results.append(await one_request(session, url, chat_body(model, queue.get_nowait(), workload,
                                                                     max_tokens)))

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=workload.concurrency + 4),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*[worker(session) for _ in range(workload.concurrency)])
    wall = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    finishes: dict[str, int] = {}
    for r in ok:
        finishes[str(r["finish_reason"])] = finishes.get(str(r["finish_reason"]), 0) + 1
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    prompt_tokens = sorted({r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None})
    return {"workload": workload.name, "c": workload.concurrency, "requests": len(results),
            "errors": [r["error"] for r in results if "error" in r][:3], "tok_s": round(tokens / wall, 1),
            "wall_s": round(wall, 2), "completion_tokens_mean": round(tokens / max(1, len(ok)), 1),
            "finish_reasons": finishes,
            "prompt_tokens": [prompt_tokens[0], prompt_tokens[-1]] if prompt_tokens else None,
            "ttft_ms_p50": ms(percentile(ttft, 50)), "itl_ms_p50": ms(percentile(gaps, 50)),
            "itl_ms_p99": ms(percentile(gaps, 99))}


async def prompt_tokens(url: str, model: str, text: str, extra: dict) -> int:
    """The prompt length the server counts for this user text (one request of one token)."""
    body = chat_body(model, text, Workload("probe", 1, 1, extra), 1)
    async with aiohttp.ClientSession() as session:
        result = await one_request(session, url, body)
    if "error" in result:
        raise RuntimeError(f"probe request failed: {result['error']}")
    return int(result["prompt_tokens"])


def _schema(name: str, schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


def workloads(levels: list[int], tool_concurrency: int, requests_min: int, pad_words: int) -> list[Workload]:
    """The matrix; json_structured and json_completes (detail only) walk an object's structure, the first with more
    items than the token budget holds, the second free to complete (then a request ends early: fewer tokens each,
    more of the time in prefill, whatever a step costs)."""
    out: list[Workload] = []
    for c in levels:
        out += [Workload(f"plain_c{c}", c, max(requests_min, c)), Workload(f"json_schema_c{c}", c,
                                                                             max(requests_min, c),
                                                                             _schema("long", LONG_STRING_SCHEMA))]
    n = max(requests_min, tool_concurrency)
    out += [Workload("json_structured", tool_concurrency, n, _schema("rows", STRUCTURED_SCHEMA)),
            Workload("json_completes", tool_concurrency, n, _schema("rows", COMPLETING_SCHEMA)),
            Workload("no_tools", tool_concurrency, n, pad_words=pad_words),
            Workload("tools_auto", tool_concurrency, n, {"tools": TOOLS, "tool_choice": "auto"}),
            Workload("tools_required", tool_concurrency, n, {"tools": TOOLS, "tool_choice": "required"}),
            Workload("unconstrained", tool_concurrency, n, {"tools": TOOLS, "tool_choice": "none"})]
    return out


async def run_matrix(url: str, model: str, levels: list[int], tool_concurrency: int, requests_min: int,
                     max_tokens: int, repeats: int, log) -> dict:
    texts = user_texts(max(requests_min, *levels, tool_concurrency) + 8, seed=57)
    tools_length = await prompt_tokens(url, model, texts[0], {"tools": TOOLS, "tool_choice": "none"})
    plain_length = await prompt_tokens(url, model, texts[0], {})
    pad = tools_length - plain_length  # the filler is "the ": one token a word
    padded = await prompt_tokens(url, model, "the " * pad + texts[0], {})
    log(f"prompt tokens: {plain_length} plain, {tools_length} with the tools, {padded} padded")
    runs = workloads(levels, tool_concurrency, requests_min, pad)
    warm = [Workload(f"warm-{w.name}", min(4, w.concurrency), min(4, w.requests), w.extra, w.pad_words)
            for w in runs if w.name.startswith(("plain", "json", "tools")) and "c64" not in w.name]
    cold: dict[str, float | None] = {}
    for w in warm:  # grammars compiled (the first request's wait: cold_ttft_ms), every path's kernels run once
        cold[w.name.removeprefix("warm-")] = (await run_workload(url, model, w, texts[-8:], 8))["ttft_ms_p50"]
    results: dict[str, list[dict]] = {}
    for repeat in range(repeats):  # interleaved: a slow spell of the machine hits every workload alike
        for w in runs:
            result = await run_workload(url, model, w, texts, max_tokens)
            results.setdefault(w.name, []).append(result)
            log(f"{w.name} #{repeat + 1}: {result['tok_s']} tok/s, {result['completion_tokens_mean']} tokens a "
                f"request, itl p50 {result['itl_ms_p50']} ms, finish {result['finish_reasons']}, "
                f"errors {len(result['errors'])}")
    detail = []
    for name, runs_of in results.items():
        median = dict(sorted(runs_of, key=lambda r: r["tok_s"])[len(runs_of) // 2])
        median.update(runs_tok_s=[r["tok_s"] for r in runs_of], cold_ttft_ms=cold.get(name))
        detail.append(median)
    by_name = {r["workload"]: r for r in detail}
    return {"levels": [{"c": c, "plain_tok_s": by_name[f"plain_c{c}"]["tok_s"],
                        "json_schema_tok_s": by_name[f"json_schema_c{c}"]["tok_s"]} for c in levels],
            "tools": {"no_tools_tok_s": by_name["no_tools"]["tok_s"],
                      "tools_auto_tok_s": by_name["tools_auto"]["tok_s"],
                      "tools_required_tok_s": by_name["tools_required"]["tok_s"],
                      "unconstrained_tok_s": by_name["unconstrained"]["tok_s"], "prompt_tokens": tools_length},
            "detail": detail, "prompt_tokens": {"plain": plain_length, "tools": tools_length, "padded": padded}}


def start_server(model_dir: str | None, server_args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "cli", "serve", "--port", str(port), "--served-model-name", "m", *server_args]
    if model_dir:
        command += ["--model", model_dir]
    log_file = open(log_path, "w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def run_serve(a: argparse.Namespace) -> None:
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[grammar --serve {time.perf_counter() - started:6.1f}s] {message}", flush=True)

    revision = commit()
    if a.smoke:
        gpu, shapes, levels, tool_c, requests_min, max_tokens = "cpu", ["embedded"], [2], 2, 2, 8
        server_args = ["--device", "cpu", *a.server_args.split()]
    else:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        shapes, levels, tool_c, requests_min, max_tokens = a.shapes, [16, 64], TOOL_CONCURRENCY, 32, OUTPUT_TOKENS
        server_args = ["--load-format", "dummy", "--dtype", "bfloat16", *a.server_args.split()]
    from gpu import write_model_dir
    from gpu_shapes import SHAPES

    source = None if a.smoke else tokenizer_dir(a.tokenizer)
    results, details = [], []
    out_dir = os.environ.get("OUT")
    for shape in shapes:
        model_dir = None if a.smoke else write_model_dir(SHAPES[shape], source)
        log_path = os.path.join(out_dir or "/tmp", f"grammar-serve-{shape}.log")
        process, url = start_server(model_dir, server_args, log_path)
        shape_started = time.perf_counter()
        try:
            asyncio.run(wait_ready(url, process))
            ready_s = time.perf_counter() - shape_started
            log(f"{shape}: server ready after {ready_s:.0f}s")
            matrix = asyncio.run(run_matrix(url, "m", levels, tool_c, requests_min, max_tokens,
                                            1 if a.smoke else a.repeats, log))
        finally:
            stop_server(process)
            if model_dir:
                shutil.rmtree(model_dir, ignore_errors=True)
        results.append({"shape": shape, "commit": revision, "gpu": gpu, "levels": matrix["levels"],
                        "tools": matrix["tools"]})
        details.append({"shape": shape, "commit": revision, "gpu": gpu, "server_ready_s": round(ready_s, 1),
                        "seconds": round(time.perf_counter() - shape_started, 1), "server_args": server_args,
                        "command": " ".join(["python3", "bench/grammar.py", *sys.argv[1:]]),
                        "prompt_tokens": matrix["prompt_tokens"], "workloads": matrix["detail"]})
        write_results(a, results, details, gpu, revision, out_dir)
    log(f"done in {time.perf_counter() - started:.0f}s")
    print(json.dumps(results, indent=1))


def write_results(a: argparse.Namespace, results: list, details: list, gpu: str, revision: str,
                  out_dir: str | None) -> None:
    name = "h200" if "H200" in gpu else gpu.lower().replace(" ", "-")
    out = a.out or os.path.join(ROOT, "bench", "results", f"grammar-{name}-{revision}.json")
    if a.smoke and not a.out:
        out = os.path.join(out_dir or "/tmp", f"grammar-smoke-{revision}.json")
    for path, data in ((out, results), (out.removesuffix(".json") + "-detail.json", details)):
        with open(path, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.write("\n")
        if out_dir and os.path.dirname(os.path.abspath(path)) != os.path.abspath(out_dir):
            shutil.copy(path, out_dir)
