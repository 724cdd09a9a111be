"""Turning a client's prompt (text, token ids or chat messages) into token ids.

Shared by the intake stage and the engine's /tokenize facade, so both see the same template
rendering and the same errors.
"""
from __future__ import annotations

from typing import Any

from pipeline.chat_template import render_chat_template
from pipeline.errors import InvalidRequest
from pipeline.tokenizer import Tokenizer
from pipeline.tool_turns import inline_tool_turns, template_knows_tools


class PromptRenderer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size

    def render_messages(self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any]) -> str:
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; send a plain prompt", "messages")
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        kwargs = dict(chat_template_kwargs)
        kwargs.setdefault("add_generation_prompt", True)
        if not template_knows_tools(self.chat_template) and (kwargs.get("tools") or any(
                m.get("role") == "tool" or m.get("tool_calls") for m in messages)):
            messages = inline_tool_turns(messages, kwargs.pop("tools", None))
        try:
            return render_chat_template(self.chat_template, messages, bos_token=self.tokenizer.bos_token or "",
                                        eos_token=self.tokenizer.eos_token or "", **kwargs)
        except (ValueError, TypeError) as exc:  # TemplateError is a ValueError
            raise InvalidRequest(f"chat template error: {exc}", "messages") from exc

    def token_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Exactly one prompt form -> token ids (the chat template supplies its own special tokens)."""
        forms = sum(x is not None for x in (prompt, prompt_token_ids, messages))
        if forms != 1:
            raise InvalidRequest("give exactly one of prompt, prompt token ids or messages")
        if messages is not None:
            text = self.render_messages(messages, chat_template_kwargs or {})
            return self.tokenizer.encode(text, add_special_tokens=False)
        if prompt is not None:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt_token_ids or [])
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")
        return ids
