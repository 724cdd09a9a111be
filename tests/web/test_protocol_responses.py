"""OpenAI response builders: shapes the official client parses (strictly where OpenAI's own are strict)."""
from __future__ import annotations

import math
from collections.abc import Callable

import httpx2
import openai
import orjson
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pipeline.request import FinishReason, TokenLogprob
from web.protocol import (SSE_DONE, APIError, TextEvent, chat_chunk, chat_choice, chat_completion, chat_delta_choice,
                          chat_logprobs, chat_usage_chunk, completion_choice, completion_chunk, completion_logprobs,
                          completion_response, completion_usage_chunk, models_list, new_chat_id, new_completion_id,
                          sse_event, usage, wire_finish_reason)

VOCAB = {1: "Hello", 2: " world", 3: "!", 4: "é", 5: " there"}
ENTRIES = [TokenLogprob(1, -0.1, [(1, -0.1), (5, -2.5)]), TokenLogprob(2, -0.5, [(3, -0.3), (2, -0.5)]),
           TokenLogprob(4, -math.inf, [])]


def token_text(token_id: int) -> str:
    return VOCAB[token_id]


def test_sse_framing_is_exact() -> None:
    assert sse_event({"a": 1, "b": "é"}) == b'data: {"a":1,"b":"\xc3\xa9"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


TEXTS = ["", "Hello", ' "quoted" \\ back', "tab\tnew\nline\r\x00\x1f", "é日本語🙂", "\u2028\u2029", "x" * 5000,
         "\x00conveyor-text\x00"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_text_event_templates_equal_encoding_the_chunk(include_usage: bool, index: int) -> None:
    """The template of a text-only chunk gives the very bytes of building and encoding the chunk."""
    makers = [
        lambda text: chat_chunk("chatcmpl-x", 7, "m", [chat_delta_choice(index, content=text)],
                                include_usage=include_usage),
        lambda text: completion_chunk("cmpl-x", 7, "m", [completion_choice(index, text, None)],
                                      include_usage=include_usage),
    ]
    for make in makers:
        template = TextEvent(make)
        for text in TEXTS:
            assert template(text) == sse_event(make(text))


def test_a_text_event_template_needs_exactly_one_text_field() -> None:
    with pytest.raises(ValueError):
        TextEvent(lambda text: {"a": text, "b": text})
    with pytest.raises(ValueError):
        TextEvent(lambda text: {"a": "fixed"})


def test_ids_and_usage() -> None:
    assert new_chat_id().startswith("chatcmpl-") and new_chat_id() != new_chat_id()
    assert new_completion_id().startswith("cmpl-")
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(8, 1, 4)["prompt_tokens_details"] == {"cached_tokens": 4}


def test_finish_reasons_are_ones_the_client_accepts() -> None:
    assert [wire_finish_reason(r) for r in FinishReason] == ["stop", "length", "length", "length"]
    assert wire_finish_reason("abort") == "length"
    assert wire_finish_reason("tool_calls") == "tool_calls"
    assert wire_finish_reason(None) is None


def test_chat_completion_parses_strictly() -> None:
    choices = [chat_choice(0, "Hello world", FinishReason.STOP, logprobs=chat_logprobs(ENTRIES, token_text)),
               chat_choice(1, "Hi", FinishReason.ABORT)]
    body = chat_completion("chatcmpl-1", 1700000000, "smol", choices, usage(5, 3))
    parsed = ChatCompletion.model_validate(orjson.loads(orjson.dumps(body)))
    assert parsed.object == "chat.completion" and parsed.id == "chatcmpl-1" and parsed.model == "smol"
    assert parsed.usage.total_tokens == 8
    first, second = parsed.choices
    assert first.message.role == "assistant" and first.message.content == "Hello world"
    assert first.finish_reason == "stop" and second.finish_reason == "length" and second.logprobs is None
    content = first.logprobs.content
    assert [c.token for c in content] == ["Hello", " world", "é"]
    assert content[0].bytes == list(b"Hello") and content[2].bytes == [0xC3, 0xA9]
    assert content[2].logprob == -9999.0  # -inf has no JSON form
    assert [(t.token, t.logprob, t.bytes) for t in content[1].top_logprobs] == [
        ("!", -0.3, [33]), (" world", -0.5, list(b" world"))]


def test_chat_message_extras_for_reasoning_and_tools() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    choice = chat_choice(0, None, "tool_calls", reasoning_content="hmm", tool_calls=[call])
    parsed = ChatCompletion.model_validate(chat_completion("c", 1, "m", [choice], usage(1, 1)))
    message = parsed.choices[0].message
    assert message.content is None and message.tool_calls[0].function.name == "f"
    assert message.reasoning_content == "hmm" and parsed.choices[0].finish_reason == "tool_calls"


def test_chat_logprobs_exact_bytes_hook() -> None:
    out = chat_logprobs([TokenLogprob(9, -1.0, [(9, -1.0)])], lambda t: "\ufffd", token_bytes=lambda t: b"\xe2\x80")
    assert out == {"content": [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2, 0x80],
                                "top_logprobs": [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2, 0x80]}]}],
                   "refusal": None}


