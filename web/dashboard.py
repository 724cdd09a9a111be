"""GET /dashboard: a live page of the stages at work, and GET /dashboard/data, the JSON it polls (also what
`conveyor top` reads).

The page (web/static/dashboard.html and dashboard.js, charts by the vendored uPlot) polls
``/dashboard/data?since=<seq>&window=<seconds>`` once a second: the samples after the last one it has, at most
``MAX_POINTS`` of them, and the current figures (pipeline/live_view.py). Each poll is bounded whatever the load,
and costs the engine nothing between polls.

With ``--api-key`` every /dashboard route needs the key, as /v1 does. A browser cannot send a header when it
navigates, so these routes (and only these) also take it as ``?key=<key>``: the page is then answered with a
redirect to itself that sets an HttpOnly, SameSite=Strict cookie holding a digest of the key (never the key), and
the page's own requests carry that cookie. ``Authorization: Bearer <key>`` and ``x-api-key: <key>`` work too (`top`).
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from pipeline.live_reading import engine_info
from pipeline.live_view import live_payload
from web.app import STATE, json_response
from web.protocol import APIError, bad_request

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STATIC_DIR = Path(__file__).resolve().parent / "static"
# name under /dashboard/static/ -> (file under web/static/, content type)
STATIC_FILES: dict[str, tuple[str, str]] = {
    "dashboard.js": ("dashboard.js", "text/javascript"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}
KEY_COOKIE = "conveyor_dashboard"
COOKIE_MAX_AGE_S = 7 * 24 * 3600
# the page loads its own scripts and styles only, and talks to its own origin only
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
DEFAULT_WINDOW_S = 60.0


def key_digest(key: str) -> str:
    """What the cookie holds: it opens the dashboard and nothing else (a stolen cookie is not the API key)."""
    return hashlib.sha256(b"conveyor dashboard\0" + key.encode()).hexdigest()


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _key_in_query(request: web.Request, key: str) -> bool:
    return _equal(request.query.get("key"), key)


def check_dashboard_key(request: web.Request) -> None:
    """Raise 401 unless the request carries the API key (header, ``?key=`` or the dashboard cookie)."""
    key = request.app[STATE].settings.api_key
    if key is None:
        return
    authorization = request.headers.get("Authorization")
    if (_equal(authorization, f"Bearer {key}") or _equal(request.headers.get("x-api-key"), key)
            or _key_in_query(request, key) or _equal(request.cookies.get(KEY_COOKIE), key_digest(key))):
        return
    raise APIError(401, "invalid or missing API key (open /dashboard?key=<key> in a browser, or send "
                        "Authorization: Bearer <key> or x-api-key: <key>)", "authentication_error",
                   code="invalid_api_key")


class DashboardFiles:
    """The page and its scripts, read once when the routes are added (they ship in the package: pyproject.toml)."""

    def __init__(self, directory: Path = STATIC_DIR) -> None:
        self.page = (directory / "dashboard.html").read_bytes()
        self.static = {name: ((directory / path).read_bytes(), content_type)
                       for name, (path, content_type) in STATIC_FILES.items()}


def _page_handler(files: DashboardFiles) -> Handler:
    async def dashboard_page(request: web.Request) -> web.StreamResponse:
        check_dashboard_key(request)
        key = request.app[STATE].settings.api_key
        if key is not None and _key_in_query(request, key):  # keep the key out of the address bar from here on
            response = web.Response(status=303, headers={"Location": "dashboard", "Cache-Control": "no-store"})
            response.set_cookie(KEY_COOKIE, key_digest(key), max_age=COOKIE_MAX_AGE_S, httponly=True,
                                samesite="Strict", secure=request.secure)
            return response
        return web.Response(body=files.page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    return dashboard_page


def _static_handler(files: DashboardFiles) -> Handler:
    async def dashboard_static(request: web.Request) -> web.Response:
        check_dashboard_key(request)
        found = files.static.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        body, content_type = found
        return web.Response(body=body, content_type=content_type,
                            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    return dashboard_static


def _query_int(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"`{name}` must be an integer, got {text!r}", name) from None
    if value < 0:
        raise bad_request(f"`{name}` must be >= 0, got {value}", name)
    return value


def _query_window(request: web.Request, longest_s: float) -> float:
    text = request.query.get("window")
    if text is None:
        return DEFAULT_WINDOW_S
    try:
        value = float(text)
    except ValueError:
        raise bad_request(f"`window` must be a number of seconds, got {text!r}", "window") from None
    if not 1.0 <= value <= longest_s:
        raise bad_request(f"`window` must be between 1 and {longest_s:g} seconds, got {text}", "window")
    return value


async def dashboard_data(request: web.Request) -> web.Response:
    check_dashboard_key(request)
    state = request.app[STATE]
    engine = state.ready_engine()
    live = engine.live
    since = _query_int(request, "since", 0)
    window_s = _query_window(request, live.samples.maxlen * live.interval_s)
    info = {"model": state.settings.served_model_names[0], **engine_info(engine)}
    return json_response(live_payload(live, info, since, window_s), headers={"Cache-Control": "no-store"})


def add_dashboard_routes(app: web.Application, files: DashboardFiles | None = None) -> None:
    files = files or DashboardFiles()
    app.router.add_get("/dashboard", _page_handler(files))
    app.router.add_get("/dashboard/data", dashboard_data)
    app.router.add_get("/dashboard/static/{name}", _static_handler(files))
