"""The detokenize stage with ext/detokenize_rows (compiled and twin) equals its per-row loop, kept here as
the reference, on random multi-step streams: deltas, cancel flags and the samples left, step by step.

The streams mix n=1 and n=2 requests, stop strings that match mid-stream (the owner then finishes the
cancelled child, sometimes a step late), logprobs, finish-only rows (-1), the owner's finishes with and
without a token, errors, samples whose first row arrives late, and rows for samples already done."""
from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from pipeline.messages import StepTokens
from pipeline.request import (
    CANCEL_FINISH_REASON,
    CancelReason,
    FinishReason,
    OutputDelta,
    Request,
    SamplingParams,
)
from pipeline.stages import detokenize
from pipeline.stages.detokenize import DetokenizeStage
from pipeline.tokenizer import Tokenizer
from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("detokenize_rows")
TEXTS = [
    "The quick brown fox jumps over the lazy dog. STOP here, then more text follows.",
    "def main():\n    return x::y {a: b}\n# end of code\n",
    "café naïve résumé, déjà vu 😀 and 中文字符 in one line\n\nnext",
    "Answer: 42. ### Done. Extra words after the marker keep coming.",
    "a b c d e f g h i j k l m n o p",
]
NEVER = "@@never in any text@@"
Process = Callable[[DetokenizeStage, StepTokens, list], None]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from pipeline.embedded import embedded_model_path
    try:
        return Tokenizer.from_gguf(embedded_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def reference_process(stage: DetokenizeStage, message: StepTokens, out: list) -> None:
    """DetokenizeStage._process as the per-row loop it was before ext/detokenize_rows: the definition."""
    tokens = message.token_ids.tolist()
    samples = stage.samples
    for r, request in enumerate(message.requests):
        index = message.indices[r]
        owner_finish = message.finish[r]
        state = samples.get((request.request_id, index)) or stage._new_state(request, index)
        if state.done:
            if owner_finish is not None:
                del samples[(request.request_id, index)]
            continue
        token = tokens[r]
        text = state.detokenizer.push_one(token) if token >= 0 else ""
        finish = owner_finish
        if finish is not None:
            text += state.detokenizer.flush()
        if state.stops is not None:
            text, matched = state.stops.feed(text)
            if not matched and finish is not None:
                text += state.stops.flush()
                matched = state.stops.matched is not None
            if matched:
                if finish is None:
                    request.cancel.cancel_child(index)
                finish = FinishReason.STOP
        logprobs = stage._logprobs(message, r, request) if token >= 0 and request.params.logprobs is not None else None
        error = request.cancel.message or "request failed" if finish is FinishReason.ERROR else None
        delta = OutputDelta(request.request_id, index, text, [token] if token >= 0 else [], logprobs, finish, error,
                            len(request.prompt_token_ids), message.output_counts[r], request.prompt_opens_thinking)
        out.append((request, delta))
        if finish is not None:
            state.done = True
            if owner_finish is not None:
                del samples[(request.request_id, index)]


def stage_process(stage: DetokenizeStage, message: StepTokens, out: list) -> None:
    stage._process(message, out)


class Sample:
    """One child's planned stream, as its owner (decode) would send it."""

    def __init__(self, rng: random.Random, tokenizer: Tokenizer, request: Request, index: int) -> None:
        self.request, self.index = request, index
        ids = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)[:rng.randint(1, 40)]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), tokenizer.eos_token_id)  # special: skipped or not
        self.tokens = ids
        self.start = rng.randrange(4)  # the first row arrives at this step
        self.end = rng.choice(["length", "stop", "abort", "error", "error"])  # how the owner ends it, if nothing else does
        self.ends_at = rng.randrange(len(ids) + 1)  # abort/error: after this many tokens
        self.sent = 0
        self.finished = False

    def row(self, rng: random.Random) -> tuple[int, FinishReason | None]:
        """The next row's (token, owner finish), as decode decides it."""
        cancel = self.request.cancel
        if cancel.child_is_set(self.index) and not (self.sent < len(self.tokens) and rng.random() < 0.3):
            # seen at the owner's next step (sometimes one step later: a token was already on its way)
            self.finished = True
            reason = FinishReason.STOP if cancel.reason is None else CANCEL_FINISH_REASON[cancel.reason]
            return -1, reason
        if self.sent == len(self.tokens) or (self.end in ("abort", "error") and self.sent >= self.ends_at):
            self.finished = True
            if self.end in ("abort", "error") and rng.random() < 0.5:
                return -1, FinishReason.ABORT if self.end == "abort" else FinishReason.ERROR
            if self.sent == len(self.tokens):
                return -1, FinishReason.LENGTH
        token = self.tokens[self.sent]
        self.sent += 1
        if self.finished:  # an owner finish that carries its last token
            return token, FinishReason.ERROR if self.end == "error" else FinishReason.LENGTH
        if self.sent == len(self.tokens) and self.end in ("length", "stop") and rng.random() < 0.7:
            self.finished = True
            return token, FinishReason.STOP if self.end == "stop" else FinishReason.LENGTH
        return token, None


