"""Streaming tool-call parsers: every chunking of an output gives the same content, calls and argument fragments."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from web.tool_call_parsers import TOOL_CALL_PARSERS, default_tool_call_parser, make_tool_call_parser
from web.tool_calls import ToolCallDelta, partial_tag_len
from web.tool_calls_hermes import HermesToolCallParser, JsonScanner
from web.tool_calls_qwen3_coder import Qwen3CoderToolCallParser, coerce_value
from tests.web.chunking import chunkings as shared_chunkings

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=")


def function(name: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    function("get_weather", city={"type": "string"}, days={"type": "integer"}),
    function("run", code={"type": "string"}, count={"type": "integer"}, ratio={"type": "number"},
             whole={"type": "number"}, flag={"type": "boolean"}, opts={"type": "object"}, items={"type": "array"},
             nothing={"type": "null"}, maybe={"type": ["integer", "null"]}, bad_obj={"type": "object"},
             bad_int={"type": "integer"}, label={"type": "string"}),
    function("list_files"),
]


chunkings = shared_chunkings


def check_deltas(deltas: list[ToolCallDelta], calls: list) -> None:
    """Indices 0, 1, ... in order; id + name on each call's first delta only; fragments add up to the arguments."""
    fragments: list[list[str]] = []
    for delta in deltas:
        if delta.index == len(fragments):  # a new call
            assert delta.id is not None and CALL_ID.fullmatch(delta.id), delta
            assert delta.name, delta
            assert (delta.id, delta.name) == (calls[delta.index].id, calls[delta.index].name)
            fragments.append([])
        else:
            assert delta.index == len(fragments) - 1, deltas
            assert delta.id is None and delta.name is None, delta
        fragments[-1].append(delta.arguments)
    assert len(fragments) == len(calls)
    for parts, call in zip(fragments, calls, strict=True):
        assert "".join(parts) == call.arguments
    assert len({call.id for call in calls}) == len(calls)


def parse(parser: str, chunks: list[str], tools: list[dict] | None = TOOLS) -> tuple[str, list, list[str]]:
    p = make_tool_call_parser(parser, tools)
    pieces: list[str] = []
    deltas: list[ToolCallDelta] = []
    for out in [*(p.feed(chunk) for chunk in chunks), p.finish()]:
        pieces.append(out.content)
        deltas.extend(out.tool_calls)
    check_deltas(deltas, p.calls)
    return "".join(pieces), [(call.name, call.arguments) for call in p.calls], pieces


def check(parser: str, text: str, content: str, calls: list[tuple[str, str]], markup_free: bool = True) -> None:
    for chunks in chunkings(text):
        got_content, got_calls, pieces = parse(parser, chunks)
        assert (got_content, got_calls) == (content, calls), chunks
        if markup_free:
            assert not any(tag in piece for piece in pieces for tag in MARKUP), (chunks, pieces)


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# ---- hermes: well-formed -------------------------------------------------------------------------------------------

PLAIN = "No tools: a < b, <tool, <tool_calls> and </tool_call>  \n"
TRICKY_ARGS = (r'{"path": "a \"b\" {c} [d].txt", "text": "ends </tool_call> then <tool_call> and <function=x>", '
               r'"uni": "héllo 🌍 \u00e9 \ud83c\udf0d", "nl": "line1\nline2\t", "back": "\\", "slash": "a\/b", '
               r'"nested": {"a": [1, -2.5e-3, 0, 1E+2, {"b": null}], "c": true, "d": false, "e": {}, "f": []}}')


