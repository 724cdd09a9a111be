"""Chat-template rendering with transformers' semantics, without transformers.

Models are trained on prompts rendered by transformers' `apply_chat_template`, so every detail
that changes the rendered text matters: jinja2 whitespace options, the `tojson` filter (tool
schemas must serialize byte for byte the same), None-valued message keys dropped, reasoning
field aliases, and how `continue_final_message` cuts the text. Templates are untrusted input,
so they run in jinja2's immutable sandbox and only ever see plain JSON-like data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may arrive under; templates read the first one (gpt-oss reads "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """A chat template failed: raise_exception() from the template, a jinja error, or bad inputs."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (jinja's own filter HTML-escapes and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attribute names (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature trick
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders as-is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template source; the environment matches transformers' options."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _DictFactory()
    environment.globals["namespace"] = _SafeNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"chat template does not compile: {error}") from error


def plain_template_data(value: Any) -> Any:
    """A copy built only from JSON-like types; anything else becomes an inert "<TypeName>" string.

    Rich objects expose methods the sandbox cannot judge, and templates never need them.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(key): plain_template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain_template_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return plain_template_data(value.item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys and expose reasoning under every alias, as transformers does."""
    prepared: list[dict[str, Any]] = []
    for message in plain_template_data(list(messages)):
        if not isinstance(message, dict):
            raise TemplateError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _mark_final_message(template: str, messages: list[dict[str, Any]], field: str) -> str:
    """Append the continue marker to the final message's text; returns the text being continued."""
    if not messages:
        raise TemplateError("continue_final_message is set but the conversation is empty")
    final = messages[-1]
    text = final.get(field)
    if text is None:
        raise TemplateError(f'continue_final_message is set but the final message has no "{field}"')
    fields = [name for name in REASONING_FIELDS if final.get(name) == text] if field in REASONING_FIELDS else [field]
    if not any(name in template for name in fields):
        raise TemplateError(f'continue_final_message: the chat template never reads "{field}"')
    if isinstance(text, (list, tuple)):
        for block in reversed(text):
            if isinstance(block, dict) and "text" in block:
                continued = block["text"]
                block["text"] = continued + _CONTINUE_MARKER
                return continued
        raise TemplateError("continue_final_message: the final message has no text block to continue")
    for name in fields:
        final[name] = final[name] + _CONTINUE_MARKER
    return text


def _cut_after_final_message(rendered: str, continued: str) -> str:
    marker = _CONTINUE_MARKER.strip()
    if continued.strip() not in rendered or marker not in rendered:
        raise TemplateError("continue_final_message: the template altered the final message, cannot continue it")
    position = rendered.rindex(marker)
    if rendered[position : position + len(_CONTINUE_MARKER)] == _CONTINUE_MARKER:
        return rendered[:position]
    # The template trimmed trailing whitespace after the message, so trim ours too.
    return rendered[:position].rstrip()


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    continue_final_message: bool | str = False,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """Render a conversation exactly as transformers' `apply_chat_template(..., tokenize=False)`.

    `continue_final_message` (True, or the name of the field to continue) leaves the prompt open
    at the end of the final message's text and implies no generation prompt.
    """
    compiled = compile_chat_template(template)
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise TemplateError("tools must be JSON-schema dicts")
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise TemplateError("documents must be dicts with 'title' and 'text' keys")
    chat = _prepare_messages(messages)
    continued: str | None = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        continued = _mark_final_message(template, chat, field)
        add_generation_prompt = False
    context = plain_template_data({"bos_token": bos_token, "eos_token": eos_token, **kwargs})
    try:
        rendered = compiled.render(
            messages=chat,
            tools=plain_template_data(tools),
            documents=plain_template_data(documents),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as error:
        raise TemplateError(f"chat template failed: {error}") from error
    if continued is not None:
        rendered = _cut_after_final_message(rendered, continued)
    return rendered