def new_request(rng: random.Random, trial: int, number: int) -> Request:
    stop: list[str] = []
    if rng.random() < 0.5:
        text = rng.choice(TEXTS)
        at = rng.randrange(len(text) - 6)
        stop.append(text[at:at + rng.randint(1, 6)])  # matches mid-stream when its text is drawn
        if rng.random() < 0.3:
            stop.append(NEVER)
    elif rng.random() < 0.2:
        stop.append(NEVER)
    params = SamplingParams(n=rng.choice([1, 2]), stop=stop, include_stop_str_in_output=rng.random() < 0.3,
                            logprobs=rng.choice([None, None, None, 0, 2]), skip_special_tokens=rng.random() < 0.7)
    return Request(f"req-{trial}-{number}", [1] * rng.randint(1, 9), params, frozenset(), 1000,
                   prompt_opens_thinking=rng.random() < 0.3)


def message_for(rng: random.Random, rows: list[tuple[Sample, int, FinishReason | None]]) -> StepTokens:
    count = len(rows)
    with_logprobs = rng.random() < 0.8  # else the message carries none, even for requests that ask
    return StepTokens(
        requests=[s.request for s, _, _ in rows],
        indices=[s.index for s, _, _ in rows],
        token_ids=np.asarray([t for _, t, _ in rows], dtype=np.int64),
        finish=[f for _, _, f in rows],
        output_counts=[s.sent for s, _, _ in rows],
        logprobs=np.asarray([rng.random() for _ in rows], dtype=np.float32) if with_logprobs else None,
        top_ids=np.asarray([[rng.randrange(100) for _ in range(3)] for _ in rows], dtype=np.int64).reshape(count, 3)
        if with_logprobs else None,
        top_logprobs=np.asarray([[rng.random() for _ in range(3)] for _ in rows], dtype=np.float32).reshape(count, 3)
        if with_logprobs else None,
    )


