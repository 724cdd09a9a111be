"""The built-in Qwen3.5 chat template (pipeline/templates/qwen3_5.jinja): the Qwen3.5 prompt format, byte for byte."""
from __future__ import annotations

from typing import Any

import pytest

from pipeline.chat_template import TemplateError, render_chat_template
from pipeline.templates import builtin_chat_template
from web.protocol_messages import normalize_messages

TEMPLATE = builtin_chat_template("qwen3_5.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city — ünïcode <b>&</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
TOOLS_HEADER = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — ünïcode <b>&</b>", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}\n</tools>\n\n'
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
PARIS_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
PARIS_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return render_chat_template(TEMPLATE, messages, **kwargs)


def test_plain_chat_opens_a_thinking_block_by_default() -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert render(messages) == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                "<|im_start|>assistant\n<think>\n")
    assert render(messages, enable_thinking=True) == render(messages)


def test_thinking_off_closes_an_empty_block() -> None:
    rendered = render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_no_generation_prompt() -> None:
    rendered = render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_are_listed_as_json_in_the_system_turn() -> None:
    rendered = render([{"role": "system", "content": "  Be terse.  "}, {"role": "user", "content": "Hi"}], tools=TOOLS)
    assert rendered == (TOOLS_HEADER + "\n\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n")
    alone = render([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert alone.startswith(TOOLS_HEADER + "<|im_end|>\n<|im_start|>user\nHi")


def test_tool_calls_and_results_multi_turn() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            PARIS_CALL,
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
        {"role": "user", "content": "Thanks"},
    ]
    assert render(messages, tools=TOOLS) == TOOLS_HEADER + (
        "<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n\n" + PARIS_XML + "\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis is sunny, Rome rainy.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_a_call_without_content_starts_the_turn() -> None:
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]}, {"role": "user", "content": "ok"}]
    assert "<|im_start|>assistant\n" + PARIS_XML + "<|im_end|>\n" in render(messages)


def test_argument_values_strings_raw_everything_else_json() -> None:
    call = {"function": {"name": "f", "arguments": {"s": "two\nlines", "n": 1.5, "b": True, "z": None,
                                                       "o": {"k": ["ü", 1]}, "a": [1, 2]}}}
    rendered = render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "user", "content": "y"}])
    assert ("<function=f>\n<parameter=s>\ntwo\nlines\n</parameter>\n<parameter=n>\n1.5\n</parameter>\n"
            "<parameter=b>\ntrue\n</parameter>\n<parameter=z>\nnull\n</parameter>\n"
            '<parameter=o>\n{"k": ["ü", 1]}\n</parameter>\n<parameter=a>\n[1, 2]\n</parameter>\n'
            "</function>") in rendered


def test_json_string_arguments_render_as_parameters_through_the_server_protocol() -> None:
    """The server turns OpenAI's JSON-string arguments into objects before rendering (web/protocol_messages.py)."""
    raw = [{"role": "user", "content": "Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    as_dicts = [raw[0], {**raw[1], "tool_calls": [PARIS_CALL]}, raw[2]]
    assert render(normalize_messages(raw)) == render(as_dicts)


def test_unparsable_string_arguments_are_kept_verbatim() -> None:
    call = {"function": {"name": "f", "arguments": ' {"cut off '}}
    rendered = render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "user", "content": "y"}])
    assert '<tool_call>\n<function=f>\n{"cut off\n</function>\n</tool_call>' in rendered


def test_reasoning_is_kept_after_the_last_user_query_and_dropped_before() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "", "reasoning_content": "\nneed weather\n", "tool_calls": [PARIS_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "\nSunny.", "reasoning_content": "easy"},
    ]
    rendered = render(messages, add_generation_prompt=False)
    assert "old thoughts" not in rendered
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in rendered
    assert "<|im_start|>assistant\n<think>\nneed weather\n</think>\n\n" + PARIS_XML + "<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\neasy\n</think>\n\nSunny.<|im_end|>\n")


def test_turns_after_the_last_query_always_get_a_block_and_inline_think_is_split() -> None:
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\nAnswer"},
                {"role": "tool", "content": "r"}, {"role": "assistant", "content": "More"}]
    rendered = render(messages, add_generation_prompt=False)
    assert rendered == ("<|im_start|>user\nQ<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\ninline thoughts\n</think>\n\nAnswer<|im_end|>\n"
                        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n\n</think>\n\nMore<|im_end|>\n")


def test_reasoning_aliases_are_read() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "via alias"}]
    assert "<think>\nvia alias\n</think>\n\nA" in render(messages, add_generation_prompt=False)


def test_text_parts_and_later_system_turns() -> None:
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "system", "content": "Later."}]
    assert render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>system\nLater.<|im_end|>\n")


def test_unknown_role_is_an_error() -> None:
    with pytest.raises(TemplateError, match="Unexpected message role"):
        render([{"role": "narrator", "content": "x"}])


def test_continue_final_message() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}]
    assert render(messages, continue_final_message=True) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is")


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_matches_transformers(hf_gguf_tokenizer: Any, enable_thinking: bool | None) -> None:
    """transformers renders the same text from this template (it is plain transformers-dialect jinja)."""
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [PARIS_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    expected = hf_gguf_tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tools=TOOLS, tokenize=False,
                                                     add_generation_prompt=True, **kwargs)
    assert render(messages, tools=TOOLS, **kwargs) == expected
