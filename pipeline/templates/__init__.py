"""Chat templates shipped with Conveyor, for checkpoints that come without one (see pipeline/model_family.py)."""
from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def builtin_chat_template(name: str) -> str:
    """The text of a packaged template such as "qwen3_5.jinja" (read once; it is package data)."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
