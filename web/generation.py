"""The generation core every API face shares, and its chat and completions faces.

A face (an `Endpoint`) translates its request into a `ChatRequest` (or a completions prompt) and renders the
engine's output deltas in its own shape; `serve` runs the request the same way for every face: admission errors
before any byte, streaming or collecting, the request timeout, cancellation on disconnect, and metrics.

A client that disconnects cancels its handler (aiohttp handler_cancellation); closing the engine's
stream then cancels the request, which frees its sequences within one step. --request-timeout
aborts the request with a clear error.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pipeline.request import CancelReason, FinishReason, OutputDelta, Request, TokenLogprob
from web.app import SHUTTING_DOWN, STATE, ServerState, json_response, read_json
from web.chat_output import ChatPiece, wire_tool_call, wire_tool_call_delta
from web.chat_tools import chat_output_parsers
from web.output_parsing import ChoiceParsers
from web.protocol import (SSE_DONE, APIError, ChatRequest, TextEvent, chat_chunk, chat_choice, chat_completion,
                          chat_delta_choice, chat_logprobs, chat_usage_chunk, completion_choice, completion_chunk,
                          completion_logprobs, completion_response, completion_usage_chunk, new_chat_id,
                          new_completion_id, parse_chat_request, parse_completion_request, sse_event, usage)
from web.sse_body import SSEBody


@dataclass(slots=True)
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    output_tokens: int = 0
    text_offset: int = 0  # characters sent so far (completions logprobs offsets)
    error: str | None = None
    prompt_opens_thinking: bool = False
    stop_string: str | None = None  # the stop string that ended the choice


@dataclass(slots=True)
class Tracker:
    """Per-request timing and token accounting for /metrics and usage."""

    arrival: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token: float | None = None
    last_delta: float | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    admitted: Request | None = None  # the engine's Request, kept for the request's span (--otlp-traces-endpoint)

    def observe(self, state: ServerState, delta: OutputDelta) -> Choice:
        """Runs for every streamed delta (256 per step at batch 256): kept to plain attribute work."""
        if delta.token_ids:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            elif self.last_delta is not None:
                state.metrics.inter_token_latency(now - self.last_delta, len(delta.token_ids))
            self.last_delta = now
        self.prompt_tokens = delta.prompt_token_count
        self.cached_tokens = delta.cached_prompt_tokens
        choice = self.choices.get(delta.index)
        if choice is None:
            choice = self.choices[delta.index] = Choice()
        choice.prompt_opens_thinking = delta.prompt_opens_thinking
        if delta.output_token_count > choice.output_tokens:
            choice.output_tokens = delta.output_token_count
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.error = delta.error
            choice.stop_string = delta.stop_string
        return choice

    @property
    def completion_tokens(self) -> int:
        return sum(c.output_tokens for c in self.choices.values())

    def finish(self, state: ServerState, cancelled: bool, api: str) -> None:
        reasons = [c.finish_reason for c in self.choices.values() if c.finish_reason is not None]
        reason = "abort" if cancelled or not reasons else reasons[0].value
        ttft = None if self.first_token is None else self.first_token - self.arrival
        state.metrics.request_finished(reason, self.prompt_tokens, self.completion_tokens, ttft,
                                       time.monotonic() - self.arrival, api=api)


class Endpoint:
    """What differs between the API faces: how deltas, the stream's ends and the final answer are shaped."""

    api = "openai"  # the metrics label of the face

    def __init__(self, state: ServerState, model: str, include_usage: bool, want_logprobs: bool) -> None:
        self.state = state
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.created = int(time.time())
        tokenizer = state.ready_engine().tokenizer
        self.token_text = lambda t: tokenizer.decode([t], skip_special_tokens=False)
        self._text_events: dict[int, TextEvent] = {}

    def opening(self, first: OutputDelta, n: int) -> bytes:
        """The events before the first delta's (the first delta is not observed yet)."""
        return b""

    def closing(self, tracker: Tracker) -> bytes:
        """The events after the last delta's."""
        return b""

    def delta_error(self, message: str) -> bytes:
        """The event of a choice that failed mid-way; the stream then closes as usual."""
        return sse_event(APIError(500, message, "server_error").body())

    def stream_error(self, error: APIError, tracker: Tracker) -> bytes:
        """The last events of a stream the server cut short (a timeout, a drain that ran out): nothing follows them."""
        return sse_event(error.body()) + SSE_DONE

    def event(self, delta: OutputDelta, choice: Choice) -> bytes:
        """The SSE event of a delta (empty when it carries nothing to show)."""
        raise NotImplementedError

    def text_event(self, index: int, text: str) -> bytes:
        """The event of a delta that only carries text (the common case, from a template)."""
        return self._text_event(index)(text)

    def _text_event(self, index: int) -> TextEvent:
        template = self._text_events.get(index)
        if template is None:
            template = self._text_events[index] = TextEvent(lambda text: self.text_chunk(index, text))
        return template

    def text_chunk(self, index: int, text: str) -> dict:
        raise NotImplementedError

    def usage_chunk(self, usage_: dict) -> dict:
        raise NotImplementedError

    def response(self, tracker: Tracker) -> dict:
        raise NotImplementedError


