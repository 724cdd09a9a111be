"""The Responses API through the live server with the official openai client (typed stream events included).

The tiny model is random: grammars make its tool calls, structured output and reasoning deterministic in shape."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest

from tests.web.agent_http import post_json, post_stream
from tests.web.server_utils import LiveServer, metric_value
from web.app import ServerSettings

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
         {"type": "web_search"},
         {"type": "custom", "name": "apply_patch", "description": "freeform", "format": {"type": "grammar"}},
         {"type": "namespace", "name": "mcp__files", "tools": []}]
FORCED = {"type": "function", "name": "get_weather"}
NO_THINKING = {"effort": "none"}  # else the reasoning parser lets the forced call wait for a </think>
THINK_THEN_ANSWER = r"<think>[a-z]{3,12}</think>[a-z]{2,10}"


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], tool_call_parser="hermes", reasoning_parser="qwen3",
                              responses_store_size=4)
    with LiveServer(tiny_model_dir, settings, max_model_len=512) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_create_with_string_input(client):
    response = client.responses.create(model="tiny", input="Say hi", max_output_tokens=6, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output_text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + 6
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_stream_events_in_order_with_the_final_ids(client):
    events = list(client.responses.create(model="tiny", input=[{"role": "developer", "content": "Be brief."},
                                                                {"role": "user", "content": "Hello"}],
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1].response
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    whole = client.responses.create(model="tiny", input=[{"role": "developer", "content": "Be brief."},
                                                         {"role": "user", "content": "Hello"}],
                                    max_output_tokens=8, temperature=0)
    assert whole.output_text == text and whole.usage.input_tokens == final.usage.input_tokens


def test_forced_tool_call_then_its_result(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice=FORCED,
                                    reasoning=NO_THINKING, max_output_tokens=120, temperature=1.0,
                                    extra_body={"seed": 0})
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": [{"type": "input_text", "text": "sunny, 21C"}]}])
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == first.id


def test_streamed_tool_call_is_a_function_call_item(client):
    events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice=FORCED,
                                          reasoning=NO_THINKING, max_output_tokens=120, temperature=1.0,
                                          extra_body={"seed": 0}, stream=True))
    assert events[-1].type == "response.completed"
    assert not [e for e in events if e.type == "response.output_text.delta"]
    added = next(e.item for e in events if e.type == "response.output_item.added")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response.output[0]
    assert added.id == done.item_id == final.id and added.call_id == final.call_id
    assert arguments == done.arguments == final.arguments
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_previous_response_id_equals_sending_the_history(client):
    first = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=5, temperature=0,
                                    store=True)
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input="Go on",
                                      max_output_tokens=5, temperature=0)
    history = [{"role": "user", "content": "Tell me a story"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "Go on"}]
    sent = client.responses.create(model="tiny", input=history, max_output_tokens=5, temperature=0, store=False)
    assert chained.usage.input_tokens == sent.usage.input_tokens
    assert chained.output_text == sent.output_text


def test_get_and_delete_a_stored_response(client, live):
    response = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="y", previous_response_id=unstored.id)


def test_structured_output(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = client.responses.create(model="tiny", input="A digit as JSON", max_output_tokens=40, temperature=1.0,
                                       text={"format": {"type": "json_schema", "name": "digit", "schema": schema}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_reasoning_items_stream_and_usage(client):
    kwargs = dict(model="tiny", input="Think first", max_output_tokens=40, temperature=1.0,
                  reasoning={"effort": "xhigh", "summary": "auto"}, include=["reasoning.encrypted_content"],
                  extra_body={"structured_outputs": {"regex": THINK_THEN_ANSWER}})
    events = list(client.responses.create(stream=True, **kwargs))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    reasoning = final.output[0]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text and streamed.isalpha()
    assert reasoning.summary[0].text == streamed and reasoning.encrypted_content
    assert "response.reasoning_summary_text.delta" in [e.type for e in events]
    assert 0 < final.usage.output_tokens_details.reasoning_tokens < final.usage.output_tokens
    # the reasoning item sent back (store false, as Codex does) renders as the assistant turn's reasoning
    follow = client.responses.create(model="tiny", store=False, max_output_tokens=2, input=[
        {"role": "user", "content": "Think first"}, reasoning.model_dump(exclude_none=True),
        final.output[1].model_dump(exclude_none=True), {"role": "user", "content": "again"}])
    assert follow.usage.input_tokens > 0


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "mystery_item"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "nope"}]}, "tools[0].parameters"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "absent"},
      "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(live, body, param):
    status, reply = post_json(live.url + "/v1/responses", {"model": "tiny", **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param


def test_invalid_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}})


def test_context_overflow_is_context_length_exceeded(client):
    long_input = "word " * 600
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input=long_input)
    assert raised.value.code == "context_length_exceeded"
    events = list(client.responses.create(model="tiny", input=long_input, stream=True))
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert events[-1].response.error.code == "context_length_exceeded"


def test_unprefixed_route_and_disconnect_frees_everything(live):
    body = {"model": "tiny", "input": "Count", "max_output_tokens": 200, "stream": True}
    with post_stream(live.url + "/responses", body) as reply:
        assert reply.status == 200
        for line in reply:
            if b"output_text.delta" in line:
                break
    live.wait_idle()


def test_openai_agents_sdk_runs_a_tool_loop(live):
    agents = pytest.importorskip("agents")
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    def forecaster() -> agents.Agent:
        """An agent whose model has a client of its own: an async client keeps to the event loop it first ran on."""
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key="unused", max_retries=0))
        settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=120, reasoning=Reasoning(effort="none"))
        # the tool's result is the answer: a random model's free text would run into max_tokens (status incomplete)
        return agents.Agent(name="forecaster", instructions="Answer with the weather.", model=model,
                            tools=[get_weather], model_settings=settings, tool_use_behavior="stop_on_first_tool")

    agent = forecaster()
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0] in ("Paris", "Oslo")
    assert result.final_output == f"sunny in {seen[0]}"

    async def streamed() -> list[str]:
        run = agents.Runner.run_streamed(forecaster(), "Weather in Oslo?", max_turns=3)
        return [event.type async for event in run.stream_events()]

    kinds = asyncio.run(streamed())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds and len(seen) >= 2


def test_metrics_are_labelled_by_api(client, live):
    client.responses.create(model="tiny", input="x", max_output_tokens=1)
    text = live.metrics_text()
    assert metric_value(text, 'conveyor_api_requests_total{api="responses"') >= 1
