"""Grammar compilation with xgrammar: tokenizer-aware, cached per spec, bounded, off the event loop.

Compiling a JSON schema takes milliseconds to minutes (the token masks of every grammar state are precomputed, and an
object's optional properties cost more than linearly), so compilations run in a pool of daemon threads
(pipeline/grammar/pool.py) and their results are cached by GrammarSpec in a byte-bounded LRU
(pipeline/grammar/cache.py): an agent that sends the same tools or schema every turn pays once. Concurrent requests for
the same spec share one compilation.

Bounds (GrammarLimits, from the engine config): a source over max_bytes is refused before compiling, and a request
waits at most max_seconds for its grammar (queue and compile together). xgrammar's compile cannot be interrupted, so
one that runs past max_seconds keeps its thread until it ends: the pool's size bounds how many can, and such a spec is
remembered and refused at once from then on (while its late result, if it has one, is cached it is served).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from pipeline.grammar.cache import GrammarCache
from pipeline.grammar.pool import CompileJob, CompilePool
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


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    concurrency: int = 2  # compilations running at once (threads)
    max_bytes: int = 1 << 20  # a spec's source, in UTF-8 bytes
    max_seconds: float = 10.0  # how long a request waits for its grammar
    cache_bytes: int = 256 << 20
    remembered_timeouts: int = 4096  # fingerprints of specs that compiled past max_seconds


class GrammarTooLarge(InvalidGrammar):
    """The spec's source is over max_bytes."""


class GrammarTimedOut(InvalidGrammar):
    """The grammar was not compiled within max_seconds (or this spec did not compile within it before)."""


@dataclass(slots=True, eq=False)
class _Compiling:
    """One spec's compilation in flight and the requests waiting for it."""

    job: CompileJob
    done: asyncio.Future[Any]
    waiters: int = 0


