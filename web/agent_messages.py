"""Chat-message helpers the agent API faces share when they translate their conversations.

Agents send several system prompts (Codex: `instructions` and `developer` messages; Claude Code: `system` blocks and
`system`-role entries): the ones before the first turn become one leading system message, since many chat templates
accept a system message only first. A later one stays a system message where it is, so earlier turns keep their
rendering (and their cached prefix).
"""
from __future__ import annotations

SYSTEM_JOINER = "\n\n"


def fold_leading_system(messages: list[dict]) -> list[dict]:
    """The system messages before the first other message, joined into one; the rest unchanged."""
    head: list[str] = []
    rest = 0
    for message in messages:
        if message.get("role") != "system":
            break
        head.append(message.get("content") or "")
        rest += 1
    if rest <= 1:
        return messages
    return [{"role": "system", "content": SYSTEM_JOINER.join(t for t in head if t)}, *messages[rest:]]
