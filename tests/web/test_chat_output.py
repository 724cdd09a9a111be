"""A chat choice's text split into reasoning, content and tool calls, and the policy for tool-call
markup inside thinking: it is reasoning text, never a call, never content."""
import json
import random

from web.chat_output import ChatOutputParser, ChatPiece

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'


def parse(text: str, chunks: int, seed: int = 0, opens: bool = False) -> tuple[ChatPiece, list]:
    parser = ChatOutputParser("qwen3", "hermes", TOOLS)
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), chunks - 1)) if chunks > 1 else []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    total = ChatPiece()
    for piece in pieces:
        total.extend(parser.feed(piece, opens))
    total.extend(parser.finish())
    return total, parser.calls


def test_markup_inside_thinking_is_neither_executed_nor_leaked():
    text = f"<think>\nmaybe {CALL} later\n</think>\n\nThe answer."
    for chunks in (1, 2, 5, 17):
        for seed in range(3):
            piece, calls = parse(text, chunks, seed)
            assert calls == [] and piece.tool_calls == []
            assert CALL in piece.reasoning
            assert piece.content == "The answer." and "<tool_call>" not in piece.content


def test_a_call_after_thinking_is_a_call():
    piece, calls = parse(f"plan\n</think>\n\n{CALL}", 7, opens=True)  # the prompt opened the block
    assert piece.reasoning == "plan\n" and piece.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", {"cmd": "ls"})]
