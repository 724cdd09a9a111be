"""OpenAI request parsing: field mapping into SamplingParams, prompt forms, and every 400."""
from __future__ import annotations

import pytest

from pipeline.errors import AdmissionRefused, EngineDead, InvalidRequest, RequestFailed
from pipeline.grammar.spec import GrammarSpec
from pipeline.request import SamplingParams
from web.protocol import (COMPLETION_DEFAULT_MAX_TOKENS, APIError, api_error_from_exception, parse_chat_request,
                          parse_completion_request)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object):
    return parse_chat_request({"model": "m", "messages": USER, **fields})


def completion(**fields: object):
    return parse_completion_request({"model": "m", "prompt": "hi", **fields})


def bad(parse, body: object, param: str | None, *mentions: str) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    error = info.value
    assert error.status == 400
    assert error.param == param, error.message
    for text in mentions:
        assert text in error.message, error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error",
                                      "param": param, "code": None}}
    return error


def bad_chat(param: str | None, *mentions: str, **fields: object) -> APIError:
    return bad(parse_chat_request, {"messages": USER, **fields}, param, *mentions)


def bad_completion(param: str | None, *mentions: str, **fields: object) -> APIError:
    return bad(parse_completion_request, {"prompt": "hi", **fields}, param, *mentions)


# ---- field mapping --------------------------------------------------------------------------------

def test_chat_fields_map_into_sampling_params() -> None:
    request = chat(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                   frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={"12": -100, "7": 2.5}, seed=3,
                   stop=["x", "y"], stop_token_ids=[5], n=2, ignore_eos=True, min_tokens=2,
                   skip_special_tokens=False, include_stop_str_in_output=True, user="u1", stream=True,
                   stream_options={"include_usage": True}, logprobs=True, top_logprobs=3)
    assert request.params == SamplingParams(
        n=2, max_tokens=7, min_tokens=2, temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={12: -100.0, 7: 2.5}, seed=3, stop=["x", "y"],
        stop_token_ids=[5], ignore_eos=True, include_stop_str_in_output=True, logprobs=3, skip_special_tokens=False)
    assert (request.model, request.user, request.stream, request.include_usage) == ("m", "u1", True, True)
    assert (request.logprobs, request.top_logprobs) == (True, 3)
    assert request.messages == USER


def test_chat_defaults_are_neutral() -> None:
    request = parse_chat_request({"messages": USER})
    assert request.params == SamplingParams()
    assert request.model is None and request.stream is False and request.include_usage is False
    assert request.logprobs is False and request.top_logprobs == 0 and request.params.logprobs is None
    assert request.tools is None and request.tool_choice == "none"
    assert request.chat_template_kwargs == {"add_generation_prompt": True}


def test_nulls_read_as_unset_and_unknown_fields_are_ignored() -> None:
    request = chat(temperature=None, stop=None, n=None, seed=None, logit_bias=None, frobnicate={"x": 1},
                   metadata={"a": "b"}, parallel_tool_calls=True, service_tier="auto")
    assert request.params == SamplingParams()


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).params.max_tokens == 9
    assert chat(max_tokens=5, max_completion_tokens=None).params.max_tokens == 5
    assert chat(max_tokens=5.0).params.max_tokens == 5  # integral floats are integers (pydantic lax mode)


def test_stop_string_becomes_list_and_any_count_is_allowed() -> None:
    assert chat(stop="END").params.stop == ["END"]
    assert chat(stop=[str(i) for i in range(10)]).params.stop == [str(i) for i in range(10)]


def test_logprobs_true_without_top_logprobs_means_zero_alternatives() -> None:
    request = chat(logprobs=True)
    assert request.params.logprobs == 0 and request.top_logprobs == 0
    assert chat(logprobs=False).params.logprobs is None


def test_stream_options_only_count_when_streaming() -> None:
    assert chat(stream_options={"include_usage": True}).include_usage is False
    assert chat(stream=True).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False


