"""POST /v1/messages and /v1/messages/count_tokens (also without /v1): the Anthropic Messages API.

The request is translated into the chat request (web/messages_request.py) and run by the generation core
(web/generation.serve_chat), like chat completions; only the rendering differs (web/messages_endpoint.py).
count_tokens renders the same translation with the same template, so it counts exactly the prompt that the same
body sent to /v1/messages would have (Claude Code tracks its context with it).
"""
from __future__ import annotations

import time

from aiohttp import web

from web.app import STATE, json_response, read_json
from web.generation import serve_chat
from web.messages_endpoint import MessagesEndpoint
from web.messages_request import parse_messages_request


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    parsed = parse_messages_request(await read_json(request))
    model = state.model_name(parsed.model)
    return await serve_chat(request, parsed.chat, arrival, lambda parsers: MessagesEndpoint(state, model, parsers))


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    parsed = parse_messages_request(await read_json(request), count_only=True)
    state.model_name(parsed.model)
    ids = state.ready_engine().tokenize(messages=parsed.chat.messages,
                                        chat_template_kwargs=parsed.chat.chat_template_kwargs)
    return json_response({"input_tokens": len(ids)})


def add_messages_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/messages", create_message)
        app.router.add_post(f"{prefix}/messages/count_tokens", count_tokens)
