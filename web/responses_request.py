"""POST /v1/responses bodies -> the chat request every face runs (web/protocol_requests.ChatRequest).

The body is translated into a chat completions body and parsed by the same parser, so sampling, grammar and tool
rules are the chat handler's. `instructions` is the first system prompt; with `previous_response_id` the stored
conversation (that response's input and output items) comes before this request's input, as if the client had
sent it. Only function tools reach the model: every other tool type (custom/freeform, namespace, web_search, ...)
is accepted and ignored. `reasoning.effort` "none" turns thinking off; any other value leaves the model's default.
`max_output_tokens` is a ceiling, ended at the context's end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from web.agent_messages import fold_leading_system
from web.protocol_errors import bad_request
from web.protocol_fields import read_bool, read_int, read_list, read_object, read_str, show
from web.protocol_requests import ChatRequest, parse_chat_request
from web.responses_input import input_items, items_to_messages

# Extensions passed through to the chat parser as they are (vLLM-style sampling fields).
PASSTHROUGH_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "logit_bias", "stop", "stop_token_ids", "repetition_detection",
                      "thinking_token_budget", "max_thinking_tokens", "cache_salt", "structured_outputs")
UNSUPPORTED = {"background": "background responses are not supported",
               "conversation": "conversations are not supported; send previous_response_id or the whole input"}


@dataclass(slots=True)
class ResponsesRequest:
    chat: ChatRequest
    items: list[dict]  # the conversation's items: the previous response's, then this request's input
    store: bool
    previous_response_id: str | None
    echo: dict = field(default_factory=dict)  # the request fields a response object repeats
    summary: bool = False  # reasoning.summary asked: reasoning items carry their text as a summary too
    encrypted_reasoning: bool = False  # include has "reasoning.encrypted_content"


def parse_responses_request(body: object, history: list[dict] | None = None) -> ResponsesRequest:
    """`history`: the items of the response `previous_response_id` names (looked up by the caller)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {show(body)}")
    for name, reason in UNSUPPORTED.items():
        if body.get(name):
            raise bad_request(reason, name)
    if body.get("input") is None:
        raise bad_request("input is required", "input")
    items = [*(history or []), *input_items(body["input"])]
    instructions = read_str(body, "instructions")
    messages = items_to_messages(items)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise bad_request("input must not be empty", "input")
    tools = function_tools(read_list(body, "tools"))
    max_output_tokens = read_int(body, "max_output_tokens", minimum=1)
    reasoning = read_object(body, "reasoning") or {}
    chat_body: dict = {
        "model": read_str(body, "model"),
        "messages": fold_leading_system(messages),
        "stream": bool(read_bool(body, "stream")),
        "max_tokens": max_output_tokens,
        "parallel_tool_calls": read_bool(body, "parallel_tool_calls"),
        **{key: body[key] for key in PASSTHROUGH_FIELDS if key in body},
    }
    if tools:
        chat_body["tools"] = tools
        chat_body["tool_choice"] = tool_choice(body.get("tool_choice"))
    response_format = text_format(read_object(body, "text"))
    if response_format is not None:
        chat_body["response_format"] = response_format
    kwargs = dict(read_object(body, "chat_template_kwargs") or {})
    if reasoning.get("effort") == "none":
        kwargs["enable_thinking"] = False
    if kwargs:
        chat_body["chat_template_kwargs"] = kwargs
    chat = parse_chat_request(chat_body)
    chat.params.max_tokens_clamped = True
    include = read_list(body, "include") or []
    store = read_bool(body, "store")
    return ResponsesRequest(
        chat=chat, items=items, store=True if store is None else store,
        previous_response_id=read_str(body, "previous_response_id"),
        echo={"instructions": instructions, "tools": body.get("tools") or [],
              "tool_choice": body.get("tool_choice") or "auto",
              "parallel_tool_calls": chat.parallel_tool_calls, "temperature": body.get("temperature"),
              "top_p": body.get("top_p"), "max_output_tokens": max_output_tokens,
              "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
              "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
              "truncation": body.get("truncation") or "disabled", "user": body.get("user"),
              "prompt_cache_key": body.get("prompt_cache_key"), "store": True if store is None else store},
        summary=reasoning.get("summary") not in (None, "none"),
        encrypted_reasoning="reasoning.encrypted_content" in include,
    )


def function_tools(raw: list | None) -> list[dict] | None:
    """The function tools in chat's shape; tools of any other type are for hosted features and are ignored."""
    out = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object, got {show(tool)}", f"tools[{i}]")
        if tool.get("type") != "function":
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be a non-empty string, got {show(name)}", f"tools[{i}].name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object, got {show(parameters)}",
                              f"tools[{i}].parameters")
        function = {"name": name, "description": tool.get("description") or "",
                    "parameters": parameters or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out or None


def tool_choice(raw: object) -> object:
    """"auto" / "none" / "required" / {"type": "function", "name"}; a choice of a hosted tool is "auto"."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not isinstance(name, str):
            raise bad_request(f"tool_choice.name must be a string, got {show(name)}", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        return "required" if raw.get("mode") == "required" else "auto"
    if isinstance(raw, dict):
        return "auto"
    raise bad_request(f"tool_choice must be a string or an object, got {show(raw)}", "tool_choice")


def text_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format (json_schema's fields sit one level up in Responses)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"text.format must be an object, got {show(fmt)}", "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(f"text.format.schema must be a JSON schema object, got {show(schema)}",
                              "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": schema}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {show(kind)}",
                      "text.format.type")
