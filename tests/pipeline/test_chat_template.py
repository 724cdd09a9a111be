"""Chat templates render byte for byte like transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from pipeline.chat_template import TemplateError, compile_chat_template, render_chat_template

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    [
        SYSTEM,
        {"role": "user", "content": "Write Rust: a::b"},
        {"role": "assistant", "content": "fn main() {\n    a::b();\n}\n"},
        {"role": "user", "content": "  and emoji 😀, 中文, trailing spaces  "},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "third\n\nwith blank lines"},
        {"role": "assistant", "content": "fourth"},
    ],
    [{"role": "user", "content": ""}],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — \"quoted\" <b>&</b> ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "enum": [1, 2, 3]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]

# Exercises tojson with every option, loop controls, namespace, raise_exception, bos/eos and kwargs.
CUSTOM_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{{ tool.function | tojson(indent=2, sort_keys=true) }}
{{ tool.function.name | tojson(separators=(',', ':')) }}|{{ tool.function | tojson(ensure_ascii=true) }}
{% endfor %}
</tools>
{% endif %}
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
{%- if message.role == 'skip' %}{% continue %}{% endif %}
{%- if message.role == 'stop' %}{% break %}{% endif %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- set ns.count = ns.count + 1 %}
<{{ message.role }}>{{ message.content }}{# one rendered line, split at this comment
#}{% if message.reasoning_content is defined %}[think:{{ message.reasoning_content }}]{% endif %}{#
#}</{{ message.role }}>{{ eos_token }}
{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{%- endfor %}
count={{ ns.count }} flag={{ custom_flag | default('none') }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}"""

CUSTOM_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "b", "reasoning_content": "because", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "stop", "content": "ends here"},
        {"role": "user", "content": "never rendered"},
    ],
    [{"role": "user", "content": "x", "tool_calls": None}, {"role": "assistant", "content": "y", "thinking": "t"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_smollm_template_matches_transformers(
    hf_gguf_tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    template = hf_gguf_tokenizer.chat_template
    expected = hf_gguf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = render_chat_template(
        template, conversation, add_generation_prompt=add_generation_prompt,
        bos_token=hf_gguf_tokenizer.bos_token, eos_token=hf_gguf_tokenizer.eos_token,
    )
    assert ours == expected


@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("conversation", CUSTOM_CONVERSATIONS, ids=range(len(CUSTOM_CONVERSATIONS)))
def test_custom_template_matches_transformers(
    hf_gguf_tokenizer: Any, conversation: list[dict[str, Any]], with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    expected = hf_gguf_tokenizer.apply_chat_template(
        conversation, chat_template=CUSTOM_TEMPLATE, tools=tools, tokenize=False,
        add_generation_prompt=True, custom_flag="on",
    )
    ours = render_chat_template(
        CUSTOM_TEMPLATE, conversation, tools=tools, custom_flag="on",
        bos_token=hf_gguf_tokenizer.bos_token, eos_token=hf_gguf_tokenizer.eos_token,
    )
    assert ours == expected
    if with_tools:
        assert '"description": "Weather for a city — \\"quoted\\" <b>&</b> ünïcode"' in ours


def test_continue_final_message_matches_transformers(hf_gguf_tokenizer: Any) -> None:
    for content in ("The answer is", "Trailing space ", "multi\nline"):
        conversation = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
        expected = hf_gguf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        ours = render_chat_template(hf_gguf_tokenizer.chat_template, conversation, continue_final_message=True)
        assert ours == expected
        assert ours.endswith(content)  # the template keeps spacing, so the text is cut right after it
    # A template that trims content also trims the marker's space: the cut must trim too.
    trimming = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial answer  "}]
    expected = hf_gguf_tokenizer.apply_chat_template(
        conversation, chat_template=trimming, tokenize=False, continue_final_message=True
    )
    assert render_chat_template(trimming, conversation, continue_final_message=True) == expected
    assert expected.endswith("<assistant>partial answer")


def test_raise_exception_raises_template_error() -> None:
    with pytest.raises(TemplateError, match="Unknown role: wizard"):
        render_chat_template(CUSTOM_TEMPLATE, [{"role": "wizard", "content": "x"}])
    assert issubclass(TemplateError, ValueError)


def test_template_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(TemplateError):  # the sandbox refuses attribute escapes
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])
    with pytest.raises(TemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
    with pytest.raises(TemplateError):  # immutable sandbox: no mutating inputs
        render_chat_template("{{ messages.append(1) }}", [])
    with pytest.raises(TemplateError, match="never reads"):
        render_chat_template("{{ 'static' }}", [{"role": "user", "content": "x"}], continue_final_message=True)


def test_compiled_templates_are_cached() -> None:
    source = "{{ messages | length }}"
    assert compile_chat_template(source) is compile_chat_template(source)


def test_inputs_become_plain_data_and_are_not_mutated() -> None:
    @dataclass
    class Part:
        text: str

    messages = [{"role": "user", "content": "hi", "extra": np.int64(3), "part": Part("p"), "obj": object(),
                 "flag": np.bool_(False), "nothing": None}]
    template = ("{{ messages[0].extra + 1 }}|{{ messages[0].part.text }}|{{ messages[0].obj }}|"
                "{{ 'yes' if messages[0].flag else 'no' }}|{{ messages[0].nothing is defined }}")
    assert render_chat_template(template, messages) == "4|p|<object>|no|False"
    assert messages[0]["nothing"] is None and isinstance(messages[0]["part"], Part)


def test_strftime_now_dict_and_generation_block() -> None:
    rendered = render_chat_template(
        "{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['k']) | tojson }}|"
        "{% generation %}kept{% endgeneration %}",
        [],
    )
    year, as_dict, from_keys, generation = rendered.split("|")
    assert year.isdigit() and len(year) == 4
    assert (as_dict, from_keys, generation) == ('{"a": 1}', '{"k": null}', "kept")


THINKING_TEMPLATE = (
    "{%- if documents %}{{ '<|im_start|>system\\nSources:\\n' }}"
    "{%- for doc in documents %}{{ '[' ~ loop.index ~ '] ' ~ doc.title ~ ': ' ~ doc.text ~ '\\n' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
DOCUMENTS = [{"title": "Rivers", "text": "Rivers flow downhill."}, {"title": "Seas", "text": "Seas are salty."}]


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["no-docs", "docs"])
def test_thinking_switch_and_documents_match_transformers(
    hf_gguf_tokenizer: Any, enable_thinking: bool | None, documents: list[dict[str, str]] | None
) -> None:
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    conversation = [{"role": "user", "content": "Summarize."}]
    expected = hf_gguf_tokenizer.apply_chat_template(
        conversation, chat_template=THINKING_TEMPLATE, documents=documents, tokenize=False,
        add_generation_prompt=True, **kwargs,
    )
    ours = render_chat_template(THINKING_TEMPLATE, conversation, documents=documents, **kwargs)
    assert ours == expected
    assert ("<think>" in ours) == (enable_thinking is False)
