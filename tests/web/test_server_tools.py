"""Tool calls and reasoning through the live server with the official openai client.

The tiny model is random: the tool-call grammar alone makes its calls well-formed, which is the
point (arguments always parse and match the schema)."""
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
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Clock", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client_for(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def client(request, tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], tool_call_parser=request.param)
    with LiveServer(tiny_model_dir, settings) as live:
        yield client_for(live)


def check_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_choice_gives_schema_valid_arguments(client, seed):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_parallel_calls_are_each_well_formed(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=4)
    calls = reply.choices[0].message.tool_calls
    complete = calls if reply.choices[0].finish_reason == "tool_calls" else calls[:-1]  # the last may be cut off
    check_calls(complete)


def test_named_tool_choice_calls_that_function_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                               max_tokens=120, temperature=1.0, seed=seed)
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls, names=("get_time",))


def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                  temperature=0.9, seed=11, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content  # no markup leaks into content
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert entry["id"] is None and delta.type == "function" and delta.function.name
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(calls) == 1


def test_tool_choice_none_is_plain_text(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


# ---- reasoning: a Qwen3-style template that opens <think> for the model ----

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_client(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    settings = ServerSettings(served_model_names=["tiny"], reasoning_parser="qwen3")
    with LiveServer(tiny_model_dir, settings, chat_template=str(path)) as live:
        yield client_for(live)


def test_reasoning_is_separated_streaming_and_not(thinking_client):
    # the random model never closes the block itself: the thinking budget forces </think> after 6 tokens
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8, seed=5,
                  extra_body={"thinking_token_budget": 6, "ignore_eos": True})
    whole = thinking_client.chat.completions.create(**kwargs).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert "</think>" not in (whole.content or "")
    streamed_reasoning, streamed_content = "", ""
    for chunk in thinking_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert streamed_reasoning == reasoning and streamed_content == (whole.content or "")


def test_thinking_disabled_gives_content_only(thinking_client):
    reply = thinking_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content and not (message.model_extra or {}).get("reasoning_content")
