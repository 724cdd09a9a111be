"""Split a reasoning model's output into reasoning and content at its `<think>`...`</think>` tags.

The tags reach neither side, and a suffix that may still become the awaited tag is held back, so the result is the
same however the text is split into chunks. Text inside a block is reasoning, text outside is content, and a later
start tag opens a new block (a start tag inside a block is plain reasoning text, an end tag outside one plain
content). Stripped, exactly: one "\\n" right after a start tag (and at the very start of output that begins inside a
block), and up to two "\\n" right after an end tag; all other whitespace is kept. Output that ends inside a block was
all reasoning, a held partial end tag included; a held partial start tag at the end is content.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both write <think>...</think>
_TAGS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningSplitter:
    """Streams (reasoning delta, content delta) pairs; `in_reasoning` is the state after the text fed so far."""
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    in_reasoning: bool = False
    _held: str = field(default="", init=False, repr=False)  # a suffix that may still become the awaited tag
    _newlines: int = field(default=0, init=False, repr=False)  # "\n"s still to strip at the current position

    def __post_init__(self) -> None:
        self._newlines = 1 if self.in_reasoning else 0

    @classmethod
    def for_prompt(cls, parser: str, prompt_text: str) -> ReasoningSplitter:
        """A splitter for `parser`, starting inside a block when the prompt left one open (templates that open
        `<think>` for the model): its last start tag comes after its last end tag."""
        if parser not in _TAGS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of: {', '.join(REASONING_PARSERS)}")
        start, end = _TAGS[parser]
        return cls(start, end, in_reasoning=prompt_text.rfind(start) > prompt_text.rfind(end))

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next chunk of generated text; return (reasoning delta, content delta)."""
        reasoning: list[str] = []
        content: list[str] = []
        buf, self._held = self._held + text, ""
        while buf:
            if self._newlines:
                n = min(self._newlines, len(buf) - len(buf.lstrip("\n")))
                buf = buf[n:]
                self._newlines = 0 if buf else self._newlines - n
                if not buf:
                    break
            tag = self.end_tag if self.in_reasoning else self.start_tag
            out = reasoning if self.in_reasoning else content
            at = buf.find(tag)
            if at < 0:
                keep = len(buf) - _partial_tag_len(buf, tag)
                out.append(buf[:keep])
                self._held = buf[keep:]
                break
            out.append(buf[:at])
            buf = buf[at + len(tag):]
            self.in_reasoning = not self.in_reasoning
            self._newlines = 1 if self.in_reasoning else 2
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: flush the held suffix to the side it is on."""
        held, self._held, self._newlines = self._held, "", 0
        return (held, "") if self.in_reasoning else ("", held)
