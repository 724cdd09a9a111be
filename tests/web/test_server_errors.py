"""Bad input gets OpenAI error JSON with the right status; disconnects and overload lose nothing."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.web.server_utils import LiveServer, metric_value
from web.app import ServerSettings

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], max_body_bytes=64 << 10)
    with LiveServer(tiny_model_dir, settings, max_model_len=128) as live:
        yield live


async def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with session.post(url, headers=headers, **kwargs) as response:
            return response.status, await response.json(content_type=None), dict(response.headers)


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}


BAD_REQUESTS = [
    ("malformed json", b"{not json", None, "JSON"),
    ("max_tokens zero", chat(max_tokens=0), "max_tokens", "max_tokens"),
    ("max_tokens negative", chat(max_tokens=-5), "max_tokens", "max_tokens"),
    ("temperature negative", chat(temperature=-1), "temperature", "temperature"),
    ("top_p above one", chat(top_p=1.5), "top_p", "top_p"),
    ("top_p zero", chat(top_p=0), "top_p", "top_p"),
    ("n zero", chat(n=0), "n", "n"),
    ("unknown role", chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "wizard"),
    ("empty messages", chat(messages=[]), "messages", "messages"),
    ("bad logit_bias key", chat(logit_bias={"abc": 1}), "logit_bias", "logit_bias"),
    ("logit_bias out of vocab", chat(logit_bias={"99999999": 1}), "logit_bias", "99999999"),
    ("over the model length", chat(max_tokens=500), "max_tokens", "128"),
    ("repetition_detection not an object", chat(repetition_detection=3), "repetition_detection", "object"),
    ("repetition_detection min_count 1", chat(repetition_detection={"min_count": 1}), "repetition_detection",
     "min_count"),
    ("repetition_detection sizes reversed", chat(repetition_detection={"min_pattern_size": 9, "max_pattern_size": 2}),
     "repetition_detection", "min_pattern_size"),
    ("repetition_detection unknown key", chat(repetition_detection={"window": 2}), "repetition_detection", "window"),
]


@pytest.mark.parametrize("name,body,param,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_invalid_requests_are_400_with_openai_error_json(server, name, body, param, needle):
    status, payload, _ = asyncio.run(post(server.url + "/v1/chat/completions", body))
    assert status == 400, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert needle in error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"].startswith(param)


def test_prompt_over_the_model_length_names_the_numbers(server):
    status, payload, _ = asyncio.run(post(server.url + "/v1/completions",
                                          {"model": "tiny", "prompt": [5] * 200, "max_tokens": 4}))
    assert status == 400 and "200" in payload["error"]["message"] and "128" in payload["error"]["message"]


def test_unknown_model_and_route_are_404(server):
    status, payload, _ = asyncio.run(post(server.url + "/v1/chat/completions", chat(model="gpt-9")))
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    status, payload, _ = asyncio.run(post(server.url + "/v1/nothing", chat()))
    assert status == 404 and "error" in payload


def test_body_over_the_limit_is_413(server):
    status, payload, _ = asyncio.run(post(server.url + "/v1/chat/completions", b"x" * (128 << 10)))
    assert status == 413 and "error" in payload


def test_bad_requests_disturb_nobody(server):
    async def main():
        good = [post(server.url + "/v1/chat/completions", chat(max_tokens=6, ignore_eos=True)) for _ in range(4)]
        bad = [post(server.url + "/v1/chat/completions", chat(temperature=-3)) for _ in range(4)]
        return await asyncio.gather(*good, *bad)

    results = asyncio.run(main())
    assert [r[0] for r in results] == [200] * 4 + [400] * 4
    assert all(r[1]["usage"]["completion_tokens"] == 6 for r in results[:4])
    server.wait_idle()


def test_api_key_is_required_when_configured(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], api_key="sekret")
    with LiveServer(tiny_model_dir, settings) as live:
        url = live.url + "/v1/chat/completions"
        missing = asyncio.run(post(url, chat()))
        wrong = asyncio.run(post(url, chat(), {"Authorization": "Bearer nope"}))
        right = asyncio.run(post(url, chat(), {"Authorization": "Bearer sekret"}))
        assert live.get_json("/health") == {"status": "ok"}  # health is not behind the key
    assert missing[0] == 401 and wrong[0] == 401 and missing[1]["error"]["type"] == "authentication_error"
    assert right[0] == 200


def test_admission_limit_answers_503_with_retry_after(tiny_model_dir):
    with LiveServer(tiny_model_dir, max_waiting_requests=0) as live:
        status, payload, headers = asyncio.run(post(live.url + "/v1/chat/completions", chat()))
        rejections = metric_value(live.metrics_text(), "conveyor_admission_rejections_total")
    assert status == 503 and "Retry-After" in headers and "waiting requests" in payload["error"]["message"]
    assert rejections >= 0


@pytest.fixture(scope="module")
def roomy_server(tiny_model_dir):
    """No small max_model_len: a request here can run long enough to be cut off mid-generation."""
    with LiveServer(tiny_model_dir) as live:
        yield live


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_frees_everything(roomy_server, stream):
    server = roomy_server

    async def main():
        body = chat(max_tokens=900, ignore_eos=True, stream=stream)
        async with aiohttp.ClientSession() as session:
            request = asyncio.ensure_future(session.post(server.url + "/v1/chat/completions", json=body))
            if stream:
                response = await request
                await response.content.readline()  # the first event arrived: generation is under way
                response.close()
                return
            deadline = time.monotonic() + 60  # wait until the engine is generating for it, then hang up
            while (await asyncio.to_thread(server.get_json, "/debug/stages"))["running"] == 0:
                assert time.monotonic() < deadline, "the request never started"
            request.cancel()

    asyncio.run(main())
    stats = server.wait_idle()
    text = server.metrics_text()
    assert stats["kv_blocks"]["used"] == 0
    assert metric_value(text, "conveyor_num_requests_running") == 0
    assert metric_value(text, "conveyor_kv_blocks_used") == 0
    assert metric_value(text, 'conveyor_requests_total{finish_reason="abort"') >= 1


def test_64_concurrent_streams_complete(server):
    async def one(session, i):
        body = chat(max_tokens=4 + i % 5, ignore_eos=True, stream=True, temperature=0.5)
        async with session.post(server.url + "/v1/chat/completions", json=body) as response:
            raw = await response.read()
        return response.status, raw.endswith(b"data: [DONE]\n\n")

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
            return await asyncio.gather(*[one(session, i) for i in range(64)])

    assert asyncio.run(main()) == [(200, True)] * 64
    server.wait_idle()


def test_a_client_that_stops_reading_does_not_hold_up_others(tiny_model_dir):
    with LiveServer(tiny_model_dir, output_channel_cap_bytes=256) as live:
        async def main():
            async with aiohttp.ClientSession() as session:
                stalled = await session.post(live.url + "/v1/chat/completions",
                                             json=chat(max_tokens=400, ignore_eos=True, stream=True))
                await stalled.content.readline()  # then stop reading
                others = [session.post(live.url + "/v1/chat/completions",
                                       json=chat(max_tokens=12, ignore_eos=True)) for _ in range(8)]
                replies = []
                for response in await asyncio.gather(*others):
                    replies.append(await response.json())
                tail = await stalled.read()  # now drain what the stalled client was sent
                return replies, tail

        replies, tail = asyncio.run(main())
        live.wait_idle()
    assert all(r["usage"]["completion_tokens"] == 12 for r in replies)
    assert tail.endswith(b"data: [DONE]\n\n")
