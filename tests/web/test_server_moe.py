"""A tiny Qwen3-MoE model served end to end through the HTTP API with the official openai client:
chat, streaming (the streamed text equals the whole reply), and a tool call whose arguments the
grammar keeps valid. The model is random; what is checked is the path, not the words."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.web.server_utils import LiveServer
from web.app import ServerSettings

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(make_model_dir):
    model_dir = make_model_dir("qwen3_moe", mlp_only_layers=[1])  # a sparse layer and a dense one
    with LiveServer(model_dir, ServerSettings(served_model_names=["tiny-moe"])) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_its_stream_agree(client):
    kwargs = dict(model="tiny-moe", messages=MESSAGES, max_tokens=16, temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_a_tool_call_has_schema_valid_arguments(client):
    reply = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=1, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
