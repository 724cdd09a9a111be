"""Grammar bounds through the live server: a source over --max-grammar-bytes and a compile past
--max-grammar-seconds are clear 400s in the OpenAI error shape, and the server goes on serving."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import orjson
import pytest

from pipeline.grammar.spec import GrammarSpec
from tests.pipeline.grammar.test_structured_output import SCHEMA
from tests.web.server_utils import LiveServer, wait_for
from web.app import ServerSettings

MESSAGES = [{"role": "user", "content": "Describe a ball as JSON."}]
MAX_BYTES = 4096


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], tool_call_parser="hermes")
    with LiveServer(tiny_model_dir, settings, max_grammar_bytes=MAX_BYTES, max_grammar_seconds=1.0) as server:
        yield server


def post(live: LiveServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(live.url + path, data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, orjson.loads(error.read())


def many_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(n)}}


def chat_with_schema(schema: dict) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def check_400(status: int, body: dict, *needles: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    for needle in needles:
        assert needle in error["message"], error["message"]


def test_a_schema_over_max_grammar_bytes_is_a_400_naming_the_limit(live):
    status, body = post(live, "/v1/chat/completions", chat_with_schema(many_properties(400)))
    check_400(status, body, f"limit of {MAX_BYTES} bytes", "--max-grammar-bytes")


def test_a_tool_set_over_max_grammar_bytes_is_a_400_naming_the_limit(live):
    tool = {"type": "function", "function": {"name": "big", "parameters": many_properties(400)}}
    status, body = post(live, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 20,
                                                       "tools": [tool], "tool_choice": "required"})
    check_400(status, body, f"limit of {MAX_BYTES} bytes", "--max-grammar-bytes")


def test_a_compile_past_max_grammar_seconds_is_a_400_and_the_server_goes_on(live):
    status, body = post(live, "/v1/chat/completions", chat_with_schema(SCHEMA))  # xgrammar's side is built
    assert status == 200, body
    compiler = live.engine.grammar_compiler()
    release, real = threading.Event(), compiler._compile
    slow = many_properties(3)

    def blocking(spec: GrammarSpec):  # this schema's compile outlasts the bound; others compile as usual
        if spec == GrammarSpec.json_schema(slow):
            release.wait(30)
        return real(spec)

    compiler._compile = blocking
    try:
        started = time.monotonic()
        status, body = post(live, "/v1/chat/completions", chat_with_schema(slow))
        took = time.monotonic() - started
        check_400(status, body, "grammar compilation timed out after 1 s", "--max-grammar-seconds")
        assert took < 5

        status, body = post(live, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"

        started = time.monotonic()
        status, body = post(live, "/v1/chat/completions", chat_with_schema(slow))  # refused without waiting
        check_400(status, body, "not compiled again", "--max-grammar-seconds")
        assert time.monotonic() - started < 1.0

        status, body = post(live, "/v1/chat/completions", chat_with_schema(many_properties(2)))  # others compile
        assert status == 200, body
    finally:
        release.set()
        compiler._compile = real
    wait_for(lambda: not compiler.pool.running())
    stats = live.wait_idle()
    assert stats["waiting"] == {"requests": 0, "tokens": 0}
