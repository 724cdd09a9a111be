"""The text delta sink equals the general streaming path (web/generation.py) byte for byte and field for
field, compiled and twin, for completions and chat, on random delta sequences."""
from __future__ import annotations

import itertools
import random
import types

import pytest

from pipeline.request import FinishReason, OutputDelta, TokenLogprob
from tests.ext.twins import twin_and_compiled
from web import generation
from web.app import ServerSettings, ServerState
from web.metrics import ServerMetrics

MODULES = twin_and_compiled("text_delta_sink")
TEXTS = ["", "a", " word", "é😀", '"quoted"', "back\\slash", "new\nline", "\x01", "x" * 300]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def new_state() -> ServerState:
    state = ServerState(ServerSettings(served_model_names=["m"]), ServerMetrics(lambda: {}, "m"))
    state.engine = types.SimpleNamespace(tokenizer=FakeTokenizer())
    return state


def new_endpoint(kind: str, state: ServerState) -> generation.Endpoint:
    if kind == "chat":
        return generation.ChatEndpoint(state, "m", False, False)
    return generation.CompletionEndpoint(state, "m", False, False)


def random_deltas(rng: random.Random, n: int, length: int) -> list[OutputDelta]:
    counts = [0] * n
    deltas = []
    for _ in range(length):
        index = rng.randrange(n)
        tokens = rng.choice([[], [7], [7, 8], [1, 2, 3]])
        counts[index] += len(tokens)
        finish = rng.choice([None] * 12 + [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR])
        logprobs = [TokenLogprob(7, -0.5, [])] if rng.random() < 0.1 and tokens else None
        deltas.append(OutputDelta("r", index, rng.choice(TEXTS), tokens, logprobs, finish,
                                  "boom" if finish is FinishReason.ERROR else None, rng.choice([3, 4]),
                                  counts[index], rng.random() < 0.2))
    return deltas


class Response:
    """A tracker, an endpoint and the chunks written for one response, through either path."""

    def __init__(self, kind: str) -> None:
        self.state = new_state()
        self.endpoint = new_endpoint(kind, self.state)
        self.endpoint.id, self.endpoint.created = "cmpl-1", 1  # the same for both paths
        self.tracker = generation.Tracker(0.0)
        self.chunks: list[bytes] = []
        events = generation.delta_events(self.endpoint, self.tracker)
        self.slow = lambda delta: self.send(events(delta))

    def send(self, data: bytes) -> None:  # SSEBody.send's framing
        if data:
            self.chunks.append(b"%x\r\n%b\r\n" % (len(data), data))

    def sink(self, module, n: int):
        templates = {index: self.endpoint.text_template(index) for index in range(n)}
        return module.TextDeltaSink(self.slow, self.tracker, templates, self.chunks.append,
                                    self.state.metrics.inter_token_gaps, generation.time.monotonic,
                                    self.endpoint.counts_text_offset)

    def observed(self) -> tuple:
        t = self.tracker
        choices = {i: (c.output_tokens, c.text_offset, c.prompt_opens_thinking, c.finish_reason, c.error, c.text)
                   for i, c in t.choices.items()}
        itl = self.state.metrics._itl.counts
        return (b"".join(self.chunks), t.first_token, t.last_delta, t.prompt_tokens, choices, itl.counts, itl.samples,
                itl.total)


class FakeClock:
    """time.monotonic for both paths, restarted between them so they see the same times. Its gaps span
    the inter-token histogram's buckets, some exactly on a bound (the sink bisects them itself)."""

    GAPS = (0.001, 0.00025, 0.004, 0.0000001, 0.3, 12.0, 0.05, 0.0025, 1.0)

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.gaps = itertools.cycle(self.GAPS)
        self.now = 100.0

    def __call__(self) -> float:
        self.now += next(self.gaps)
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(generation.time, "monotonic", clock)
    return clock


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sink_equals_the_general_path(module, kind, fake_clock):
    rng = random.Random(kind)
    for trial in range(60):
        n = rng.choice([1, 2, 3])
        deltas = random_deltas(rng, n, rng.randint(1, 40))
        reference, fast = Response(kind), Response(kind)
        sink = fast.sink(module, n - (trial % 2))  # odd trials: the last choice has no template
        fake_clock.restart()
        for delta in deltas:
            reference.slow(OutputDelta(**{f: getattr(delta, f) for f in delta.__slots__}))
        fake_clock.restart()
        for delta in deltas:
            sink(OutputDelta(**{f: getattr(delta, f) for f in delta.__slots__}))
        assert fast.observed() == reference.observed()


@pytest.mark.parametrize("module", MODULES)
def test_plain_text_deltas_skip_the_general_path(module, fake_clock):
    response = Response("completion")
    general = []
    sink = module.TextDeltaSink(lambda d: (general.append(d), response.slow(d)), response.tracker,
                                {0: response.endpoint.text_template(0)}, response.chunks.append,
                                response.state.metrics.inter_token_gaps, generation.time.monotonic, True)
    first = OutputDelta("r", 0, "a", [1], None, None, None, 3, 1)
    sink(first)  # no Choice yet: the general path makes it
    for i in range(2, 6):
        sink(OutputDelta("r", 0, "b", [1], None, None, None, 3, i))
    sink(OutputDelta("r", 0, "", [], None, FinishReason.STOP, None, 3, 5))
    assert [d.output_token_count for d in general] == [1, 5]  # the first and the final delta only
    assert response.tracker.choices[0].text_offset == 5
    assert response.chunks[1:5] == [response.chunks[1]] * 4 and b'"text":"b"' in response.chunks[1]


@pytest.mark.parametrize("module", MODULES)
def test_write_failure_propagates(module, fake_clock):
    response = Response("chat")
    response.tracker.choices[0] = generation.Choice()

    def gone(chunk: bytes) -> None:
        raise ConnectionResetError("the client went away")

    sink = module.TextDeltaSink(response.slow, response.tracker, {0: response.endpoint.text_template(0)}, gone,
                                response.state.metrics.inter_token_gaps, generation.time.monotonic, False)
    with pytest.raises(ConnectionResetError):
        sink(OutputDelta("r", 0, "a", [1], None, None, None, 3, 1))


def test_listener_is_the_general_path_when_deltas_need_more_than_text():
    state = new_state()
    tracker = generation.Tracker(0.0)
    body = types.SimpleNamespace(chunk_writer=lambda: [].append)
    slow = lambda delta: None  # noqa: E731
    plain = generation.CompletionEndpoint(state, "m", False, False)
    assert generation.text_listener(plain, tracker, body, slow, 1) is not slow
    for endpoint in [generation.CompletionEndpoint(state, "m", False, True),  # logprobs
                     generation.CompletionEndpoint(state, "m", False, False, echo_text="prompt"),
                     generation.ChatEndpoint(state, "m", False, False, parsers=lambda: None),  # a parser
                     generation.ChatEndpoint(state, "m", False, True)]:
        assert generation.text_listener(endpoint, tracker, body, slow, 1) is slow