@pytest.mark.parametrize(("text", "content", "calls"), [
    (hermes_call("get_weather", '{"city": "Paris"}'), "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me check both.\n" + hermes_call("get_weather", '{"city": "Paris", "days": 3}') + "\n"
     + hermes_call("get_time", '{"tz": "Europe/Paris"}') + "\nOne moment.",
     "Let me check both.\n\nOne moment.",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    (hermes_call("write_file", TRICKY_ARGS), "", [("write_file", TRICKY_ARGS)]),
    ('<tool_call>{"arguments": {"q": "x}"}, "name": "search"}</tool_call>', "", [("search", '{"q": "x}"}')]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, \\"é\\"]}"}\n</tool_call>', "",
     [("f", '{"a": [1, "é"]}')]),
    ('<tool_call>{"name": "ping"}</tool_call>\n\n', "", [("ping", "{}")]),
    ('<tool_call>{"id": 1, "name":"f" ,"arguments":  { "a" : [ 1 ,2 ] }  , "x": [{}]}</tool_call>', "",
     [("f", '{ "a" : [ 1 ,2 ] }')]),
    ('<tool_call>{"name": "f", "arguments": {"code": "a\nb\tc"}}</tool_call>', "", [("f", '{"code": "a\\nb\\tc"}')]),
    (PLAIN, PLAIN, []),
])
def test_hermes_every_chunking(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check("hermes", text, content, calls, markup_free=text != PLAIN)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


def test_hermes_streams_arguments_as_they_arrive() -> None:
    p = HermesToolCallParser(TOOLS)
    assert p.feed("Sure <tool").content == "Sure "
    out = p.feed('_call>\n{"name": "get_weather"')
    assert out.content == "" and [(d.index, d.name, d.arguments) for d in out.tool_calls] == [(0, "get_weather", "")]
    assert [d.arguments for d in p.feed(', "arguments": {"city": "Pa').tool_calls] == ['{"city": "Pa']
    assert [d.arguments for d in p.feed('ris"}}').tool_calls] == ['ris"}']
    assert p.calls[0].arguments == '{"city": "Paris"}'
    assert p.feed("\n</tool_call>").tool_calls == [] and p.finish().content == ""


# ---- hermes: broken calls ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    'Hi <tool_call>\n{"name": "get_wea',  # truncated before the name is known
    'x <tool_call>\nnot json\n</tool_call> y',  # not JSON
    '<tool_call>["get_weather"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name: breaks at the final "}"
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>{"name": "  ", "arguments": {}}</tool_call>',  # empty name
    '<tool_call>{"arguments": {"a": 1}, "arguments": {}, "name": "f"}</tool_call>',  # arguments twice
    '<tool_call>{"name" "f"}</tool_call>',  # missing colon
    '<tool_call>',
])
def test_hermes_unannounced_broken_call_is_content(text: str) -> None:
    check("hermes", text, text, [], markup_free=False)