class OpenAIEndpoint(Endpoint):
    """Chat and completions streams end with an optional usage chunk and `data: [DONE]`."""

    def closing(self, tracker: Tracker) -> bytes:
        data = b""
        if self.include_usage:
            final = usage(tracker.prompt_tokens, tracker.completion_tokens, tracker.cached_tokens)
            data = sse_event(self.usage_chunk(final))
        return data + SSE_DONE


class ChatEndpoint(OpenAIEndpoint):
    api = "chat_completions"

    def __init__(self, *args: Any, parsers: ChoiceParsers | None = None) -> None:
        super().__init__(*args)
        self.id = new_chat_id()
        self.choice_parsers = parsers or ChoiceParsers(None)
        self.parse = self.choice_parsers.parse
        self.finish_reason = self.choice_parsers.finish_reason

    def opening(self, first: OutputDelta, n: int) -> bytes:
        return b"".join(sse_event(chat_chunk(self.id, self.created, self.model,
                                             [chat_delta_choice(i, role="assistant", content="")],
                                             include_usage=self.include_usage)) for i in range(n))

    def event(self, delta: OutputDelta, choice: Choice) -> bytes:
        logprobs = chat_logprobs(delta.logprobs, self.token_text) if self.want_logprobs and delta.logprobs else None
        finished = delta.finish_reason is not None
        piece = self.parse(delta.index, delta.text, finished, delta.prompt_opens_thinking)
        if piece is None:
            piece = ChatPiece(content=delta.text)
        if logprobs is None and not finished and not (piece.reasoning or piece.tool_calls):
            return self.text_event(delta.index, piece.content) if piece.content else b""  # content only
        content = piece.content if piece.content or (not finished and not piece.reasoning
                                                     and not piece.tool_calls) else None
        part = chat_delta_choice(delta.index, content=content, reasoning_content=piece.reasoning or None,
                                 tool_calls=[wire_tool_call_delta(d) for d in piece.tool_calls] or None,
                                 logprobs=logprobs, finish_reason=self.finish_reason(delta.index, delta.finish_reason))
        return sse_event(chat_chunk(self.id, self.created, self.model, [part], include_usage=self.include_usage))

    def text_chunk(self, index: int, text: str) -> dict:
        return chat_chunk(self.id, self.created, self.model, [chat_delta_choice(index, content=text)],
                          include_usage=self.include_usage)

    def usage_chunk(self, usage_: dict) -> dict:
        return chat_usage_chunk(self.id, self.created, self.model, usage_)

    def response(self, tracker: Tracker) -> dict:
        choices = []
        for index in sorted(tracker.choices):
            c = tracker.choices[index]
            logprobs = chat_logprobs(c.logprobs, self.token_text) if self.want_logprobs else None
            text = "".join(c.text)
            piece = self.parse(index, text, True, c.prompt_opens_thinking)
            if piece is None:
                choices.append(chat_choice(index, text, c.finish_reason, logprobs=logprobs))
                continue
            calls = [wire_tool_call(call) for call in self.choice_parsers.calls(index)]
            content = piece.content if piece.content or not calls else None
            choices.append(chat_choice(index, content, self.finish_reason(index, c.finish_reason), logprobs=logprobs,
                                       reasoning_content=piece.reasoning or None, tool_calls=calls or None))
        return chat_completion(self.id, self.created, self.model, choices,
                               usage(tracker.prompt_tokens, tracker.completion_tokens, tracker.cached_tokens))


