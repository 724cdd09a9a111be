"""The detokenize stage: token ids become text deltas, stop strings are applied with hold-back.

Per sample it keeps an incremental detokenizer (output equals a full decode of the same ids; a byte
table for byte-level vocabularies, so no tokenizer call per token) and a
stop-string matcher. A stop-string match ends the sample's output here and sets the sample's cancel
flag, so the stage that owns the sequence frees it at its next step (stopping is not hiding).
State for a sample is dropped when its owner reports the sequence finished.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.detokenizer import StreamingDetokenizer, new_detokenizer
from pipeline.detokenizer_bytes import byte_table
from pipeline.messages import StepTokens
from pipeline.request import FinishReason, OutputDelta, Request, TokenLogprob
from pipeline.stage import Stage
from pipeline.stop_strings import StopStringMatcher
from pipeline.tokenizer import Tokenizer


@dataclass(slots=True)
class SampleText:
    detokenizer: StreamingDetokenizer  # from new_detokenizer
    stops: StopStringMatcher | None
    done: bool = False  # the final delta went out (a stop string may end output before the sequence)


class DetokenizeStage(Stage[StepTokens]):
    name = "detokenize"

    def __init__(self, inbox_size: int, *, tokenizer: Tokenizer, stream: Stage) -> None:
        super().__init__(inbox_size)
        self.tokenizer = tokenizer
        byte_table(tokenizer.backend)  # built (or ruled out) now, not on the first request
        self.stream = stream
        self.samples: dict[tuple[str, int], SampleText] = {}

    async def run(self) -> None:
        while True:
            messages = [await self.receive(), *self.receive_ready()]
            started = time.monotonic()
            deltas: list[tuple[Request, OutputDelta]] = []
            for message in messages:
                self._process(message, deltas)
            self.record(started, sum(len(m.requests) for m in messages), len(deltas))
            if deltas:
                await self.stream.put(deltas)

    def _new_state(self, request: Request, index: int) -> SampleText:
        params = request.params
        state = self.samples[(request.request_id, index)] = SampleText(
            new_detokenizer(self.tokenizer.backend, params.skip_special_tokens),
            StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None,
        )
        return state

    def _process(self, message: StepTokens, out: list[tuple[Request, OutputDelta]]) -> None:
        """One step's rows, in order."""
        tokens = message.token_ids.tolist()
        for r in range(len(message.requests)):
            self._process_row(message, tokens, out, r)

    def _process_row(self, message: StepTokens, tokens: list[int], out: list[tuple[Request, OutputDelta]],
                     r: int) -> None:
        """Row r, any kind: a new or done sample, a finish-only row (-1), the owner's finish, stop strings,
        logprobs, errors."""
        samples = self.samples
        request = message.requests[r]
        index = message.indices[r]
        owner_finish = message.finish[r]
        state = samples.get((request.request_id, index)) or self._new_state(request, index)
        if state.done:
            if owner_finish is not None:
                del samples[(request.request_id, index)]
            return
        token = tokens[r]
        text = state.detokenizer.push_one(token) if token >= 0 else ""
        finish = owner_finish
        if finish is not None:
            text += state.detokenizer.flush()
        if state.stops is not None:
            text, matched = state.stops.feed(text)
            if not matched and finish is not None:  # the end releases held-back text
                text += state.stops.flush()
                matched = state.stops.matched is not None
            if matched:
                if finish is None:
                    request.cancel.cancel_child(index)  # reaches decode at its next step
                finish = FinishReason.STOP
        logprobs = self._logprobs(message, r, request) if token >= 0 and request.params.logprobs is not None else None
        error = request.cancel.message or "request failed" if finish is FinishReason.ERROR else None
        # positional (the fields' order): keyword arguments cost this per-row constructor about three times as much
        delta = OutputDelta(request.request_id, index, text, [token] if token >= 0 else [], logprobs, finish, error,
                            len(request.prompt_token_ids), message.output_counts[r], request.prompt_opens_thinking,
                            request.cached_prompt_tokens)
        if finish is not None and state.stops is not None:
            delta.stop_string = state.stops.matched
        out.append((request, delta))
        if finish is not None:
            state.done = True
            if owner_finish is not None:
                del samples[(request.request_id, index)]

    @staticmethod
    def _logprobs(message: StepTokens, r: int, request: Request) -> list[TokenLogprob] | None:
        k = request.params.logprobs
        if k is None or message.logprobs is None:
            return None
        top: list[tuple[int, float]] = []
        if k and message.top_ids is not None and message.top_logprobs is not None:
            top = list(zip(message.top_ids[r, :k].tolist(), message.top_logprobs[r, :k].tolist()))
        return [TokenLogprob(int(message.token_ids[r]), float(message.logprobs[r]), top)]
