"""POST /v1/responses (also /responses), GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

The request is translated into the chat request (web/responses_request.py) and run by the generation core
(web/generation.serve_chat), like chat completions; only the rendering differs (web/responses_endpoint.py).
"""
from __future__ import annotations

import time

from aiohttp import web

from pipeline.errors import ContextLengthExceeded
from web.app import STATE, json_response, read_json
from web.generation import serve_chat
from web.protocol_errors import APIError, api_error_from_exception
from web.output_parsing import ChoiceParsers
from web.response_store import ResponseStore
from web.responses_endpoint import ResponsesEndpoint
from web.responses_request import parse_responses_request
from web.sse_body import SSEBody

RESPONSE_STORE = web.AppKey("conveyor_response_store", ResponseStore)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", "invalid_request_error", param, "not_found")


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    store = request.app[RESPONSE_STORE]
    arrival = time.monotonic()
    body = await read_json(request)
    history = None
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise _not_found(str(previous), "previous_response_id")
        history = stored.items
    parsed = parse_responses_request(body, history)
    model = state.model_name(parsed.chat.model)
    made: list[ResponsesEndpoint] = []

    def endpoint_for(parsers: ChoiceParsers) -> ResponsesEndpoint:
        made.append(ResponsesEndpoint(state, model, parsed, parsers, store))
        return made[0]

    try:
        return await serve_chat(request, parsed.chat, arrival, endpoint_for)
    except ContextLengthExceeded as exc:
        if not parsed.chat.stream or not made:
            raise
        # a streaming client (Codex) learns of an overflow from response.failed and its code
        body = await SSEBody.open(request)
        await body.write(made[0].failure_stream(api_error_from_exception(exc)))
        await body.finish()
        return body.response


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSE_STORE].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.body)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE].delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def add_responses_routes(app: web.Application, store_capacity: int) -> None:
    app[RESPONSE_STORE] = ResponseStore(store_capacity)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/responses", create_response)
        app.router.add_get(f"{prefix}/responses/{{response_id}}", get_response)
        app.router.add_delete(f"{prefix}/responses/{{response_id}}", delete_response)