class CompletionEndpoint(OpenAIEndpoint):
    api = "completions"

    def __init__(self, *args: Any, echo_text: str = "") -> None:
        super().__init__(*args)
        self.id = new_completion_id()
        self.echo_text = echo_text

    def _text(self, delta: OutputDelta, choice: Choice) -> str:
        """The echoed prompt precedes each choice's first text."""
        if self.echo_text and not choice.text_offset and not choice.text:
            return self.echo_text + delta.text
        return delta.text

    def event(self, delta: OutputDelta, choice: Choice) -> bytes:
        text = self._text(delta, choice)
        logprobs = None
        if self.want_logprobs and delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, self.token_text, choice.text_offset)
        choice.text_offset += len(text)
        if logprobs is None and delta.finish_reason is None:
            return self.text_event(delta.index, text) if text else b""
        part = completion_choice(delta.index, text, delta.finish_reason, logprobs=logprobs)
        return sse_event(completion_chunk(self.id, self.created, self.model, [part], include_usage=self.include_usage))

    def text_chunk(self, index: int, text: str) -> dict:
        return completion_chunk(self.id, self.created, self.model, [completion_choice(index, text, None)],
                                include_usage=self.include_usage)

    def usage_chunk(self, usage_: dict) -> dict:
        return completion_usage_chunk(self.id, self.created, self.model, usage_)

    def response(self, tracker: Tracker) -> dict:
        choices = []
        for index in sorted(tracker.choices):
            c = tracker.choices[index]
            text = self.echo_text + "".join(c.text)
            logprobs = completion_logprobs(c.logprobs, self.token_text, len(self.echo_text)) \
                if self.want_logprobs else None
            choices.append(completion_choice(index, text, c.finish_reason, logprobs=logprobs))
        return completion_response(self.id, self.created, self.model, choices,
                                   usage(tracker.prompt_tokens, tracker.completion_tokens, tracker.cached_tokens))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    parsed = parse_chat_request(await read_json(request))
    model = state.model_name(parsed.model)
    return await serve_chat(request, parsed, arrival, lambda parsers: ChatEndpoint(
        state, model, parsed.include_usage, parsed.logprobs, parsers=parsers))


async def serve_chat(request: web.Request, parsed: ChatRequest, arrival: float,
                     endpoint_for: Callable[[ChoiceParsers], Endpoint]) -> web.StreamResponse:
    """Every chat-shaped face's run: the output parsers (and the tool-call grammar they set), the engine request
    for the messages, then `serve`."""
    state = request.app[STATE]
    endpoint = endpoint_for(ChoiceParsers(chat_output_parsers(state, parsed)))
    stream = state.ready_engine().generate(messages=parsed.messages, params=parsed.params, request_id=endpoint.id,
                                           chat_template_kwargs=parsed.chat_template_kwargs)
    return await serve(request, stream, endpoint, parsed.stream, parsed.params.n, arrival)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    parsed = parse_completion_request(await read_json(request))
    engine = state.ready_engine()
    echo = ""
    if parsed.echo:
        echo = parsed.prompt_text if parsed.prompt_text is not None else engine.tokenizer.decode(
            parsed.prompt_token_ids or [], skip_special_tokens=False)
    endpoint = CompletionEndpoint(state, state.model_name(parsed.model), parsed.include_usage,
                                  parsed.logprobs is not None, echo_text=echo)
    stream = engine.generate(parsed.prompt_text, prompt_token_ids=parsed.prompt_token_ids, params=parsed.params,
                             request_id=endpoint.id)
    return await serve(request, stream, endpoint, parsed.stream, parsed.params.n, arrival)


