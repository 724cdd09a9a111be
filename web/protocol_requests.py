"""OpenAI request bodies -> engine types (ChatRequest / CompletionRequest with SamplingParams).

Everything checkable without the model is checked here and answered with a 400 that names the
field; checks that need the model (context length, vocabulary range) happen at engine intake and
arrive as pipeline.errors.InvalidRequest. Unknown fields are ignored, as OpenAI-compatible
servers do, so clients that send newer or vendor-specific options keep working.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from pipeline.request import SamplingParams
from web.protocol_errors import APIError, bad_request
from web.protocol_fields import (read_bool, read_float, read_int, read_list, read_logit_bias, read_object,
                                 read_repetition_detection,
                                 read_seed, read_stop, read_str, read_token_ids,
                                 show)
from web.protocol_grammar import read_grammar
from web.protocol_messages import normalize_messages, validate_tool_choice, validate_tools

T = TypeVar("T")
MAX_LOGPROBS = 20
# OpenAI's documented default for /v1/completions (vLLM and SGLang follow it); an explicit
# `"max_tokens": null` means "up to the context length". Chat has no default.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Keys the intake passes to the template itself; a client setting them would collide.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "template", "bos_token", "eos_token"})


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] | None = None
    tool_choice: object = "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    user: str | None = None


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    user: str | None = None


def parse_chat_request(body: object) -> ChatRequest:
    body = _require_object(body)
    messages = normalize_messages(body.get("messages"))
    tools = validate_tools(body.get("tools"))
    tool_choice = validate_tool_choice(body.get("tool_choice"), tools)
    logprobs = bool(read_bool(body, "logprobs"))
    top_logprobs = read_int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _sampling_params(
        body, max_tokens_field, read_int(body, max_tokens_field),
        logprobs=(top_logprobs or 0) if logprobs else None,
        wire_names={"max_tokens": max_tokens_field, "logprobs": "top_logprobs"})
    stream = bool(read_bool(body, "stream"))
    return ChatRequest(
        model=read_str(body, "model"),
        messages=messages,
        params=params,
        stream=stream,
        include_usage=stream and _include_usage(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_or(read_bool(body, "parallel_tool_calls"), True),
        chat_template_kwargs=_chat_template_kwargs(body, tools),
        user=read_str(body, "user"),
    )


def parse_completion_request(body: object) -> CompletionRequest:
    body = _require_object(body)
    prompt_text, prompt_token_ids = _prompt(body)
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    echo = bool(read_bool(body, "echo"))
    logprobs = read_int(body, "logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    max_tokens = read_int(body, "max_tokens") if "max_tokens" in body else COMPLETION_DEFAULT_MAX_TOKENS
    params = _sampling_params(body, "max_tokens", max_tokens, logprobs=logprobs, wire_names={})
    best_of = read_int(body, "best_of")
    if best_of is not None and best_of != params.n:
        raise bad_request(f"best_of other than n is not supported (best_of={best_of}, n={params.n})", "best_of")
    stream = bool(read_bool(body, "stream"))
    return CompletionRequest(
        model=read_str(body, "model"),
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        params=params,
        stream=stream,
        include_usage=stream and _include_usage(body),
        echo=echo,
        logprobs=logprobs,
        user=read_str(body, "user"),
    )


def _require_object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {show(body)}")
    return body


def _include_usage(body: dict) -> bool:
    """stream_options.include_usage; stream_options without stream is ignored, not an error."""
    options = read_object(body, "stream_options") or {}
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(f"stream_options.include_usage must be a boolean, got {show(include)}",
                          "stream_options.include_usage")
    return bool(include)


def _sampling_params(body: dict, max_tokens_field: str, max_tokens: int | None, *, logprobs: int | None,
                     wire_names: dict[str, str]) -> SamplingParams:
    """The fields both endpoints share; SamplingParams.validate() does the range checks."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_field} must be at least 1, got {max_tokens}", max_tokens_field)
    params = SamplingParams(
        n=_or(read_int(body, "n"), 1),
        max_tokens=max_tokens,
        min_tokens=_or(read_int(body, "min_tokens"), 0),
        temperature=read_float(body, "temperature"),
        top_k=read_int(body, "top_k"),
        top_p=read_float(body, "top_p"),
        min_p=read_float(body, "min_p"),
        repetition_penalty=read_float(body, "repetition_penalty"),
        presence_penalty=_or(read_float(body, "presence_penalty"), 0.0),
        frequency_penalty=_or(read_float(body, "frequency_penalty"), 0.0),
        logit_bias=read_logit_bias(body),
        seed=read_seed(body),
        stop=read_stop(body),
        stop_token_ids=read_token_ids(body, "stop_token_ids"),
        ignore_eos=_or(read_bool(body, "ignore_eos"), False),
        include_stop_str_in_output=_or(read_bool(body, "include_stop_str_in_output"), False),
        logprobs=logprobs,
        skip_special_tokens=_or(read_bool(body, "skip_special_tokens"), True),
        repetition_detection=read_repetition_detection(body),
        grammar=read_grammar(body),
        thinking_token_budget=_thinking_budget(body),
        cache_salt=read_str(body, "cache_salt"),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise _validation_error(str(exc), wire_names) from exc
    return params


def _thinking_budget(body: dict) -> int | None:
    """`thinking_token_budget`, or its alias `max_thinking_tokens` (not both)."""
    budget = read_int(body, "thinking_token_budget", minimum=0)
    alias = read_int(body, "max_thinking_tokens", minimum=0)
    if budget is not None and alias is not None and budget != alias:
        raise bad_request("give thinking_token_budget or max_thinking_tokens, not both", "thinking_token_budget")
    return budget if budget is not None else alias


def _validation_error(message: str, wire_names: dict[str, str]) -> APIError:
    """SamplingParams messages start with the field name; report it under the name the client used."""
    name = message.split(" ", 1)[0]
    if name not in SamplingParams.__slots__:
        return bad_request(message)
    wire = wire_names.get(name, name)
    if wire != name:
        message = wire + message[len(name):]
    return bad_request(message, wire)


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """One prompt: a string, a one-string list, token ids, or a one-list list of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"prompt must be a string, a list of token ids, or a one-element list of either; "
                          f"got {show(prompt)}", "prompt")
    if all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt):
        if len(prompt) > 1:
            raise bad_request(f"batched prompts are not supported; send one prompt per request "
                              f"(got a list of {len(prompt)} prompts)", "prompt")
        if isinstance(prompt[0], str):
            return prompt[0], None
        prompt = prompt[0]
    return None, _token_ids(prompt)


def _token_ids(prompt: list) -> list[int]:
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise bad_request(f"a token-id prompt must be a non-empty list of non-negative integers, got {show(prompt)}",
                          "prompt")
    return list(prompt)


def _chat_template_kwargs(body: dict, tools: list[dict] | None) -> dict:
    """Top-level template options, then the client's chat_template_kwargs on top (as vLLM merges)."""
    kwargs: dict = {"add_generation_prompt": _or(read_bool(body, "add_generation_prompt"), True)}
    continue_final = read_bool(body, "continue_final_message")
    if continue_final:
        kwargs["continue_final_message"] = True
        if body.get("add_generation_prompt") is None:
            kwargs["add_generation_prompt"] = False  # continuing the last message implies no new turn
    if tools is not None:
        kwargs["tools"] = tools
    documents = read_list(body, "documents")
    if documents is not None:
        if not all(isinstance(document, dict) for document in documents):
            raise bad_request("documents must be a list of objects", "documents")
        kwargs["documents"] = documents
    extra = read_object(body, "chat_template_kwargs") or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    kwargs.update(extra)
    if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt"):
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true; "
                          "set add_generation_prompt to false to continue the final message", "continue_final_message")
    return kwargs