def run_stream(trial: int, tokenizer: Tokenizer, process: Process) -> tuple[list, dict[str, int]]:
    """Drives one stage through a random stream; returns what it did at each step, and the row kinds seen."""
    rng = random.Random(trial)
    stage = DetokenizeStage(4, tokenizer=tokenizer, stream=None)  # type: ignore[arg-type]
    requests = [new_request(rng, trial, number) for number in range(rng.randint(1, 5))]
    samples = [Sample(rng, tokenizer, request, index) for request in requests for index in range(request.params.n)]
    error_step = {request.request_id: rng.randrange(12) for request in requests}
    kinds = dict.fromkeys(["rows", "first", "done", "finish_only", "owner_finish", "stop_matched", "logprobs",
                           "error"], 0)
    observed = []
    for step in range(200):
        live = [s for s in samples if not s.finished and s.start <= step]
        if not live and all(s.finished for s in samples):
            break
        for request in requests:  # an error cancels a request whose samples plan one
            if error_step[request.request_id] == step and any(s.end == "error" for s in samples if s.request is request):
                request.cancel.cancel(CancelReason.ERROR, rng.choice(["", "the device failed"]))
        rng.shuffle(live)
        rows = [(s, *s.row(rng)) for s in live]
        for s, token, finish in rows:
            key = (s.request.request_id, s.index)
            kinds["rows"] += 1
            kinds["first"] += key not in stage.samples
            kinds["done"] += key in stage.samples and stage.samples[key].done
            kinds["finish_only"] += token < 0
            kinds["owner_finish"] += finish is not None
        out: list = []
        process(stage, message_for(rng, rows), out)
        for request, delta in out:
            assert request.request_id == delta.request_id
            kinds["logprobs"] += delta.logprobs is not None
            kinds["error"] += delta.finish_reason is FinishReason.ERROR
        observed.append((
            [(d.request_id, d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.error, d.prompt_token_count,
              d.output_token_count, d.prompt_opens_thinking) for _, d in out],
            [(r.cancel.reason, r.cancel.message, sorted(r.cancel.children)) for r in requests],
            sorted((key, state.done) for key, state in stage.samples.items()),
        ))
    kinds["stop_matched"] = sum(len(r.cancel.children) for r in requests)
    assert all(s.finished for s in samples)
    assert stage.samples == {}, "detokenizer state leaked"
    return observed, kinds


@pytest.mark.parametrize("module", MODULES)
def test_stage_equals_the_per_row_loop(module, tokenizer: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(detokenize, "_detokenize_rows", module)
    seen = dict.fromkeys(["rows", "first", "done", "finish_only", "owner_finish", "stop_matched", "logprobs",
                          "error"], 0)
    for trial in range(150):
        expected, kinds = run_stream(trial, tokenizer, reference_process)
        actual, _ = run_stream(trial, tokenizer, stage_process)
        assert actual == expected, f"trial {trial}"
        for kind, count in kinds.items():
            seen[kind] += count
    assert all(seen.values()), seen  # every kind of row was exercised


@pytest.mark.parametrize("module", MODULES)
def test_common_rows_skip_the_general_path(module, tokenizer: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(detokenize, "_detokenize_rows", module)
    stage = DetokenizeStage(4, tokenizer=tokenizer, stream=None)  # type: ignore[arg-type]
    general: list[int] = []
    process_row = stage._process_row
    stage._process_row = lambda message, tokens, out, r: (general.append(r), process_row(message, tokens, out, r))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(), frozenset(), 100) for i in range(4)]
    ids = tokenizer.encode("café 😀 déjà vu", add_special_tokens=False)
    texts: dict[str, str] = {r.request_id: "" for r in requests}
    for step, token in enumerate(ids):
        out: list = []
        stage._process(StepTokens(requests, [0] * 4, np.full(4, token, dtype=np.int64), [None] * 4, [step + 1] * 4), out)
        assert [(d.request_id, d.token_ids, d.output_token_count) for _, d in out] == \
            [(r.request_id, [token], step + 1) for r in requests]
        for _, d in out:
            texts[d.request_id] += d.text
        assert general == ([0, 1, 2, 3] if step == 0 else [])  # only the first rows (no state yet)
        general.clear()
    assert set(texts.values()) == {"café 😀 déjà vu"}


@pytest.mark.parametrize("module", MODULES)
def test_a_short_row_list_fails_where_the_per_row_loop_does(module, tokenizer: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(detokenize, "_detokenize_rows", module)
    requests = [Request(f"r{i}", [1], SamplingParams(), frozenset(), 100) for i in range(3)]
    outs = []
    for process in (reference_process, stage_process):
        stage = DetokenizeStage(4, tokenizer=tokenizer, stream=None)  # type: ignore[arg-type]
        out: list = []
        with pytest.raises(IndexError):
            process(stage, StepTokens(requests, [0, 0, 0], np.asarray([5, 6, 7]), [None] * 3, [1, 1]), out)
        outs.append([(d.request_id, d.text, d.output_token_count) for _, d in out])
    assert outs[0] == outs[1] and len(outs[0]) == 2
