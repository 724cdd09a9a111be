"""POST /v1/messages bodies (Anthropic Messages) -> the chat request every face runs.

The body is translated into a chat completions body and parsed by the same parser. `system` (a string or text
blocks) and `system`-role entries inside `messages` are system prompts; Claude Code's per-request attribution line
(`x-anthropic-billing-header: ...`) is dropped from them, since it changes every request and would end the cached
prefix at the very first token. Blocks: text, tool_use (assistant), tool_result (user; a string or text blocks;
`is_error`), thinking (assistant; becomes `reasoning_content`); images and documents are refused on the text-only
models served here, and any other block type is an error. A tool_result must answer an earlier tool_use.
`max_tokens` is required and is a ceiling: past the context left, the output ends there with "max_tokens".
`thinking` {"type": "enabled", "budget_tokens"} is the thinking budget; "disabled" turns thinking off.
"""
from __future__ import annotations

from dataclasses import dataclass

import orjson

from web.agent_messages import fold_leading_system
from web.protocol_errors import bad_request
from web.protocol_fields import read_bool, read_int, read_list, read_object, read_str, show
from web.protocol_requests import ChatRequest, parse_chat_request

BILLING_HEADER = "x-anthropic-billing-header:"
ROLES = ("user", "assistant", "system")
MEDIA_BLOCKS = ("image", "document")
IGNORED_BLOCKS = ("redacted_thinking",)  # opaque to this server: nothing to render
# Extensions passed through to the chat parser as they are (vLLM-style sampling and structured output).
PASSTHROUGH_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "structured_outputs")


@dataclass(slots=True)
class MessagesRequest:
    chat: ChatRequest
    model: str


def parse_messages_request(body: object, *, count_only: bool = False) -> MessagesRequest:
    """`count_only`: a count_tokens body, which has no max_tokens."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {show(body)}")
    model = read_str(body, "model")
    if not model:
        raise bad_request("model: Field required", "model")
    max_tokens = None
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens: Field required", "max_tokens")
        max_tokens = read_int(body, "max_tokens", minimum=1)
    read_object(body, "metadata")
    messages = [*system_messages(body.get("system")), *conversation(read_list(body, "messages"))]
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("messages: at least one message is required", "messages")
    chat_body: dict = {
        "model": model,
        "messages": fold_leading_system(messages),
        "max_tokens": max_tokens,
        "stream": bool(read_bool(body, "stream")),
        **{key: body[key] for key in PASSTHROUGH_FIELDS if key in body},
    }
    stops = read_list(body, "stop_sequences")
    if stops:
        chat_body["stop"] = stops
    tools = client_tools(read_list(body, "tools"))
    kwargs: dict = {}
    if tools:
        chat_body["tools"] = tools
        chat_body["tool_choice"], parallel = tool_choice(read_object(body, "tool_choice"))
        chat_body["parallel_tool_calls"] = parallel
    thinking = read_object(body, "thinking")
    if thinking is not None:
        kind = thinking.get("type")
        if kind == "enabled":
            chat_body["thinking_token_budget"] = read_int(thinking, "budget_tokens", minimum=0)
            kwargs["enable_thinking"] = True
        elif kind == "disabled":
            kwargs["enable_thinking"] = False
        elif kind != "adaptive":
            raise bad_request(f"thinking.type must be 'enabled', 'disabled' or 'adaptive', got {show(kind)}",
                              "thinking.type")
    output_format = read_object(body, "output_format")
    if output_format is not None:
        if output_format.get("type") != "json_schema" or not isinstance(output_format.get("schema"), dict):
            raise bad_request("output_format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_format")
        chat_body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                               "schema": output_format["schema"]}}
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        kwargs.update(add_generation_prompt=False, continue_final_message=True)  # a prefilled answer continues
    if kwargs:
        chat_body["chat_template_kwargs"] = kwargs
    chat = parse_chat_request(chat_body)
    chat.params.max_tokens_clamped = True
    return MessagesRequest(chat, model)


def _text_blocks(content: object, where: str) -> str:
    """A string, or text blocks joined as they stand (Anthropic's blocks are contiguous text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks, got {show(content)}", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in MEDIA_BLOCKS:
            raise bad_request(f"{where}.{j}: {kind} blocks are not supported: the served model reads text only",
                              f"{where}.{j}")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}.{j} must be a text block, got {show(block)}", f"{where}.{j}")
        texts.append(block["text"])
    return "".join(texts)


