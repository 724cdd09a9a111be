"""bench/grammar.py --host: one decode step's grammar work, by part, timed on the runner's own code.

A batch of B rows, every row constrained ("all") or only its first ("one"), decodes one step after another as the
decode stage runs them (one step ahead: each grammar row takes its previous token from the previous step's host
tokens). Per step, on the runner's path (``SamplingBatch.fill_grammar_bitmask``, then the logits pipeline's grammar
step):

- rows: ``SamplingBatch.from_rows``, the step's sampling inputs for every row (not the grammar's part);
- mask: xgrammar's accept of the previous tokens and its bitmask fill (time inside ``ext/grammar_step``);
- copy: the bitmask's transfer to the device, host time (the runner's path on this device: none on the CPU, whose
  logits are on the host);
- python: the rest of ``fill_grammar_bitmask`` (planning the rows, buffers, the calls around the fill; on CUDA
  also the wait for the copy to land);
- apply: masking the logits on the device ([B, V] float32; on CUDA synchronized, so it is the kernels' time too);
- exposed: host time from the moment the step asks for the previous step's tokens to the moment its mask is ready
  on the device: on a GPU the step's forward runs meanwhile, and what exceeds the forward's time is device time lost
  (the step waits for the previous one whenever a grammar row runs one step ahead: ``waits_for_previous_step``).

The tokens: each row picks a random token its mask allows (off the clock), so the matchers walk through the
schema's states as a random-weight model's output does; a sequence its grammar ends (a stop token) gives its row to
a new one. On the CPU torch runs one thread (timings on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from grammar import commit, tokenizer_dir
from report import emit_json

# the schema of bench/host_overhead.py's grammar runs (bench/sse_clients.py): strings and an array, long-running
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "tags"]}
APPLY_STEPS = 6  # steps whose apply is timed (a [256, 248320] float32 apply takes a tenth of a second on a CPU)


@dataclass(slots=True)
class Clock:
    """Seconds spent inside one wrapped callable since the last reset."""

    seconds: float = 0.0
    calls: int = 0

    def wrap(self, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _TimedModule:
    """A module's stand-in whose named functions are timed by their clocks; everything else passes through."""

    def __init__(self, module, clocks: dict[str, Clock]) -> None:
        self._module = module
        self._timed = {name: clock.wrap(getattr(module, name)) for name, clock in clocks.items()}

    def __getattr__(self, name: str):
        return self._timed.get(name) or getattr(self._module, name)


@dataclass(slots=True)
class Row:
    """One sequence of the bench batch: its grammar state and the output position it picks next."""

    state: object | None
    position: int = 0


@dataclass(slots=True)
class Series:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(seconds * 1e3)

    def medians(self) -> dict[str, float]:
        return {name: round(float(np.median(v)), 4) for name, v in self.values.items()}


def padded_tokenizer(vocab_size: int, source_dir: str):
    """The tokenizer of a model directory bench/gpu.py's write_model_dir makes for this vocabulary size: the source
    tokenizer's vocabulary padded with synthetic tokens (' w<id>'), so every id decodes to visible text."""
    from pipeline.tokenizer import Tokenizer

    path = tempfile.mkdtemp(prefix="conveyor-grammar-vocab-")
    for name in os.listdir(source_dir):
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy(os.path.join(source_dir, name), path)
    with open(os.path.join(path, "tokenizer.json")) as handle:
        tokenizer = json.load(handle)
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), vocab_size)})
    with open(os.path.join(path, "tokenizer.json"), "w") as handle:
        json.dump(tokenizer, handle)
    loaded = Tokenizer.from_hf_dir(path)
    shutil.rmtree(path, ignore_errors=True)
    return loaded


def pick(words: np.ndarray, rng: np.random.Generator, vocab: int) -> int:
    """A random token the row's mask allows (uint32 words, bit j of word w allows 32w + j)."""
    token = int(rng.integers(0, vocab))
    if words[token >> 5] >> np.uint32(token & 31) & np.uint32(1):
        return token
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def mask_of(state, private: torch.Tensor) -> np.ndarray:
    """The mask the row's matcher allows now (the step's own was filled from the same state), as uint32 words."""
    state.matcher.fill_next_token_bitmask(private, 0)
    return private.numpy()[0].view(np.uint32)


