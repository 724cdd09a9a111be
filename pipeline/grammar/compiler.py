"""Grammar compilation with xgrammar: tokenizer-aware, cached per spec, off the event loop.

Compiling a JSON schema takes milliseconds to seconds (the token masks of every grammar state
are precomputed), so it runs in a worker thread and its result is cached by GrammarSpec: an agent
that sends the same tools or schema every turn pays once. Concurrent requests for the same spec
share one compilation.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict

import xgrammar as xgr

from pipeline.grammar.spec import GrammarSpec
from pipeline.tokenizer import Tokenizer


class InvalidGrammar(ValueError):
    """The request's schema, regex or grammar cannot be compiled (a client error)."""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: token strings by id, padded to the model's vocab size."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        encoded[index] = token
    decoder = (json.loads(tokenizer.backend.to_str()).get("decoder") or {})
    decoders = [decoder] + list(decoder.get("decoders") or [])
    types = {d.get("type") for d in decoders if isinstance(d, dict)}
    if "ByteLevel" in types:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in types:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    add_prefix_space = any(d.get("type") == "Strip" and d.get("start") for d in decoders if isinstance(d, dict))
    return xgr.TokenizerInfo(encoded[:vocab_size], vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None, add_prefix_space=add_prefix_space)


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, asyncio.Future[xgr.CompiledGrammar]] = {}
        self.cache_size = cache_size
        self.compilations = 0

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    async def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            return cached
        pending = self._pending.get(spec)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self.compile_now, spec))
            self._pending[spec] = pending
            pending.add_done_callback(lambda _: self._pending.pop(spec, None))
        compiled = await asyncio.shield(pending)
        self._cache[spec] = compiled
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile on the calling thread (raises InvalidGrammar with a client-facing message)."""
        self.compilations += 1
        try:
            return self._compile(spec)
        except InvalidGrammar:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            raise InvalidGrammar(f"invalid {spec.kind.replace('_', ' ')}: {str(exc).strip()[:500]}") from exc

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not choices:
                raise InvalidGrammar("choice needs at least one option")
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in choices))
        return compiler.compile_structural_tag(spec.source)


def _ebnf_string(text: str) -> str:
    escaped = re.sub(r'[\\"]', lambda m: "\\" + m.group(0), text)
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'
