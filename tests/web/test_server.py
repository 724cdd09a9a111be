"""The live server through the official openai client and raw SSE bytes."""
from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from tests.web.server_utils import LiveServer, metric_value
from web.app import ServerSettings

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with LiveServer(tiny_model_dir, ServerSettings(served_model_names=["tiny"])) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming_with_usage(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.model == "tiny"
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completions_streaming_and_not(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full.choices[0].text
    echoed = client.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "Once upon a time" + full.choices[0].text


def test_n_samples_with_a_seed(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, seed=7,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.completion_tokens == 12
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, seed=7,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.message.content for c in reply.choices] == [c.message.content for c in again.choices]


def test_logprobs_in_both_formats(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_stop_strings(client):
    kwargs = dict(model="tiny", prompt="abc", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[5:8]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def test_loop_guard_ends_a_degenerate_generation_with_length(client, server):
    # logit_bias forces one token forever: a one-token loop the guard catches after 6 repeats
    kwargs = dict(model="tiny", prompt="abc", max_tokens=40, temperature=0)
    loop = {"ignore_eos": True, "logit_bias": {"1234": 100}}
    guarded = client.completions.create(
        extra_body={**loop, "repetition_detection": {"min_pattern_size": 1, "max_pattern_size": 4, "min_count": 6}},
        **kwargs)
    assert guarded.choices[0].finish_reason == "length" and guarded.usage.completion_tokens == 6
    unguarded = client.completions.create(extra_body={**loop, "repetition_detection": False}, **kwargs)
    assert unguarded.usage.completion_tokens == 40
    streamed = list(client.completions.create(stream=True, extra_body={
        **loop, "repetition_detection": {"max_pattern_size": 4, "min_count": 6}}, **kwargs))
    assert streamed[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == guarded.choices[0].text
    stats = server.wait_idle()
    assert stats["kv_blocks"]["used"] == 0 and stats["seats"]["held"] == 0


def test_raw_sse_bytes(server):
    async def main():
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "stream": True, "temperature": 0,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                return await response.read()

    raw = asyncio.run(main())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_tokenize_and_debug(server):
    models = server.get_json("/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert server.get_json("/health") == {"status": "ok"}
    stages = server.get_json("/debug/stages")
    assert {"intake", "prefill", "decode", "verify", "detokenize", "stream"} <= set(stages["stages"])

    async def post(path, body):
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + path, json=body) as response:
                return response.status, await response.json()

    status, tokens = asyncio.run(post("/tokenize", {"prompt": "hello world"}))
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    status, text = asyncio.run(post("/detokenize", {"tokens": tokens["tokens"]}))
    assert status == 200 and text["prompt"] == "hello world"
    status, chat = asyncio.run(post("/tokenize", {"messages": MESSAGES}))
    assert status == 200 and chat["count"] > tokens["count"]


def test_metrics_count_requests_and_tokens(server, client):
    before = metric_value(server.metrics_text(), "conveyor_generation_tokens_total")
    client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = server.metrics_text()
    assert metric_value(text, "conveyor_generation_tokens_total") == before + 5
    for name in ("conveyor_time_to_first_token_seconds_count", "conveyor_kv_blocks_total",
                 "conveyor_stage_service_time_seconds_count", "conveyor_num_requests_waiting"):
        metric_value(text, name)


def test_a_repeated_prompt_reports_its_cached_tokens_and_a_salt_isolates_it(client):
    messages = [{"role": "user", "content": "A longer question about rivers, lakes and the sea, asked twice."}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs).usage
    second = client.chat.completions.create(**kwargs).usage
    assert second.prompt_tokens == first.prompt_tokens
    assert 0 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    salted = client.chat.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "cache_salt": "t1"}})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**kwargs, "extra_body": {"cache_salt": ""}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**kwargs, "extra_body": {"cache_salt": 3}})