def test_chat_chunks() -> None:
    first = chat_chunk("c", 1, "m", [chat_delta_choice(0, role="assistant", content="")], include_usage=True)
    logprobs = chat_logprobs(ENTRIES[:1], token_text)
    middle = chat_chunk("c", 1, "m", [chat_delta_choice(0, content="Hi", logprobs=logprobs)])
    last = chat_chunk("c", 1, "m", [chat_delta_choice(0, finish_reason=FinishReason.LENGTH)], include_usage=True)
    final = chat_usage_chunk("c", 1, "m", usage(2, 3))
    assert first["usage"] is None and "usage" not in middle
    assert first["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}
    assert last["choices"][0]["delta"] == {}
    parsed = [ChatCompletionChunk.model_validate(c) for c in (first, middle, last, final)]
    assert all(p.object == "chat.completion.chunk" for p in parsed)
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "Hi" and parsed[1].choices[0].logprobs.content[0].token == "Hello"
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage.completion_tokens == 3


def test_chat_delta_extras() -> None:
    choice = chat_delta_choice(1, reasoning_content="r", tool_calls=[{"index": 0, "id": "x", "type": "function",
                                                                       "function": {"name": "f", "arguments": ""}}])
    parsed = ChatCompletionChunk.model_validate(chat_chunk("c", 1, "m", [choice])).choices[0]
    assert parsed.index == 1 and parsed.delta.reasoning_content == "r" and parsed.delta.tool_calls[0].id == "x"


def test_completion_logprobs_shape_and_offsets() -> None:
    out = completion_logprobs(ENTRIES, token_text, text_offset=10)
    assert out == {
        "tokens": ["Hello", " world", "é"],
        "token_logprobs": [-0.1, -0.5, -9999.0],
        "top_logprobs": [{"Hello": -0.1, " there": -2.5}, {" world": -0.5, "!": -0.3}, {"é": -9999.0}],
        "text_offset": [10, 15, 21],
    }


def test_completion_response_parses_strictly() -> None:
    choice = completion_choice(0, "Hello world", FinishReason.LENGTH, logprobs=completion_logprobs(ENTRIES, token_text))
    body = completion_response("cmpl-1", 5, "smol", [choice], usage(2, 3))
    parsed = Completion.model_validate(orjson.loads(orjson.dumps(body)))
    assert parsed.object == "text_completion" and parsed.choices[0].text == "Hello world"
    assert parsed.choices[0].finish_reason == "length" and parsed.usage.total_tokens == 5
    assert parsed.choices[0].logprobs.top_logprobs[1] == {" world": -0.5, "!": -0.3}


def test_completion_chunks() -> None:
    middle = completion_chunk("cmpl-1", 5, "m", [completion_choice(0, "He", None)], include_usage=True)
    last = completion_chunk("cmpl-1", 5, "m", [completion_choice(0, "llo", FinishReason.STOP)])
    final = completion_usage_chunk("cmpl-1", 5, "m", usage(1, 2))
    assert middle == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "usage": None,
                      "choices": [{"index": 0, "text": "He", "logprobs": None, "finish_reason": None}]}
    # OpenAI's own stream sends finish_reason null mid-stream, which its strict type does not allow;
    # the client builds stream chunks without validation, so only the final ones are checked strictly.
    assert Completion.model_validate(last).choices[0].finish_reason == "stop"
    assert Completion.model_validate(final).usage.completion_tokens == 2 and final["choices"] == []


def test_models_list() -> None:
    body = models_list(["smol", "alias"], 123, 2048)
    assert body["object"] == "list"
    models = [Model.model_validate(entry) for entry in body["data"]]
    assert [m.id for m in models] == ["smol", "alias"] and models[0].owned_by == "conveyor"
    assert body["data"][0]["max_model_len"] == 2048 and body["data"][0]["created"] == 123


# ---- through the real client ------------------------------------------------------------------------

def client_for(handler: Callable[[httpx2.Request], httpx2.Response], strict: bool = True) -> openai.OpenAI:
    """The official client over an in-memory transport; strict=True validates every parsed object."""
    transport = httpx2.MockTransport(handler)
    return openai.OpenAI(api_key="x", base_url="http://test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=transport), _strict_response_validation=strict)


def sse_response(events: list[dict]) -> httpx2.Response:
    body = b"".join(sse_event(e) for e in events) + SSE_DONE
    return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})


def test_official_client_reads_a_chat_stream() -> None:
    events = [
        chat_chunk("c", 1, "m", [chat_delta_choice(0, role="assistant", content="")], include_usage=True),
        chat_chunk("c", 1, "m", [chat_delta_choice(0, content=" ")], include_usage=True),  # whitespace survives
        chat_chunk("c", 1, "m", [chat_delta_choice(0, content="Hi", finish_reason="stop")], include_usage=True),
        chat_usage_chunk("c", 1, "m", usage(4, 2)),
    ]
    client = client_for(lambda request: sse_response(events))
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " Hi"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 6


def test_official_client_reads_a_completion_stream() -> None:
    events = [completion_chunk("k", 1, "m", [completion_choice(0, "a", None)]),
              completion_chunk("k", 1, "m", [completion_choice(0, "b", FinishReason.LENGTH)])]
    # Non-strict (the client's default): mid-stream finish_reason null fails Completion's strict
    # type, exactly as OpenAI's own completion streams would.
    client = client_for(lambda request: sse_response(events), strict=False)
    chunks = list(client.completions.create(model="m", prompt="x", stream=True))
    assert [c.choices[0].text for c in chunks] == ["a", "b"] and chunks[1].choices[0].finish_reason == "length"


def test_official_client_raises_our_error() -> None:
    error = APIError(400, "temperature must be a number, got \"hot\"", param="temperature")
    client = client_for(lambda request: httpx2.Response(400, content=orjson.dumps(error.body())))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"
    assert "hot" in info.value.message


def test_official_client_reads_a_completion() -> None:
    body = completion_response("k", 1, "m", [completion_choice(0, "done", "stop")], usage(1, 1))
    client = client_for(lambda request: httpx2.Response(200, content=orjson.dumps(body),
                                                        headers={"content-type": "application/json"}))
    assert client.completions.create(model="m", prompt="x").choices[0].text == "done"