def run_config(compiled, vocab: int, batch: int, constrained: str, steps: int, device: torch.device,
               clocks: dict[str, Clock]) -> dict:
    from pipeline.grammar.state import GrammarState
    from pipeline.request import SamplingParams
    from pipeline.runner.host_staging import HostStaging
    from pipeline.runner.logits_pipeline import apply_grammar_bitmask
    from pipeline.runner.sampling_batch import SamplingBatch, SamplingRow

    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=1 << 20, temperature=1.0)
    rows = [Row(GrammarState(compiled) if constrained == "all" or i == 0 else None) for i in range(batch)]
    staging = HostStaging()
    host_tokens = np.zeros(batch, dtype=np.int64)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    private = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    series = Series()
    waits = 0
    cuda = device.type == "cuda"
    for step in range(steps + 2):  # two warm-up steps
        sampling_rows = [SamplingRow(params, (), (), frozenset(), i, row.position, row.state,
                                     i if row.state is not None and row.position > 0 else -1, None, None, row.position)
                         for i, row in enumerate(rows)]
        asked: list[float] = []

        def previous_tokens() -> np.ndarray:
            asked.append(time.perf_counter())
            return host_tokens

        started = time.perf_counter()
        sampling = SamplingBatch.from_rows(sampling_rows, vocab, device, staging)
        built = time.perf_counter()
        for clock in clocks.values():
            clock.take()
        sampling.fill_grammar_bitmask(previous_tokens)
        if cuda:
            torch.cuda.synchronize()  # the mask on the device (the copy is queued without blocking)
        filled = time.perf_counter()
        mask, copy = clocks["mask"].take(), clocks["copy"].take()
        timed_apply = step >= steps + 2 - APPLY_STEPS
        if timed_apply:
            target = logits.clone()
            if cuda:
                torch.cuda.synchronize()
            apply_started = time.perf_counter()
            apply_grammar_bitmask(target, sampling)
            if cuda:
                torch.cuda.synchronize()
            applied = time.perf_counter()
        # the tokens each row picks (off the clock) and what the decode stage records of them
        for i, row in enumerate(rows):
            token = int(rng.integers(0, vocab)) if row.state is None else pick(mask_of(row.state, private), rng, vocab)
            host_tokens[i] = token
            if row.state is not None:
                row.position += 1
                if row.state.record(token):  # the grammar ended the sequence: a new one takes its row
                    rows[i] = Row(GrammarState(compiled))
        if step < 2:
            continue
        waits += bool(asked)
        series.add("rows", built - started)
        series.add("mask", mask)
        series.add("copy", copy)
        series.add("python", filled - built - mask - copy)
        series.add("fill_total", filled - built)
        series.add("exposed", filled - (asked[0] if asked else built))
        if timed_apply:
            series.add("apply", applied - apply_started)
    words_per_row = (vocab + 31) // 32
    return {"vocab": vocab, "batch": batch, "constrained": constrained, "steps": steps, "ms": series.medians(),
            "waits_for_previous_step": waits == steps, "bitmask_row_bytes": words_per_row * 4}


def run_host(a: argparse.Namespace) -> None:
    import xgrammar

    import ext
    import pipeline.grammar.mask as grammar_mask
    from pipeline.grammar.compiler import GrammarCompiler
    from pipeline.grammar.spec import GrammarSpec
    from pipeline.runner.host_staging import HostStaging

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # the logits ops on a shared machine: one thread, no OpenMP barrier stalls
    clocks = {"mask": Clock(), "copy": Clock()}
    grammar_mask._grammar_step = _TimedModule(grammar_mask._grammar_step, {"accept_and_fill": clocks["mask"]})
    HostStaging.send = clocks["copy"].wrap(HostStaging.send)  # the mask's copy (the step's other inputs: off the clock)
    source = tokenizer_dir(a.tokenizer)
    configs = []
    for vocab in a.vocabs:
        tokenizer = padded_tokenizer(vocab, source)
        compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
        compiled = compiler.compile_now(GrammarSpec.json_schema(SCHEMA))
        for batch in a.batches:
            for constrained in ("all", "one") if batch > 1 else ("all",):
                result = run_config(compiled, vocab, batch, constrained, a.steps, device, clocks)
                configs.append(result)
                print(f"V={vocab} B={batch} {constrained}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                       result["ms"].items()) + " ms", file=sys.stderr)
        compiler.close()
    name = "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else device.type
    report = {"benchmark": "grammar-host", "commit": commit(), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {len(os.sched_getaffinity(0))} usable",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "xgrammar": getattr(xgrammar, "__version__", None) or _xgrammar_version(),
              "cython": ext.is_compiled("grammar_step"), "schema": SCHEMA, "vocabs": list(a.vocabs),
              "method": __doc__.split("\n\n")[1].replace("\n", " "), "configs": configs}
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"grammar-host-{name}-{report['commit']}.json")
    emit_json(report, out)


def _xgrammar_version() -> str | None:
    from importlib.metadata import version

    return version("xgrammar")

