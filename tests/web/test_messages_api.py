"""The Anthropic Messages API through the live server with the official anthropic client (typed stream events).

The tiny model is random: grammars make its tool calls and thinking blocks deterministic in shape."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.web.agent_http import post_json, post_stream, sse_events
from tests.web.server_utils import LiveServer
from web.app import ServerSettings

KEY = "sekret"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]
NO_THINKING = {"type": "disabled"}  # else the reasoning parser lets a forced call wait for a </think>
HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"temperature": 0}  # sampling fields go in the body: this SDK's typed create has none


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny", "claude-*"], tool_call_parser="hermes",
                              reasoning_parser="qwen3", api_key=KEY)
    with LiveServer(tiny_model_dir, settings, max_model_len=512) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0)


def test_create_with_system_blocks_and_a_claude_name(client):
    message = client.messages.create(model="claude-sonnet-4-5", max_tokens=6, messages=HELLO, extra_body=GREEDY,
                                     system=[{"type": "text", "text": "Be brief.",
                                              "cache_control": {"type": "ephemeral"}}],
                                     metadata={"user_id": "u1"})
    assert message.id.startswith("msg_") and message.model == "claude-sonnet-4-5" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text"
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0


def test_max_tokens_past_the_context_is_a_ceiling(live):
    status, message = post_json(live.url + "/v1/messages", {
        "model": "tiny", "max_tokens": 32000, "messages": HELLO, "thinking": NO_THINKING,
        "structured_outputs": {"regex": "[a-z]{3,8}"}}, {"x-api-key": KEY})
    assert status == 200 and message["stop_reason"] == "end_turn"
    status, message = post_json(live.url + "/v1/messages", {"model": "tiny", "max_tokens": 32000, "messages": HELLO,
                                                            "temperature": 0}, {"x-api-key": KEY})
    assert status == 200 and message["stop_reason"] == "max_tokens"
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] \
        + message["usage"]["output_tokens"] == 512


def test_stream_events_reassemble_to_the_message(client):
    kwargs = dict(model="tiny", max_tokens=8, messages=HELLO, extra_body=GREEDY)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "text" in kinds and "message_delta" in kinds
    whole = client.messages.create(**kwargs)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


def test_stop_sequences(client):
    message = client.messages.create(model="tiny", max_tokens=20, messages=HELLO, stop_sequences=["b"],
                                     thinking=NO_THINKING, extra_body={"structured_outputs": {"regex": "aab[a-z]+"}})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "b"
    assert message.content[0].text == "aa"


def test_forced_tool_use_then_its_result(client):
    first = client.messages.create(model="tiny", max_tokens=120, tools=TOOLS, thinking=NO_THINKING,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert first.stop_reason == "tool_use"
    use = [block for block in first.content if block.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER)
    follow = client.messages.create(model="tiny", max_tokens=4, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "is_error": False,
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    assert follow.stop_reason == "max_tokens"


def test_streamed_tool_use_has_input_json_deltas(client):
    with client.messages.stream(model="tiny", max_tokens=120, tools=TOOLS, thinking=NO_THINKING,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas and set(deltas) == {"input_json_delta"}
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, WEATHER)


def test_thinking_blocks_with_a_signature(client):
    kwargs = dict(model="tiny", max_tokens=40, messages=HELLO,
                  thinking={"type": "enabled", "budget_tokens": 30},
                  extra_body={"structured_outputs": {"regex": r"<think>[a-z]{3,12}</think>[a-z]{2,10}"}})
    with client.messages.stream(**kwargs) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert deltas == {"thinking_delta", "signature_delta", "text_delta"}
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking.isalpha() and final.content[0].signature
    assert final.stop_reason == "end_turn"


def test_count_tokens_is_the_prompt_the_request_renders(client):
    body = dict(model="tiny", system="You are terse.", tools=TOOLS[:1],
                messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "system", "content": "Mind the tools."}, {"role": "user", "content": "Weather?"}])
    counted = client.messages.count_tokens(**body).input_tokens
    message = client.messages.create(max_tokens=1, **body)
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_same_conversation_renders_the_same_prompt_through_chat(client, live):
    messages = client.messages.create(model="tiny", max_tokens=1, system="Sys.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]}])
    status, chat = post_json(live.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Again"}]},
        {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    assert chat["usage"]["prompt_tokens"] == messages.usage.input_tokens + messages.usage.cache_read_input_tokens


def test_billing_header_does_not_defeat_the_prefix_cache(client):
    system = "You are a coding agent. " * 20

    def turn(attribution: str) -> anthropic.types.Message:
        return client.messages.create(model="tiny", max_tokens=1, messages=HELLO, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cch={attribution};"},
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])

    turn("a1b2c")
    second = turn("f9e8d")
    assert second.usage.cache_read_input_tokens > 100


def test_auth_takes_x_api_key_or_bearer(live):
    body = {"model": "tiny", "max_tokens": 1, "messages": HELLO}
    assert post_json(live.url + "/v1/messages", body, {"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                                       "anthropic-beta": "interleaved-thinking-2025-05-14"})[0] == 200
    assert post_json(live.url + "/v1/messages", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    status, error = post_json(live.url + "/v1/messages", body, {"x-api-key": "wrong"})
    assert status == 401 and error["type"] == "error" and error["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, words", [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "hologram"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"name": "f", "input_schema": "nope"}]}, "input_schema"),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "tool", "name": "f"},
      "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 7}}}}]}, ""),
])
def test_bad_input_is_an_anthropic_400(live, body, words):
    status, error = post_json(live.url + "/v1/messages", {"model": "tiny", **body}, {"x-api-key": KEY})
    assert status == 400, error
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


def test_unknown_model_and_context_overflow(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="gpt-9", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "word " * 600}])
    assert "prompt is too long" in raised.value.message


def test_disconnect_mid_stream_frees_everything(live):
    body = {"model": "tiny", "max_tokens": 200, "stream": True, "messages": HELLO}
    with post_stream(live.url + "/messages", body, {"x-api-key": KEY}) as reply:
        for line in reply:
            if b"text_delta" in line:
                break
    live.wait_idle()


def test_raw_stream_has_event_lines(live):
    events = sse_events(live.url + "/v1/messages", {"model": "tiny", "max_tokens": 3, "stream": True,
                                                   "messages": HELLO}, {"x-api-key": KEY})
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events[:3]] == ["message_start", "ping", "content_block_start"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 3