def fingerprint(spec: GrammarSpec) -> bytes:
    return hashlib.blake2b(f"{spec.kind}\0{spec.source}".encode(), digest_size=16).digest()


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._xgr: xgr.GrammarCompiler | None = None  # built by the first compilation, on a pool thread
        self._info: xgr.TokenizerInfo | None = None
        self._build_lock = threading.Lock()
        self.cache = GrammarCache(self.limits.cache_bytes)
        self.pool = CompilePool(self.limits.concurrency)
        self._pending: dict[GrammarSpec, _Compiling] = {}
        self._timed_out: OrderedDict[bytes, None] = OrderedDict()
        self.compilations = 0
        self.timeouts = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def info(self) -> xgr.TokenizerInfo:
        self._compiler()
        assert self._info is not None
        return self._info

    def lookup(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The cached grammar, or None when it needs compiling. Raises InvalidGrammar for a spec refused outright:
        over max_bytes, or one whose compilation ran past max_seconds (before, or now, still running)."""
        compiled = self.cache.get(spec)
        if compiled is not None:
            return compiled
        limits = self.limits
        size = len(spec.source.encode())
        if size > limits.max_bytes:
            raise GrammarTooLarge(f"the {_what(spec)} is {size} bytes, over this server's limit of {limits.max_bytes} "
                                  f"bytes (--max-grammar-bytes)")
        compiling = self._pending.get(spec)
        if fingerprint(spec) in self._timed_out or (
                compiling is not None and compiling.job.running_for(time.monotonic()) > limits.max_seconds):
            raise GrammarTimedOut(f"compiling this {_what(spec)} took longer than {limits.max_seconds:g} s before; "
                                  f"it is not compiled again (--max-grammar-seconds)")
        return None

    async def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar: cached, shared with a compilation in flight, or compiled in the pool. Raises
        InvalidGrammar (GrammarTooLarge, GrammarTimedOut) with a client-facing message."""
        compiled = self.lookup(spec)
        if compiled is not None:
            return compiled
        compiling = self._pending.get(spec) or self._start(spec)
        compiling.waiters += 1
        waiting_since = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(compiling.done), self.limits.max_seconds)
        except TimeoutError:
            self.timeouts += 1
            raise GrammarTimedOut(self._timeout_message(compiling, time.monotonic() - waiting_since)) from None
        finally:
            compiling.waiters -= 1
            if compiling.waiters == 0 and compiling.job.future.cancel():  # not started: it never takes a thread
                if self._pending.get(spec) is compiling:
                    del self._pending[spec]

    def compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile on the calling thread (raises InvalidGrammar with a client-facing message)."""
        self.compilations += 1
        try:
            return self._compile(spec)
        except InvalidGrammar:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            raise InvalidGrammar(f"invalid {spec.kind.replace('_', ' ')}: {str(exc).strip()[:500]}") from exc

    def wedged(self, now: float, bound_s: float) -> str | None:
        """Why no grammar can be compiled now, if so: every thread is held by a compilation running past bound_s
        (its requests were told it timed out; xgrammar cannot stop it)."""
        held = [job.running_for(now) for job in self.pool.running()]
        if len(held) < self.pool.size or min(held) <= bound_s:
            return None
        return (f"all {self.pool.size} grammar compile threads are held by compilations running past {bound_s:g}s "
                f"(the longest for {max(held):.0f}s)")

    def stats(self) -> dict[str, Any]:
        cache = self.cache
        return {"compilations": self.compilations, "running": len(self.pool.running()), "queued": self.pool.queued,
                "timeouts": self.timeouts, "refused_specs": len(self._timed_out),
                "cache": {"entries": len(cache), "bytes": cache.bytes, "max_bytes": cache.max_bytes,
                          "evictions": cache.evictions}}

    def close(self) -> None:
        """Cancel compilations not started; running ones end on their own (their threads never block exit)."""
        self.pool.shutdown()

    # --- internals -----------------------------------------------------------------------------
    def _start(self, spec: GrammarSpec) -> _Compiling:
        loop = asyncio.get_running_loop()
        compiling = _Compiling(self.pool.submit(lambda: self.compile_now(spec)), loop.create_future())
        self._pending[spec] = compiling
        compiling.job.future.add_done_callback(lambda _: _call_soon(loop, self._finished, spec, compiling))
        return compiling

    def _finished(self, spec: GrammarSpec, compiling: _Compiling) -> None:
        """On the loop, when the job ended (or was cancelled before it started)."""
        if self._pending.get(spec) is compiling:
            del self._pending[spec]
        job, done = compiling.job, compiling.done
        if job.running_for(time.monotonic()) > self.limits.max_seconds:
            self._remember_timeout(spec)
        if job.future.cancelled():
            done.cancel()
            return
        error = job.future.exception()
        if error is not None:
            done.set_exception(error)
            done.exception()  # retrieved: every waiter may have stopped waiting
            return
        compiled = job.future.result()
        self.cache.put(spec, compiled, compiled.memory_size_bytes)
        done.set_result(compiled)

    def _remember_timeout(self, spec: GrammarSpec) -> None:
        key = fingerprint(spec)
        self._timed_out[key] = None
        self._timed_out.move_to_end(key)
        while len(self._timed_out) > self.limits.remembered_timeouts:
            self._timed_out.popitem(last=False)

    def _timeout_message(self, compiling: _Compiling, waited_s: float) -> str:
        message = f"grammar compilation timed out after {self.limits.max_seconds:g} s (--max-grammar-seconds)"
        queued = waited_s - compiling.job.running_for(time.monotonic())
        if queued > 0.05 * waited_s:
            message += (f"; {queued:.1f} s of it waiting for one of the server's {self.pool.size} compile threads "
                        f"(--max-grammar-concurrency)")
        return message

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._build_lock:
            if self._xgr is None:
                self._info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                self._xgr = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
            return self._xgr

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler()
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


def _what(spec: GrammarSpec) -> str:
    return {"structural_tag": "tool-call grammar (structural tag)", "ebnf": "grammar"}.get(
        spec.kind, spec.kind.replace("_", " "))


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    """From any thread; a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _ebnf_string(text: str) -> str:
    escaped = re.sub(r'[\\"]', lambda m: "\\" + m.group(0), text)
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'
