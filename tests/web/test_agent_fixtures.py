"""The exact bodies Codex and Claude Code send (tests/web/fixtures/), served whole: every streamed event must validate
against the official SDKs' event types, the stream must end the way each client requires, and each client's second
turn must find its first turn's prefix in the cache. codex_*_turn.json and claude_code_*_turn.json are written from
the clients' public request shapes; codex_0.171_*.json and claude_code_2.1.197_*.json are what Codex CLI 0.171.0
and Claude Code 2.1.197 sent to this server (a first turn, then the turn carrying the tool's result), paths
neutralized, served the way docs/agents.md serves Qwen3.5: its chat template, qwen3_coder tool calls under the
grammar, qwen3 reasoning."""
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
QWEN3_5_TEMPLATE = Path(__file__).parents[2] / "pipeline" / "templates" / "qwen3_5.jinja"
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


# ---- the bodies the real clients sent --------------------------------------------------------------------------

REAL_MAX_MODEL_LEN = 24576  # Claude Code's first turn is about 20.4k tokens in this tokenizer, Codex's 6.6k


@pytest.fixture(scope="module")
def live_qwen3_coder(make_model_dir):
    """The default grammar limits (--max-grammar-seconds 10): Claude Code's 24 tools compiled in 9-16 s on two
    cores before long maxLength bounds were left out of the qwen_xml grammar, and its first turn was refused."""
    model_dir = make_model_dir(max_position_embeddings=REAL_MAX_MODEL_LEN)
    settings = ServerSettings(served_model_names=["SmolLM2-135M-Instruct", "claude-*"],
                              tool_call_parser="qwen3_coder", reasoning_parser="qwen3")
    with LiveServer(model_dir, settings, chat_template=str(QWEN3_5_TEMPLATE), max_model_len=REAL_MAX_MODEL_LEN,
                    block_size=16, num_kv_blocks=2048, max_num_batched_tokens=2048) as server:
        yield server


def real_fixture(name: str, **limit: int) -> dict:
    return {**fixture(name), **limit}  # the random model would otherwise write to the context's end


def test_codex_0_171_turns_stream_and_share_the_cached_prefix(live_qwen3_coder):
    turns = []
    for name in ("codex_0.171_first_turn.json", "codex_0.171_tool_turn.json"):
        body = real_fixture(name, max_output_tokens=8)
        assert body["tools"][0]["name"] == "exec_command" and body["include"] == ["reasoning.encrypted_content"]
        events = sse_events(live_qwen3_coder.url + "/v1/responses", body)
        parsed = [RESPONSES_EVENT.validate_python(data) for _, data in events]
        assert all(name == data["type"] for name, data in events)
        assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
        assert parsed[-1].type in ("response.completed", "response.incomplete"), parsed[-1]
        turns.append(parsed[-1].response)
    first, second = turns
    # the second turn carries the first's reasoning item (encrypted_content), function_call and its output
    assert first.usage.input_tokens > 6000
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 6000


def test_claude_code_2_1_197_turns_stream_and_share_the_cached_prefix(live_qwen3_coder):
    turns = []
    for name in ("claude_code_2.1.197_first_turn.json", "claude_code_2.1.197_tool_turn.json"):
        body = real_fixture(name, max_tokens=8)
        # what this release sends beside the older shapes: adaptive thinking, context_management, output_config,
        # system-role messages, 24 tools (SendMessage's and Workflow's long maxLength strings among them)
        assert body["thinking"] == {"type": "adaptive"} and "context_management" in body and "output_config" in body
        assert len(body["tools"]) == 24 and any(m["role"] == "system" for m in body["messages"])
        events = [MESSAGES_EVENT.validate_python(data)
                  for name, data in sse_events(live_qwen3_coder.url + "/v1/messages", body) if name != "ping"]
        assert events[0].type == "message_start" and events[-1].type == "message_stop", events[:2]
        assert events[-2].type == "message_delta" and events[-2].delta.stop_reason in ("end_turn", "max_tokens",
                                                                                     "tool_use")
        assert events[0].message.model == "claude-opus-4-8"
        turns.append(events[0].message.usage)
    first, second = turns
    assert first.input_tokens > 20000
    assert second.cache_read_input_tokens > 20000 and second.input_tokens > 0