async def serve(request: web.Request, stream: AsyncIterator[OutputDelta], endpoint: Endpoint, streaming: bool,
                n: int, arrival: float) -> web.StreamResponse:
    state = endpoint.state
    tracker = Tracker(arrival)
    body: SSEBody | None = None
    completed = connected = False
    timeout_s = state.settings.request_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            first = await anext(stream)  # admission and validation errors surface here, before any byte
            if state.request_spans is not None:
                tracker.admitted = state.ready_engine().admitted(endpoint.id)
            if streaming:
                body = await SSEBody.open(request)
                await _stream(body, first, stream, endpoint, tracker, n)
            else:
                _collect(state, first, tracker)
                async for delta in stream:
                    _collect(state, delta, tracker)
            completed = connected = True
    except TimeoutError:
        state.ready_engine().abort(endpoint.id, CancelReason.TIMEOUT)
        error = APIError(504, f"the request timed out after {timeout_s:g}s", "timeout")
        if body is None:
            raise error from None
        completed = True
        body.abandon()  # cut mid-way: the connection closes after the last events (its client may not be reading)
        # a client that does not take these bytes is cut by the write watchdog (web/connections.py)
        connected = await _write_last(body, endpoint.stream_error(error, tracker))
    except ConnectionResetError:
        pass  # the client went away mid-stream; closing the stream below cancels the request
    finally:
        if body is not None and not connected:
            body.abandon()  # first: it cannot fail, and nothing after it may skip it
        await stream.aclose()
        tracker.finish(state, cancelled=not completed, api=endpoint.api)
        if state.request_spans is not None:
            state.request_spans.request_ended(endpoint.id, endpoint.model, endpoint.api, tracker, request.headers)
    if body is not None:
        if connected:
            await body.finish()
        return body.response
    if cut_by_shutdown(state, tracker):
        raise shutting_down_error()
    failed = [c.error for c in tracker.choices.values() if c.finish_reason is FinishReason.ERROR]
    if failed:
        raise APIError(500, failed[0] or "the request failed", "server_error")
    return json_response(endpoint.response(tracker))


async def _write_last(body: SSEBody, data: bytes) -> bool:
    """Write a stream's last events; False when the client is gone."""
    try:
        await body.write(data)
        return True
    except ConnectionResetError:
        return False


def cut_by_shutdown(state: ServerState, tracker: Tracker) -> bool:
    """The drain ran out of time and cancelled this request (Engine.cancel_in_flight) before it finished."""
    engine = state.engine
    return engine is not None and engine.stopping and any(
        c.finish_reason is FinishReason.ABORT for c in tracker.choices.values())


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down: the request was cut before it finished", "service_unavailable",
                    code=SHUTTING_DOWN)


def _collect(state: ServerState, delta: OutputDelta, tracker: Tracker) -> None:
    choice = tracker.observe(state, delta)
    choice.text.append(delta.text)
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)


def delta_events(endpoint: Endpoint, tracker: Tracker) -> Callable[[OutputDelta], bytes]:
    """A stream's formatter: the SSE events of one delta (empty when it carries nothing to show). It runs
    for every token of every stream, so what it calls is bound once, here."""
    state, event, observe, delta_error = endpoint.state, endpoint.event, tracker.observe, endpoint.delta_error

    def events(delta: OutputDelta) -> bytes:
        data = event(delta, observe(state, delta))
        if delta.finish_reason is not None and delta.error:
            data += delta_error(delta.error)
        return data

    return events


async def _stream(body: SSEBody, first: OutputDelta, stream: AsyncIterator[OutputDelta],
                  endpoint: Endpoint, tracker: Tracker, n: int) -> None:
    await body.write(endpoint.opening(first, n))
    events = delta_events(endpoint, tracker)
    await body.write(events(first))
    while (delta := await anext(stream, None)) is not None:  # one merged delta per read: a slow client falls behind
        await body.write(events(delta))
    if cut_by_shutdown(endpoint.state, tracker):  # after the choices' last chunks (finish_reason "length")
        await body.write(endpoint.stream_error(shutting_down_error(), tracker))
    else:
        await body.write(endpoint.closing(tracker))
