"""The intake stage: turns a client's request into an admitted Request, or a clear error.

It renders the chat template, tokenizes, checks every limit the client could break (with the
numbers in the message), fills unset sampling fields from the model's generation_config (and
nothing else: no hidden penalties), draws a seed when the request has none, and applies the
admission limits before handing the request to prefill.

A request whose grammar is not compiled yet waits for it in a task of its own, so the loop takes the next request at
once: compiling one never delays requests without a grammar (or with a cached one), nor their admission. It is
admitted when its grammar is ready, by the same rules; one whose client left meanwhile is dropped unadmitted.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from dataclasses import fields, replace

from pipeline.errors import AdmissionRefused, ContextLengthExceeded, InvalidRequest, RequestFailed
from pipeline.grammar.spec import GrammarSpec
from pipeline.messages import IntakeItem
from pipeline.model_limits import ModelLimits
from pipeline.prompt import PromptRenderer
from pipeline.request import Request, SamplingParams
from pipeline.scheduler import WaitingGauge
from pipeline.stage import Stage

if TYPE_CHECKING:
    from pipeline.grammar.compiler import GrammarCompiler

log = logging.getLogger("conveyor.intake")

class IntakeStage(Stage[IntakeItem]):
    name = "intake"

    def __init__(self, inbox_size: int, *, renderer: PromptRenderer, limits: ModelLimits,
                 waiting_gauge: WaitingGauge, prefill: Stage, seed: int | None = None,
                 grammars: Callable[[], GrammarCompiler] | None = None) -> None:
        super().__init__(inbox_size)
        self.grammars = grammars  # built on first use
        self.renderer = renderer
        self.limits = limits
        self.waiting_gauge = waiting_gauge
        self.prefill = prefill
        self.draining = False
        self.busy_since: float | None = None  # when the loop took the request it is on (None: waiting for one)
        self._compiling: set[asyncio.Task[None]] = set()  # requests waiting for their grammar
        self._arrivals = 0
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()

    async def run(self) -> None:
        try:
            while True:
                item = await self.receive()
                self.busy_since = time.monotonic()
                await self.take(item, self.busy_since)
                self.busy_since = None
        finally:
            for task in self._compiling:
                task.cancel()
            await asyncio.gather(*self._compiling, return_exceptions=True)

    async def take(self, item: IntakeItem, started: float) -> None:
        """Validate and admit one request, or leave it waiting for its grammar in a task."""
        try:
            grammar = self.cached_grammar(item.params.grammar)  # first: a source over its bound is not tokenized
            prompt_ids = self.tokenize(item)
            params = self.resolve_params(item.params, len(prompt_ids))
            if params.grammar is not None and grammar is None:
                self._wait_for_grammar(item, prompt_ids, params, started)
                return
            request = self.admit(item, prompt_ids, params, grammar)
        except (InvalidRequest, AdmissionRefused) as exc:
            item.channel.fail(exc)
            self.record(started, 1, 0)
            return
        await self._hand_over(item, request, started)

    def stalled(self, now: float, bound_s: float) -> str | None:
        """Why intake is not taking requests, if it has been on one for longer than bound_s."""
        busy_since = self.busy_since
        if busy_since is None or now - busy_since <= bound_s:
            return None
        return f"intake has been on one request for {now - busy_since:.0f}s ({self.inbox_depth} waiting behind it)"

    def snapshot(self) -> dict[str, object]:
        return {**super().snapshot(), "waiting_for_grammar": len(self._compiling)}

    # --- grammars ------------------------------------------------------------------------------
    def cached_grammar(self, spec: GrammarSpec | None) -> Any:
        """The compiled grammar when none must be compiled (None: no grammar, or it needs compiling). Raises
        InvalidRequest for a spec refused outright (too large, timed out before)."""
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequest("structured output is not available on this server")
        from pipeline.grammar.compiler import InvalidGrammar

        try:
            return self.grammars().lookup(spec)
        except InvalidGrammar as exc:
            raise InvalidRequest(str(exc), "response_format") from exc

    def _wait_for_grammar(self, item: IntakeItem, prompt_ids: list[int], params: SamplingParams,
                          started: float) -> None:
        limit = self.waiting_gauge.max_requests
        if len(self._compiling) >= limit:
            raise AdmissionRefused(f"too many waiting requests ({len(self._compiling)} for their grammar, "
                                   f"limit {limit})")
        task = asyncio.create_task(self._admit_compiled(item, prompt_ids, params, started),
                                   name=f"intake-grammar-{item.request_id}")
        self._compiling.add(task)
        task.add_done_callback(self._compiling.discard)

    async def _admit_compiled(self, item: IntakeItem, prompt_ids: list[int], params: SamplingParams,
                              started: float) -> None:
        """Wait for the grammar (or the client leaving, which stops the wait at once), then admit."""
        from pipeline.grammar.compiler import InvalidGrammar

        assert self.grammars is not None and params.grammar is not None
        compiling = asyncio.ensure_future(self.grammars().compile(params.grammar))
        withdrawn = asyncio.get_running_loop().create_future()
        item.cancel.on_cancel = lambda: withdrawn.done() or withdrawn.set_result(None)
        try:
            if not item.cancel.is_set:
                await asyncio.wait((compiling, withdrawn), return_when=asyncio.FIRST_COMPLETED)
        finally:
            item.cancel.on_cancel = None
            if not compiling.done():
                compiling.cancel()  # the compiler stops counting this waiter (a job nobody waits for never starts)
                await asyncio.gather(compiling, return_exceptions=True)
        try:
            if item.cancel.is_set:
                request = None
            else:
                grammar = compiling.result()
                request = self.admit(item, prompt_ids, params, grammar)
        except InvalidGrammar as exc:
            item.channel.fail(InvalidRequest(str(exc), "response_format"))
            self.record(started, 1, 0)
            return
        except AdmissionRefused as exc:
            item.channel.fail(exc)
            self.record(started, 1, 0)
            return
        except Exception as exc:  # noqa: BLE001 - this request fails, the stage goes on
            log.exception("compiling the grammar of %s", item.request_id)
            item.channel.fail(RequestFailed(f"compiling the grammar failed: {type(exc).__name__}"))
            self.record(started, 1, 0)
            return
        await self._hand_over(item, request, started)

    # --- admission -----------------------------------------------------------------------------
    async def _hand_over(self, item: IntakeItem, request: Request | None, started: float) -> None:
        if request is None:  # its client left before admission: nothing was admitted, nothing to free
            self.record(started, 1, 0)
            return
        if item.on_admitted is not None:
            item.on_admitted(request)
        self.record(started, 1, 1)
        await self.prefill.put(request)

    def admit(self, item: IntakeItem, prompt_ids: list[int], params: SamplingParams, grammar: Any) -> Request | None:
        """The admitted request (counted waiting), None when its client has left, or AdmissionRefused."""
        if item.cancel.is_set:
            return None
        if self.draining:
            raise AdmissionRefused("the server is shutting down")
        refusal = self.waiting_gauge.refusal(len(prompt_ids))
        if refusal is not None:
            raise AdmissionRefused(refusal)
        self.waiting_gauge.add(len(prompt_ids))
        max_total = self.limits.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_ids) + params.max_tokens)
        self._arrivals += 1
        tags = self.limits.thinking_tags
        thinking = tags if params.thinking_token_budget is not None else None
        return Request(
            request_id=item.request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.limits.eos_token_ids,
            max_total_tokens=max_total,
            cancel=item.cancel,
            arrival_seq=self._arrivals,
            prompt_text=item.prompt,
            channel=item.channel,
            grammar=grammar,
            thinking=thinking,
            prompt_opens_thinking=tags is not None and tags.prompt_opens_block(prompt_ids),
        )

    def tokenize(self, item: IntakeItem) -> list[int]:
        ids = self.renderer.token_ids(item.prompt, item.prompt_token_ids, item.messages, item.chat_template_kwargs)
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if len(ids) >= self.limits.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens; the model's maximum context length is "
                f"{self.limits.max_model_len}, leaving no room to generate", len(ids), self.limits.max_model_len)
        return ids

    def resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        limits = self.limits
        if params.n > limits.max_num_seqs:
            raise InvalidRequest(f"n={params.n} exceeds the server's max_num_seqs ({limits.max_num_seqs})", "n")
        if params.max_tokens is not None and not params.max_tokens_clamped and \
                prompt_len + params.max_tokens > limits.max_model_len:
            raise InvalidRequest(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{prompt_len + params.max_tokens}, over the model's maximum context length of "
                f"{limits.max_model_len}", "max_tokens")
        for name, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise InvalidRequest(f"{name} has token ids out of range [0, {limits.vocab_size}): {bad[:5]}", name)
        resolved = replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
        for f in fields(SamplingParams):
            if f.name in limits.generation_defaults and getattr(resolved, f.name) is None:
                setattr(resolved, f.name, limits.generation_defaults[f.name])
        if resolved.temperature is None:
            resolved.temperature = 1.0
        if resolved.seed is None:
            resolved.seed = self._seeds.getrandbits(63)
        if resolved.repetition_detection is None:
            resolved.repetition_detection = limits.repetition_detection or False
        return resolved
