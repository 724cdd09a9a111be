"""The exact bodies Codex and Claude Code send (tests/web/fixtures/, written from their public request shapes), served
whole: every streamed event must validate against the official SDKs' event types, the stream must end the way
each client requires, and Claude Code's second turn must find its first turn's prefix in the cache."""
from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent

from tests.web.agent_http import sse_events
from tests.web.server_utils import LiveServer
from web.app import ServerSettings

FIXTURES = Path(__file__).parent / "fixtures"
RESPONSES_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
MESSAGES_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
MAX_MODEL_LEN = 768  # the bodies fit; the answers (no max_output_tokens from Codex) run to the context's end


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny", "gpt-5.1-codex", "claude-*"], tool_call_parser="hermes",
                              reasoning_parser="qwen3")
    with LiveServer(tiny_model_dir, settings, max_model_len=MAX_MODEL_LEN) as server:
        yield server


@pytest.mark.parametrize("name", ["codex_first_turn.json", "codex_tool_turn.json"])
def test_codex_bodies_stream_to_a_terminal_event(live, name):
    events = sse_events(live.url + "/v1/responses", fixture(name))
    parsed = [RESPONSES_EVENT.validate_python(data) for _, data in events]
    assert all(name == data["type"] for name, data in events)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = parsed[-1]
    assert final.type in ("response.completed", "response.incomplete"), final
    done = [e.item.id for e in parsed if e.type == "response.output_item.done"]
    assert done == [item.id for item in final.response.output]
    usage = final.response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.input_tokens + usage.output_tokens <= MAX_MODEL_LEN


def test_claude_code_turns_stream_and_share_the_cached_prefix(live):
    first, second = (
        [MESSAGES_EVENT.validate_python(data) for name, data in sse_events(live.url + "/v1/messages", fixture(body))
         if name != "ping"]  # keep-alive events are not in the SDK's union: its stream reader skips them
        for body in ("claude_code_first_turn.json", "claude_code_tool_turn.json"))
    for events in (first, second):
        assert events[0].type == "message_start" and events[-1].type == "message_stop"
        assert events[-2].type == "message_delta" and events[-2].delta.stop_reason in ("end_turn", "max_tokens",
                                                                                     "tool_use")
        assert events[0].message.model == "claude-sonnet-4-5-20250929"
    start = second[0].message.usage
    # the system prompt and tools render the same in both turns although the attribution line differs
    assert start.cache_read_input_tokens > 100 and start.input_tokens > 0
