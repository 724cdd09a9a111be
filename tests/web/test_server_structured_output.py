"""Structured output through the live server with the official openai client."""
from __future__ import annotations

import json

import openai
import pytest

from tests.pipeline.grammar.test_structured_output import SCHEMA, check_schema
from tests.web.server_utils import LiveServer

MESSAGES = [{"role": "user", "content": "Describe a ball as JSON."}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with LiveServer(tiny_model_dir) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_response_parses_and_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=60,
                                               temperature=1.0, seed=seed)
        check_schema(json.loads(reply.choices[0].message.content))
        assert reply.choices[0].finish_reason == "stop"


def test_streamed_json_equals_non_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}}
    kwargs = dict(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=60, temperature=0.9, seed=7)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == full
    check_schema(json.loads(full))


def test_choice_regex_and_json_object_extensions(client):
    choice = client.completions.create(model="tiny", prompt="pick", max_tokens=10, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert choice.choices[0].text in ("left", "right")
    regex = client.completions.create(model="tiny", prompt="id", max_tokens=10, temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": "[xyz]{4}"}})
    assert len(regex.choices[0].text) == 4 and set(regex.choices[0].text) <= set("xyz")


def test_a_bad_schema_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
        "a": {"type": "not-a-type"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=5)
    assert info.value.body["param"] == "response_format"