def test_completion_fields_and_default_max_tokens() -> None:
    request = completion(logprobs=2, echo=False, temperature=0, stream=True, stream_options={"include_usage": True})
    assert request.prompt_text == "hi" and request.prompt_token_ids is None
    assert request.params.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS == 16
    assert request.logprobs == 2 and request.params.logprobs == 2 and request.params.temperature == 0.0
    assert request.stream and request.include_usage
    assert completion(max_tokens=None).params.max_tokens is None  # explicit null: up to the context length
    assert completion(max_tokens=100, echo=True).params.max_tokens == 100
    assert completion(echo=True).echo is True


def test_prompt_forms() -> None:
    assert completion(prompt=["one"]).prompt_text == "one"
    assert completion(prompt=[1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert completion(prompt=[[4, 5]]).prompt_token_ids == [4, 5]
    assert completion(prompt="").prompt_text == ""  # the engine decides whether an empty prompt is served


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_batched_prompts_are_refused(prompt: list) -> None:
    bad_completion("prompt", "batched prompts are not supported", prompt=prompt)


@pytest.mark.parametrize("prompt", [[], 5, {"text": "x"}, [1, "a"], [True, 2], [-1], [[]], [["a"]], [1.5]])
def test_malformed_prompts(prompt: object) -> None:
    bad_completion("prompt", "prompt", prompt=prompt)


def test_missing_prompt() -> None:
    bad(parse_completion_request, {"model": "m"}, "prompt", "prompt is required")


# ---- chat messages, tools, template kwargs --------------------------------------------------------

def test_text_parts_are_joined_with_newlines() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "user", "content": parts},
                             {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert [m["content"] for m in request.messages] == ["a\nb", "no"]


def test_messages_keep_other_keys_and_do_not_alias_the_body() -> None:
    message = {"role": "assistant", "content": None, "reasoning_content": "think",
               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    request = chat(messages=[*USER, message, tool])
    out = request.messages[1]
    assert out["content"] is None and out["reasoning_content"] == "think"
    assert out["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert out["tool_calls"][0]["id"] == "c1"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the client's body is untouched
    assert request.messages[2] == tool


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"s"'])
def test_non_object_tool_arguments_stay_strings(arguments: str) -> None:
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}
    assert chat(messages=[*USER, message]).messages[1]["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_all_roles_accepted(role: str) -> None:
    assert chat(messages=[{"role": role, "content": "x"}]).messages[0]["role"] == role


@pytest.mark.parametrize("messages, param, mention", [
    (None, "messages", "messages is required"),
    ([], "messages", "must not be empty"),
    ("hello", "messages", '"hello"'),
    (["hi"], "messages[0]", "must be an object"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", '"robot"'),
    ([{"content": "x"}], "messages[0].role", "null"),
    ([{"role": "user"}], "messages[0].content", "required"),
    ([{"role": "user", "content": None}], "messages[0].content", "required"),
    ([{"role": "user", "content": 5}], "messages[0].content", "5"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content", "list of content parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "messages[0].content[0]",
     '"image_url"'),
    ([{"role": "user", "content": ["plain"]}], "messages[0].content[0]", "null"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]", "3"),
    ([{"role": "user", "content": "x", "name": 7}], "messages[0].name", "7"),
    ([{"role": "assistant", "tool_calls": {"a": 1}}], "messages[0].tool_calls", "list"),
    ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0]", "function.name"),
])
def test_bad_messages(messages: object, param: str, mention: str) -> None:
    bad(parse_chat_request, {"messages": messages}, param, mention)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tools_pass_through_and_reach_the_template() -> None:
    request = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert request.tools == [TOOL] and request.tools[0] is TOOL
    assert request.chat_template_kwargs["tools"] == [TOOL]
    assert chat(tools=[TOOL]).tool_choice == "auto"
    assert chat(tools=[TOOL], tool_choice="required").tool_choice == "required"
    assert chat(tools=[]).tools is None and "tools" not in chat(tools=[]).chat_template_kwargs


@pytest.mark.parametrize("fields, param, mention", [
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "retrieval"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", '"x"'),
    ({"tool_choice": "always"}, "tool_choice", '"always"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice", '"other"'),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
])
def test_bad_tools(fields: dict, param: str, mention: str) -> None:
    bad_chat(param, mention, **fields)


def test_chat_template_kwargs_merge() -> None:
    docs = [{"title": "t", "text": "x"}]
    kwargs = chat(add_generation_prompt=False, documents=docs,
                  chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    assert kwargs == {"add_generation_prompt": False, "documents": docs, "enable_thinking": False}
    kwargs = chat(continue_final_message=True).chat_template_kwargs
    assert kwargs == {"add_generation_prompt": False, "continue_final_message": True}
    # the client's chat_template_kwargs win over top-level fields, as in vLLM
    assert chat(chat_template_kwargs={"add_generation_prompt": False}).chat_template_kwargs == {
        "add_generation_prompt": False}


@pytest.mark.parametrize("fields, param, mention", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "both"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "continue_final_message", "both"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
    ({"chat_template_kwargs": {"bos_token": "x", "eos_token": "y"}}, "chat_template_kwargs", "bos_token, eos_token"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", '["x"]'),
    ({"documents": ["doc"]}, "documents", "objects"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", '"yes"'),
])
def test_bad_template_options(fields: dict, param: str, mention: str) -> None:
    bad_chat(param, mention, **fields)


# ---- sampling validation --------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, mention", [
    ({"max_tokens": 0}, "max_tokens", "0"),
    ({"max_tokens": -3}, "max_tokens", "-3"),
    ({"max_tokens": 2.5}, "max_tokens", "2.5"),
    ({"max_tokens": "10"}, "max_tokens", '"10"'),
    ({"max_tokens": True}, "max_tokens", "true"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "0"),
    ({"max_tokens": 5, "max_completion_tokens": -1}, "max_completion_tokens", "-1"),
    ({"temperature": -0.1}, "temperature", "-0.1"),
    ({"temperature": "hot"}, "temperature", '"hot"'),
    ({"temperature": True}, "temperature", "true"),
    ({"top_p": 0}, "top_p", "0"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_k": -2}, "top_k", "-2"),
    ({"top_k": 1.5}, "top_k", "1.5"),
    ({"min_p": 2}, "min_p", "2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "0"),
    ({"presence_penalty": 3}, "presence_penalty", "3"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
    ({"n": 0}, "n", "0"),
    ({"n": "2"}, "n", '"2"'),
    ({"n": False}, "n", "false"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "5"),
    ({"seed": "x"}, "seed", '"x"'),
    ({"seed": 2**64}, "seed", str(2**64)),
    ({"stop": 5}, "stop", "5"),
    ({"stop": ["a", 1]}, "stop", '["a",1]'),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "-2"),
    ({"logit_bias": [1]}, "logit_bias", "[1]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", '"abc"'),
    ({"logit_bias": {"-5": 1}}, "logit_bias", '"-5"'),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", '"1.5"'),
    ({"logit_bias": {"5": 101}}, "logit_bias", "101"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", '"x"'),
    ({"logit_bias": {"5": True}}, "logit_bias", "true"),
    ({"ignore_eos": 1}, "ignore_eos", "1"),
    ({"skip_special_tokens": "false"}, "skip_special_tokens", '"false"'),
    ({"stream": "true"}, "stream", '"true"'),
    ({"stream": True, "stream_options": "x"}, "stream_options", '"x"'),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", '"yes"'),
    ({"user": 5}, "user", "5"),
    ({"model": 5}, "model", "5"),
    ({"response_format": {"type": "xml"}}, "response_format.type", '"xml"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema",
     "3"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "valid JSON"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_bad_sampling_fields(fields: dict, param: str, mention: str) -> None:
    bad_chat(param, mention, **fields)
    if not param.startswith("max_completion"):
        bad_completion(param, mention, **fields)


def test_response_format_text_is_accepted() -> None:
    assert chat(response_format={"type": "text"}).params == SamplingParams()


def test_grammar_requests_become_specs() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).params.grammar
    assert spec == GrammarSpec.json_schema(schema) and spec.kind == "json_schema"
    reordered = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "type": "object"}
    assert spec == GrammarSpec.json_schema(reordered)  # one cache entry for equal schemas
    assert chat(response_format={"type": "json_object"}).params.grammar == GrammarSpec("json_object")
    assert chat(structured_outputs={"choice": ["yes", "no"]}).params.grammar == GrammarSpec.choice(["yes", "no"])
    assert chat(structured_outputs={"regex": "[0-9]+"}).params.grammar == GrammarSpec("regex", "[0-9]+")
    assert chat(structured_outputs={"grammar": 'root ::= "x"'}).params.grammar.kind == "ebnf"
    assert chat(structured_outputs={"json": '{"type": "integer"}'}).params.grammar == GrammarSpec.json_schema(
        {"type": "integer"})


@pytest.mark.parametrize("fields, param, mention", [
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "-1"),
    ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs", '"5"'),
    ({"logprobs": 5}, "logprobs", "5"),
])
def test_bad_chat_logprobs(fields: dict, param: str, mention: str) -> None:
    bad_chat(param, mention, **fields)


@pytest.mark.parametrize("fields, param, mention", [
    ({"logprobs": 21}, "logprobs", "21"),
    ({"logprobs": -1}, "logprobs", "-1"),
    ({"logprobs": True}, "logprobs", "true"),
    ({"echo": True, "logprobs": 1}, "echo", "echo"),
    ({"echo": "yes"}, "echo", '"yes"'),
    ({"suffix": "x"}, "suffix", "suffix"),
    ({"best_of": 3}, "best_of", "best_of"),
])
def test_bad_completion_fields(fields: dict, param: str, mention: str) -> None:
    bad_completion(param, mention, **fields)


def test_best_of_equal_to_n_is_fine() -> None:
    assert completion(best_of=2, n=2).params.n == 2


@pytest.mark.parametrize("body", [None, [], "text", 5])
def test_body_must_be_an_object(body: object) -> None:
    bad(parse_chat_request, body, None, "JSON object")
    bad(parse_completion_request, body, None, "JSON object")


def test_long_values_are_shortened_in_messages() -> None:
    error = bad_chat("temperature", "...", temperature="x" * 500)
    assert len(error.message) < 200


# ---- engine exceptions -> API errors --------------------------------------------------------------

def test_api_error_from_exception() -> None:
    error = api_error_from_exception(InvalidRequest("prompt too long", "prompt"))
    assert (error.status, error.param, error.message, error.type) == (400, "prompt", "prompt too long",
                                                                      "invalid_request_error")
    error = api_error_from_exception(AdmissionRefused("queue full"))
    assert (error.status, error.type, error.message) == (503, "service_unavailable", "queue full")
    error = api_error_from_exception(EngineDead("engine is not running: RuntimeError('cuda oom at 0x7f')"))
    assert error.status == 503 and "0x7f" not in error.message
    error = api_error_from_exception(RequestFailed("request timed out after 30 s"))
    assert (error.status, error.type, error.message) == (500, "server_error", "request timed out after 30 s")
    error = api_error_from_exception(KeyError("secret internal detail"))
    assert (error.status, error.type) == (500, "server_error") and "secret" not in error.message
    original = APIError(404, "no such model", param="model")
    assert api_error_from_exception(original) is original
    assert original.body() == {"error": {"message": "no such model", "type": "invalid_request_error",
                                         "param": "model", "code": None}}
