"""The aiohttp application: middlewares (errors, auth), and every endpoint except generation.

The engine may still be loading when the app starts (health answers 503 then); `ServerState`
holds it once ready, and the generation handlers live in web/generation.py.
"""
from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pipeline.engine import Engine
from pipeline.model_family import FamilyDefaults
from web.messages_errors import anthropic_error_body, anthropic_status, is_messages_path
from web.metrics import ServerMetrics, admission_reason
from web.protocol import APIError, api_error_from_exception, bad_request, models_list

if TYPE_CHECKING:
    from web.otel_spans import RequestSpans

log = logging.getLogger("conveyor.web")

# the routes behind --api-key: everything under /v1, the agent APIs' aliases without it, and request traces
AUTHENTICATED_PATHS = ("/v1", "/responses", "/messages", "/debug/trace")
NO_REASONING_PARSER = "none"  # --reasoning-parser none: keep <think> blocks in the content
SHUTTING_DOWN = "server_shutting_down"  # the error code of a request the drain cut (web/generation.py)


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    request_timeout_s: float | None = None
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 1
    tool_call_parser: str | None = None  # None: the model family's, else the format the chat template writes
    reasoning_parser: str | None = None  # "qwen3" / "deepseek_r1": split <think> blocks into reasoning_content;
    # None: the model family's (off for most); "none": off (with_model_defaults turns it into None)
    enforce_tool_grammar: bool = True  # constrain tool calls to the offered tools' schemas
    responses_store_size: int = 256  # stored Responses API responses (previous_response_id), least recent dropped
    # connection deadlines and limits (web/connections.py): a request head within header_timeout_s of connecting or
    # of the previous response, its body within body_timeout_s (else 408); response bytes a client leaves unread
    # for write_timeout_s cut the connection, once the kernel holds send_buffer_bytes of them; a request line or
    # header over max_header_bytes is 431
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 30.0
    send_buffer_bytes: int = 64 << 10
    max_header_bytes: int = 8192
    otlp_traces_endpoint: str | None = None  # an OTLP collector: one OpenTelemetry span per request (web/otel_spans.py)

    def with_model_defaults(self, defaults: FamilyDefaults) -> ServerSettings:
        """The parsers to serve with: an explicit choice wins, an unset one takes the model family's default, and
        reasoning_parser "none" (the explicit "off", so a family default cannot turn it back on) becomes None.
        Applied once, where the server starts (cli/main.py `server_settings`): after it, None means off."""
        reasoning = self.reasoning_parser or defaults.reasoning_parser
        return replace(self, tool_call_parser=self.tool_call_parser or defaults.tool_call_parser,
                       reasoning_parser=None if reasoning == NO_REASONING_PARSER else reasoning)


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics
    engine: Engine | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    request_spans: RequestSpans | None = None  # --otlp-traces-endpoint (None: OpenTelemetry is not loaded)

    def ready_engine(self) -> Engine:
        if self.engine is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return self.engine

    def model_name(self, requested: str | None) -> str:
        """The served name a request addresses; unknown names are 404 as in OpenAI's API. A served name with `*`
        is a pattern (`claude-*`): a name it matches addresses the model and is answered under its own name."""
        names = self.settings.served_model_names
        if requested is None or requested in names:
            return requested or names[0]
        if any("*" in name and fnmatch.fnmatchcase(requested, name) for name in names):
            return requested
        raise APIError(404, f"The model `{requested}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")


STATE = web.AppKey("conveyor_state", ServerState)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json",
                        headers=headers)


def error_response(error: APIError, retry_after_s: int, path: str = "") -> web.Response:
    """The error in the shape of the API the path belongs to: Anthropic's on the Messages routes, else OpenAI's."""
    headers = {"Retry-After": str(retry_after_s)} if error.status == 503 else None
    if is_messages_path(path):
        response = json_response(anthropic_error_body(error), anthropic_status(error), headers)
    else:
        response = json_response(error.body(), error.status, headers)
    # 408: the rest of the body is not waited for; 504: a client that timed out may not be reading at all, and its
    # connection must not outlive the request (a kept-alive one would wait for the header timeout)
    if error.status in (408, 504):
        response.force_close()
    return response


_HTTP_ERRORS = {404: ("not_found_error", "route not found"), 405: ("invalid_request_error", "method not allowed"),
                413: ("invalid_request_error", "request body too large")}


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes OpenAI error JSON with the right status; never a traceback."""
    state = request.app[STATE]
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status in _HTTP_ERRORS:
            kind, text = _HTTP_ERRORS[exc.status]
            message = f"{text}: {request.method} {request.path}" if exc.status != 413 else (
                f"{text} (limit {state.settings.max_body_bytes} bytes)")
            return error_response(APIError(exc.status, message, kind), state.settings.retry_after_s, request.path)
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: classify, log internals, answer cleanly
        error = api_error_from_exception(exc)
        if error.status >= 500 and error.status != 503:
            log.exception("request %s %s failed", request.method, request.path)
        if error.status == 503 and error.code != SHUTTING_DOWN:  # a request cut by shutdown was admitted
            state.metrics.admission_rejected(admission_reason(exc))
        return error_response(error, state.settings.retry_after_s, request.path)


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].settings.api_key
    if key is not None and request.path.startswith(AUTHENTICATED_PATHS):
        # Bearer (OpenAI clients, ANTHROPIC_AUTH_TOKEN) or x-api-key (ANTHROPIC_API_KEY)
        if request.headers.get("Authorization", "") != f"Bearer {key}" and request.headers.get("x-api-key") != key:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key> or x-api-key: <key>)",
                           "authentication_error", code="invalid_api_key")
    return await handler(request)


async def read_json(request: web.Request) -> Any:
    timeout_s = request.app[STATE].settings.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # raises 413 past client_max_size
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g}s", "invalid_request_error",
                       code="request_timeout") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


# ---- simple endpoints -----------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    reason = "loading" if state.engine is None else state.engine.health()
    if reason is None:
        return json_response({"status": "ok"})
    return json_response({"status": reason}, 503, {"Retry-After": str(state.settings.retry_after_s)})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    return json_response(models_list(state.settings.served_model_names, state.started,
                                     engine.loaded.limits.max_model_len))


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def debug_stages(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].ready_engine().stats())


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[STATE].ready_engine()
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    if isinstance(body.get("prompt"), str):
        ids = engine.tokenize(body["prompt"], add_special_tokens=add_special)
    elif isinstance(body.get("messages"), list):
        kwargs = {"add_generation_prompt": body.get("add_generation_prompt", True),
                  **(body.get("chat_template_kwargs") or {})}
        ids = engine.tokenize(messages=body["messages"], chat_template_kwargs=kwargs)
    else:
        raise bad_request("give a string `prompt` or a list of `messages`", "prompt")
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.loaded.limits.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[STATE].ready_engine()
    body = await read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = engine.loaded.limits.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("`tokens` must be a list of integers", "tokens")
    if any(not 0 <= t < vocab for t in tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    return json_response({"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)})


def build_app(state: ServerState) -> web.Application:
    from web.dashboard import add_dashboard_routes
    from web.generation import chat_completions, completions
    from web.messages_api import add_messages_routes
    from web.responses_api import add_responses_routes
    from web.trace_endpoint import add_trace_routes

    app = web.Application(middlewares=[error_middleware, auth_middleware],
                          client_max_size=state.settings.max_body_bytes)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/debug/stages", debug_stages)
    add_responses_routes(app, state.settings.responses_store_size)
    add_messages_routes(app)
    add_trace_routes(app)
    add_dashboard_routes(app)
    return app