def _without_billing_header(text: str) -> str:
    if not text.startswith(BILLING_HEADER):
        return text
    _, _, rest = text.partition("\n")
    return rest.lstrip("\n")


def system_messages(system: object) -> list[dict]:
    """`system` as system messages: a string, or text blocks (the attribution block left out)."""
    if system is None:
        return []
    if isinstance(system, list):
        kept = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                          and b["text"].startswith(BILLING_HEADER))]
        text = _without_billing_header(_text_blocks(kept, "system"))
    else:
        text = _without_billing_header(_text_blocks(system, "system"))
    return [{"role": "system", "content": text}] if text else []


def conversation(raw: list | None) -> list[dict]:
    if not raw:
        raise bad_request("messages: at least one message is required", "messages")
    out: list[dict] = []
    tool_ids: set[str] = set()
    for i, message in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {show(role)}", f"{where}.role")
        role, content = message["role"], message.get("content")
        if role == "system":
            text = _without_billing_header(_text_blocks(content, f"{where}.content"))
            if text:
                out.append({"role": "system", "content": text})
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content", tool_ids))
        else:
            out.extend(_user(content, f"{where}.content", tool_ids))
    return out


def _assistant(content: object, where: str, tool_ids: set[str]) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks, got {show(content)}", where)
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_blocks([block], at))
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif kind == "tool_use":
            tool_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(tool_id, str) or not tool_id or not isinstance(name, str) or not name:
                raise bad_request(f"{at}: tool_use needs a string id and name, got {show(block)}", at)
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input must be an object, got {show(arguments)}", f"{at}.input")
            tool_ids.add(tool_id)
            calls.append({"id": tool_id, "type": "function",
                          "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}})
        elif kind not in IGNORED_BLOCKS:
            raise _unknown_block(kind, at, "text, thinking and tool_use")
    message: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: object, where: str, tool_ids: set[str]) -> list[dict]:
    """A user turn: its tool results as tool messages, its text as a user message, in the blocks' order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks, got {show(content)}", where)
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" or kind in MEDIA_BLOCKS:
            texts.append(_text_blocks([block], at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            tool_id = block.get("tool_use_id")
            if tool_id not in tool_ids:
                raise bad_request(f"{at}: tool_result for unknown tool_use_id {show(tool_id)}: each tool_result "
                                  "must answer a tool_use of an earlier assistant turn", f"{at}.tool_use_id")
            result = block.get("content", "")
            text = _text_blocks(result, f"{at}.content") if result is not None else ""
            if block.get("is_error") is True and not text.lower().startswith("error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        else:
            raise _unknown_block(kind, at, "text, image and tool_result")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _unknown_block(kind: object, where: str, known: str) -> Exception:
    return bad_request(f"{where}: unknown content block type {show(kind)} here (expected {known})", f"{where}.type")


def client_tools(raw: list | None) -> list[dict] | None:
    """Tools with an input_schema, in chat's shape; Anthropic's server tools (typed, no schema) are ignored."""
    out = []
    for i, tool in enumerate(raw or []):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object, got {show(tool)}", where)
        if tool.get("type") not in (None, "custom"):
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string, got {show(name)}", f"{where}.name")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema must be a JSON schema object, got {show(schema)}",
                              f"{where}.input_schema")
        out.append({"type": "function", "function": {"name": name, "description": tool.get("description") or "",
                                                     "parameters": schema}})
    return out or None


def tool_choice(raw: dict | None) -> tuple[object, bool]:
    """(chat's tool_choice, parallel_tool_calls) for {"type": auto | any | tool | none, ...}."""
    raw = raw or {"type": "auto"}
    parallel = not raw.get("disable_parallel_tool_use", False)
    kind = raw.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str):
            raise bad_request(f"tool_choice.name must be a string, got {show(name)}", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {show(kind)}", "tool_choice.type")