@pytest.mark.parametrize(("text", "content", "calls"), [
    # announced, then cut off: kept, with the argument text streamed so far (or "{}")
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    ('<tool_call>\n{"name": "get_weather", "argu', "", [("get_weather", "{}")]),
    ('<tool_call>{"arguments": "{\\"a\\"', "", []),  # name never known: content (checked below)
    # announced, then invalid: closed as it stands; plain text resumes at the offending character
    ('<tool_call>{"name": "f", "arguments": {"a": 1 2}}</tool_call> after', "2}}</tool_call> after",
     [("f", '{"a": 1 ')]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "[1]}</tool_call>", [("f", "{}")]),
    ('<tool_call>{"name": "f", "name": "g"}</tool_call>', '"g"}</tool_call>', [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', '"}</tool_call>', [("f", "{}")]),
    # complete body: a missing, partial or wrong closing tag does not matter
    ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}}\n</tool_c', "", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}}\noops', "\noops", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g"}</tool_call>', "", [("f", "{}"), ("g", "{}")]),
    # whitespace before a call that then breaks is kept with its text
    ('<tool_call>{"name": "f"}</tool_call>\n<tool_call>oops', "\n<tool_call>oops", [("f", "{}")]),
    ('<tool_call><tool_call>{"name": "f"}</tool_call>', "<tool_call>", [("f", "{}")]),
])
def test_hermes_broken_call_policy(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check("hermes", text, content if calls else text, calls, markup_free=False)


# ---- qwen3_coder ---------------------------------------------------------------------------------------------------

def qwen_call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(a, b):\n    return a < b and "<tag>" != \'</p>\' and "</tool_call>" and "<parameter=x>"\n'
RUN_TEXT = qwen_call("run", code=CODE, count="42", ratio="0.25", whole="3", flag="True",
                     opts='{"deep": {"x": [1, 2]}, "s": "é"}', items='["a", "b"]', nothing="null", maybe="NULL",
                     bad_obj="{not json", bad_int="4.5", label="007", unknown_num="7", unknown_text="hello world",
                     unknown_json='{"k": [true]}')
RUN_ARGS = {"code": CODE.strip(), "count": 42, "ratio": 0.25, "whole": 3, "flag": True,
            "opts": {"deep": {"x": [1, 2]}, "s": "é"}, "items": ["a", "b"], "nothing": None, "maybe": None,
            "bad_obj": "{not json", "bad_int": 4.5, "label": "007",
            "unknown_num": 7, "unknown_text": "hello world", "unknown_json": {"k": [True]}}


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(("text", "content", "calls"), [
    (qwen_call("get_weather", city="Paris"), "", [("get_weather", '{"city": "Paris"}')]),
    (RUN_TEXT, "", [("run", dumps(RUN_ARGS))]),
    ("I'll look.\n" + qwen_call("get_weather", city="New\nYork", days="2") + "\n\n" + qwen_call("list_files")
     + "\nDone <b>.", "I'll look.\n\nDone <b>.",
     [("get_weather", dumps({"city": "New\nYork", "days": 2})), ("list_files", "{}")]),
    ("<tool_call>\n<function=f>\n<parameter=a>1</parameter><parameter=a>\n2\n</parameter>\n</function>", "",
     [("f", '{"a": 1}')]),  # no newlines around the value; a repeated parameter keeps its first value
])
def test_qwen3_coder_every_chunking(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check("qwen3_coder", text, content, calls)


def test_qwen3_coder_values_lose_only_their_surrounding_whitespace() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\n  two  words \n\n</parameter>\n</function>\n</tool_call>"
    check("qwen3_coder", text, "", [("f", '{"a": "two  words"}')])


def test_qwen3_coder_sends_each_parameter_when_it_closes() -> None:
    p = Qwen3CoderToolCallParser(TOOLS)
    out = p.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(d.index, d.name, d.arguments) for d in out.tool_calls] == [(0, "get_weather", "")]
    assert [d.arguments for d in p.feed("is\n</parameter>\n<parameter=days>\n").tool_calls] == ['{"city": "Paris"']
    assert [d.arguments for d in p.feed("3\n</parameter>\n</function>").tool_calls] == [', "days": 3}']
    assert p.calls[0].arguments == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("text", [
    "Hi <tool_call>\n<function=get_wea",
    "<tool_call>\nhello\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=a\nb>\n</function>",
    "<tool_call>\n<parameter=a>\n1\n</parameter>",
])
def test_qwen3_coder_unannounced_broken_call_is_content(text: str) -> None:
    check("qwen3_coder", text, text, [], markup_free=False)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2",
     "", [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=list_files>\n", "", [("list_files", "{}")]),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray\n</function>\n</tool_call>",
     "stray\n</function>\n</tool_call>", [("f", '{"a": 1}')]),
    ("<tool_call>\n<function=f>\n</function>\nafter", "\nafter", [("f", "{}")]),
])
def test_qwen3_coder_broken_call_policy(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check("qwen3_coder", text, content, calls, markup_free=False)


@pytest.mark.parametrize(("raw", "schema", "value"), [
    ("text", {"type": "string"}, "text"), (" 12 ", {"type": "string"}, " 12 "),
    ("-7", {"type": "integer"}, -7), ("x", {"type": "integer"}, "x"), ("2.0", {"type": "integer"}, 2.0),
    ("1.5e3", {"type": "number"}, 1500.0), ("10", {"type": "number"}, 10), ("nan", {"type": "number"}, "nan"),
    ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("[1,", {"type": "array"}, "[1,"),
    ("null", {"type": "null"}, None), ("null", {"type": ["string", "null"]}, None),
    ("5", {"type": ["string", "integer"]}, 5), ("abc", {"type": ["integer", "string"]}, "abc"),
    ("3", None, 3), ("NaN", None, "NaN"), ("[NaN]", None, "[NaN]"), ("1e999", None, "1e999"), ("Paris", {}, "Paris"),
    ('"q"', {"type": "weird"}, "q"),
])
def test_coerce_value(raw: str, schema: object, value: object) -> None:
    got = coerce_value(raw, schema)
    assert got == value and type(got) is type(value)


# ---- shared --------------------------------------------------------------------------------------------------------

def test_registry_and_defaults() -> None:
    assert TOOL_CALL_PARSERS == {"hermes": HermesToolCallParser, "qwen3_coder": Qwen3CoderToolCallParser}
    with pytest.raises(ValueError, match="hermes, qwen3_coder"):
        make_tool_call_parser("mistral", None)
    assert default_tool_call_parser(None) == "hermes"
    assert default_tool_call_parser("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") == "hermes"
    assert default_tool_call_parser("<function=example>\n<parameter=example_parameter_1>") == "qwen3_coder"


@pytest.mark.parametrize("first", ["web.tool_calls", "web.tool_calls_hermes", "web.tool_calls_qwen3_coder"])
def test_any_import_order_registers_both(first: str) -> None:
    code = f"import {first}; from web.tool_call_parsers import TOOL_CALL_PARSERS as P; print(sorted(P))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['hermes', 'qwen3_coder']"


def test_partial_tag_len() -> None:
    texts = ("a<", "<tool_call", "<tool_call>", "x", "<<t")
    assert [partial_tag_len(text, "<tool_call>") for text in texts] == [1, 10, 0, 0, 2]


@pytest.mark.parametrize(("text", "valid"), [
    ('{"a": [1, -0.5e+2, true, null, "x\\u00e9\\n"], "b": {}}', True), ("[]", True), ('"s"', True),
    ("{,}", False), ("[1,]", False), ('{"a" 1}', False), ("01", False), ("1.", False), ("-", False),
    ('"\\x"', False), ('"\\u12g4"', False), ("tru", False), ("truth", False), ("{} {}", False), ("[1}", False),
    ("NaN", False), ('{"a": 1,}', False),
])
def test_json_scanner_agrees_with_json_loads(text: str, valid: bool) -> None:
    scanner = JsonScanner()
    ok = all(scanner.push(ch) for ch in text + " ")
    complete = ok and scanner.expect == "done"
    assert complete == valid
    if valid:
        json.loads(text)
