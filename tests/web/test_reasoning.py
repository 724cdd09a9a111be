"""ReasoningSplitter: <think> blocks split out of the output the same way for every chunking."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from web.reasoning import REASONING_PARSERS, ReasoningSplitter
from tests.web.chunking import chunkings as shared_chunkings


PLAIN = "just an answer: a < b, <b>bold</b>, <thin and </think"


def chunkings(text: str) -> Iterator[list[str]]:
    return shared_chunkings(text, max_cuts=10)


def split(chunks: list[str], in_reasoning: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    pieces = [splitter.feed(chunk) for chunk in chunks]
    pieces.append(splitter.finish())
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces), pieces


def check(text: str, reasoning: str, content: str, in_reasoning: bool = False) -> None:
    for chunks in chunkings(text):
        got_reasoning, got_content, pieces = split(chunks, in_reasoning)
        assert (got_reasoning, got_content) == (reasoning, content), chunks
        for r, c in pieces:  # tags never leak, however the text is split
            assert not any(tag in part for part in (r, c) for tag in ("<think>", "</think>")), (chunks, pieces)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>\nplan\n</think>\n\nanswer", "plan\n", "answer"),
    ("<think>plan</think>answer", "plan", "answer"),
    ("<think>\n\nplan</think>\n\n\nanswer\n", "\nplan", "\nanswer\n"),  # one "\n" after <think>, two after </think>
    (PLAIN, "", PLAIN),
    ("<think>a</think>b <think>\nc</think>\nd", "ac", "b d"),
    ("<think>\nstill thinking, </thi", "still thinking, </thi", ""),  # truncated inside the block
    ("intro <think", "", "intro <think"),  # a partial start tag at the end is content
    ("<think></think>", "", ""),
])
def test_every_chunking(text: str, reasoning: str, content: str) -> None:
    check(text, reasoning, content)


def test_start_tag_inside_a_block_is_reasoning_text() -> None:
    for chunks in chunkings("<think>a <think> b</think>c"):
        assert split(chunks)[:2] == ("a <think> b", "c")


def test_starting_inside_a_block() -> None:
    check("\nplan\n</think>\n\nanswer", "plan\n", "answer", in_reasoning=True)
    check("plan only", "plan only", "", in_reasoning=True)


def test_partial_tags_are_held_then_released() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("Hi <th") == ("", "Hi ")
    assert splitter.feed("ink>\n") == ("", "") and splitter.in_reasoning
    assert splitter.feed("step 1</") == ("step 1", "")
    assert splitter.feed("b> more</thi") == ("</b> more", "")
    assert splitter.feed("nk>\n") == ("", "") and not splitter.in_reasoning
    assert splitter.feed("\nok") == ("", "ok")
    assert splitter.finish() == ("", "")


@pytest.mark.parametrize("parser", REASONING_PARSERS)
def test_for_prompt(parser: str) -> None:
    opened = ReasoningSplitter.for_prompt(parser, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert opened.in_reasoning and opened.feed("plan\n</think>\n\nanswer") == ("plan\n", "answer")
    earlier = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n"
    for prompt in ("<|im_start|>assistant\n", earlier, "<|im_start|>assistant\n<think>\n\n</think>\n\n"):
        splitter = ReasoningSplitter.for_prompt(parser, prompt)
        assert not splitter.in_reasoning and splitter.feed("answer") == ("", "answer")
    assert ReasoningSplitter.for_prompt(parser, earlier + "<think>").in_reasoning


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningSplitter.for_prompt("granite", "")


def test_custom_tags() -> None:
    splitter = ReasoningSplitter("[R]", "[/R]")
    assert splitter.feed("[R]\nx[/R]\ny") == ("x", "y")
