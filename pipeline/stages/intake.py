"""The intake stage: turns a client's request into an admitted Request, or a clear error.

It renders the chat template, tokenizes, checks every limit the client could break (with the
numbers in the message), fills unset sampling fields from the model's generation_config (and
nothing else: no hidden penalties), draws a seed when the request has none, and applies the
admission limits before handing the request to prefill.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from dataclasses import dataclass, fields, replace

from pipeline.errors import AdmissionRefused, ContextLengthExceeded, InvalidRequest
from pipeline.grammar.spec import GrammarSpec
from pipeline.messages import IntakeItem
from pipeline.prompt import PromptRenderer
from pipeline.request import RepetitionDetection, Request, SamplingParams
from pipeline.scheduler import WaitingGauge
from pipeline.stage import Stage
from pipeline.thinking import ThinkingTags

if TYPE_CHECKING:
    from pipeline.grammar.compiler import GrammarCompiler

# generation_config.json keys that may supply request defaults (as vLLM reads them)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, float]
    chat_template: str | None
    repetition_detection: RepetitionDetection | None = None  # the server's default loop guard
    thinking_tags: ThinkingTags | None = None  # the ids of <think> and </think> in this tokenizer


def generation_defaults(generation_config: dict) -> dict[str, float]:
    return {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None}


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
        self._arrivals = 0
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()

    async def run(self) -> None:
        while True:
            item = await self.receive()
            started = time.monotonic()
            try:
                grammar = await self.compile_grammar(item.params.grammar)
                request = self.admit(item)
                request.grammar = grammar
            except (InvalidRequest, AdmissionRefused) as exc:
                item.channel.fail(exc)
                self.record(started, 1, 0)
                continue
            if item.on_admitted is not None:
                item.on_admitted(request)
            self.record(started, 1, 1)
            await self.prefill.put(request)

    async def compile_grammar(self, spec: GrammarSpec | None) -> Any:
        """The request's compiled grammar (cached per spec; compiled in a worker thread)."""
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequest("structured output is not available on this server")
        from pipeline.grammar.compiler import InvalidGrammar

        try:
            return await self.grammars().compile(spec)
        except InvalidGrammar as exc:
            raise InvalidRequest(str(exc), "response_format") from exc

    def admit(self, item: IntakeItem) -> Request:
        prompt_ids = self.tokenize(item)
        params = self.resolve_params(item.params, len(prompt_ids))
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
            arrival_seq=self._arrivals,
            prompt_text=item.prompt,
            channel=item.channel,
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
