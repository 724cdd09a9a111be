"""The engine's tokenizer: a `tokenizers.Tokenizer` plus what the model's files say around it.

HF directories provide tokenizer.json and tokenizer_config.json; GGUF files provide metadata from
which `pipeline.tokenizer_gguf` rebuilds the same fast tokenizer. Either way BOS is added only when
the model's own configuration asks for it, the way transformers decides it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

from pipeline.models.gguf_file import is_gguf_path, open_gguf
from pipeline.tokenizer_gguf import bos_eos_post_processor, build_gguf_tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(slots=True)
class Tokenizer:
    """Encode/decode plus the special tokens and chat template a model ships with."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    special_token_ids: frozenset[int]

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load from an HF model directory or a .gguf file."""
        if is_gguf_path(path):
            return cls.from_gguf(path)
        return cls.from_hf_dir(path)

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        parts = build_gguf_tokenizer(open_gguf(path))
        return cls._assemble(parts.backend, parts.bos_token_id, parts.eos_token_id, parts.chat_template)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        tokenizer_json = os.path.join(path, TOKENIZER_JSON)
        if not os.path.isfile(tokenizer_json):
            raise FileNotFoundError(f"{path!r} has no {TOKENIZER_JSON}.")
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        config = _read_json_or_empty(os.path.join(path, TOKENIZER_CONFIG))
        model_config = _read_json_or_empty(os.path.join(path, "config.json"))
        _register_config_specials(backend, config)

        bos_id = _special_id(backend, config.get("bos_token"), model_config.get("bos_token_id"))
        eos_id = _special_id(backend, config.get("eos_token"), model_config.get("eos_token_id"))
        if backend.post_processor is None:
            # tokenizer.json's post-processor decides BOS/EOS when it has one (transformers 5 ignores the
            # tokenizer_config flags then); without one, the flags are the only word on it.
            def framing(flag: str, token_id: int | None) -> tuple[str, int] | None:
                if not config.get(flag) or token_id is None:
                    return None
                return backend.id_to_token(token_id), token_id

            backend.post_processor = bos_eos_post_processor(
                framing("add_bos_token", bos_id), framing("add_eos_token", eos_id)
            )
        return cls._assemble(backend, bos_id, eos_id, _hf_chat_template(path, config))

    @classmethod
    def _assemble(
        cls, backend: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None, chat_template: str | None
    ) -> Tokenizer:
        specials = {token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
        specials.update(token_id for token_id in (bos_id, eos_id) if token_id is not None)
        return cls(
            backend=backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=chat_template,
            special_token_ids=frozenset(specials),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text such as `<|im_start|>` maps to its single id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Size including added tokens, i.e. one past the largest id the tokenizer can emit."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str:
        """BOS text for chat templates ("" when the model has none)."""
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_id)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""


def _read_json_or_empty(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _token_content(value: Any) -> str | None:
    """tokenizer_config spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_id(backend: tokenizers.Tokenizer, configured: Any, fallback_id: Any) -> int | None:
    content = _token_content(configured)
    if content is not None:
        token_id = backend.token_to_id(content)
        if token_id is not None:
            return token_id
    if isinstance(fallback_id, list):  # config.json may list several EOS ids; the first is canonical
        fallback_id = fallback_id[0] if fallback_id else None
    return fallback_id if isinstance(fallback_id, int) else None


def _register_config_specials(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Make sure tokens that tokenizer_config marks special are special added tokens of the backend."""
    known = backend.get_added_tokens_decoder()
    missing: list[tokenizers.AddedToken] = []
    for token_id, spec in (config.get("added_tokens_decoder") or {}).items():
        if not spec.get("special") or int(token_id) in known:
            continue
        if backend.token_to_id(spec["content"]) != int(token_id):
            continue  # registering it would assign a new id; the tokenizer.json is authoritative
        missing.append(
            tokenizers.AddedToken(
                spec["content"],
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", False),
                special=True,
            )
        )
    if missing:
        backend.add_special_tokens(missing)


def _hf_chat_template(path: str, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5 layout) wins over the tokenizer_config entry."""
    template_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as handle:
            return handle.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template
