"""`conveyor top`: the dashboard's live figures in a terminal, for a server at a URL (machines with no browser).

It polls the server's ``/dashboard/data`` (web/dashboard.py; the document is pipeline/live_view.py's) every
``--interval`` seconds, asking only for the samples after the last it has, and draws one frame with curses. What a
frame shows is `render_frame`, a pure function from the document (and the throughput seen so far) to lines, so it
is tested without a terminal; ``--once`` prints one frame to stdout and exits.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SPARKS = " ▁▂▃▄▅▆▇█"
THROUGHPUT_HISTORY = 600  # points of tokens/s kept for the sparkline
STAGE_COLUMNS = ("stage", "inbox", "in/s", "out/s", "wait p50", "wait p99", "service p50", "service p99")


class TopError(Exception):
    """A poll that cannot succeed by retrying (refused key, not a Conveyor server): `top` says why and exits."""


def _number(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    if abs(value) >= 10_000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if value < 1 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _bar(used: float, total: float, width: int) -> str:
    filled = round(width * used / total) if total > 0 else 0
    return "[" + "#" * min(width, filled) + "." * (width - min(width, filled)) + "]"


def sparkline(values: Iterable[float | None], width: int) -> str:
    """The last ``width`` values as block characters scaled to their maximum (a gap where a value is missing)."""
    recent = list(values)[-width:] if width > 0 else []
    top = max((v for v in recent if v is not None), default=0.0)
    if top <= 0:
        return "".join(" " if v is None else SPARKS[1] for v in recent)
    return "".join(" " if v is None else SPARKS[max(1, round((len(SPARKS) - 1) * v / top))] for v in recent)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]


def render_frame(payload: dict[str, Any], throughput: Sequence[float | None], width: int = 100,
                 source: str = "") -> list[str]:
    """One frame of `top` for a /dashboard/data document; every line at most ``width`` characters."""
    info, now = payload["info"], payload["now"]
    title = f"Conveyor top · {info.get('model', '')}" + (f" · {source}" if source else "")
    lines = [title]
    if now is None:
        lines.append("no samples yet: the server has just started")
        return [line[:width] for line in lines]
    clock = time.strftime("%H:%M:%S", time.localtime(now["t"]))
    lines[0] = f"{title} · {clock}"
    lines.append(f"tokens/s {_number(now['tokens_per_s'])} (prompt {_number(now['prompt_tokens_per_s'])})   "
                 f"device steps/s {_number(now['steps_per_s'])}   step {_ms(now['step_ms'])} ms   "
                 f"busy {_share(now['device_busy'])}")
    lines.append(f"step rows: decode {_number(now['decode_rows'])}  verify {_number(now['verify_rows'])}  "
                 f"prompt tokens {_number(now['prompt_tokens'], 0)}")
    lines.append(f"requests: running {now['running']}  waiting {now['waiting']} ({now['waiting_tokens']:,} prompt "
                 f"tokens)  prefilling {now['prefilling']}  seats {now['seats_held']}/{info['seats_total']}  "
                 f"preemptions {now['preemptions']}")
    total = info["kv_blocks_total"]
    memory = (f"memory: KV {_bar(now['kv_blocks_used'], total, 20)} {now['kv_blocks_used']}/{total} "
              f"({_share(now['kv_blocks_used'] / total if total else None)})")
    if info.get("state_slots_total"):
        memory += f"  state slots {now['state_slots_used']}/{info['state_slots_total']}"
    if info.get("snapshots_total"):
        memory += f"  snapshots {now['snapshots_held']}/{info['snapshots_total']}"
    lines.append(memory)
    prefix = _share(now["prefix_hit_rate"]) if info.get("prefix_caching") else "off"
    drafts = f"{_share(now['spec_acceptance'])} ({info['speculation']})" if info.get("speculation") else "off"
    lines.append(f"caches: prefix-cache hits {prefix}   drafts accepted {drafts}   "
                 f"(over the last {now['window_s']:.0f} s)")
    label = "tokens/s "
    spark_width = max(0, width - len(label) - 16)
    shown = list(throughput)[-spark_width:] if spark_width else []
    peak = max((v for v in shown if v is not None), default=None)
    lines.append(label + sparkline(shown, spark_width) + f" max {_number(peak)}")
    lines.append("")
    rows = [list(STAGE_COLUMNS)]
    for name in info["stages"]:
        stage = now["stages"][name]
        rows.append([name, str(stage["inbox"]), _number(stage["in_per_s"]), _number(stage["out_per_s"]),
                     _ms(stage["queue_wait_ms"]["p50"]), _ms(stage["queue_wait_ms"]["p99"]),
                     _ms(stage["service_ms"]["p50"]), _ms(stage["service_ms"]["p99"])])
    lines.extend(_table(rows))
    lines.append(f"(latencies in ms over the last {now['window_s']:.0f} s; {now['device_steps']:,} device steps)")
    return [line[:width] for line in lines]


@dataclass(slots=True)
class TopClient:
    """Polls one server; keeps the seq it has and the throughput seen."""

    url: str
    api_key: str | None = None
    timeout_s: float = 10.0
    seq: int = 0
    started: float | None = None
    throughput: deque[float | None] = field(default_factory=lambda: deque(maxlen=THROUGHPUT_HISTORY))

    def poll(self) -> dict[str, Any]:
        query = urllib.parse.urlencode({"since": self.seq})
        request = urllib.request.Request(f"{self.url.rstrip('/')}/dashboard/data?{query}")
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as error:
            message = _error_message(error)
            if error.code in (401, 403, 404):
                raise TopError(f"{self.url}: {message}") from None
            raise ConnectionError(message) from None
        except urllib.error.URLError as error:
            raise ConnectionError(str(error.reason)) from None
        except json.JSONDecodeError:
            raise TopError(f"{self.url}/dashboard/data did not answer JSON: is it a Conveyor server?") from None
        if payload.get("started") != self.started:  # a new server (or the first poll): its whole history
            if self.started is not None:
                self.started, self.seq = payload.get("started"), 0
                self.throughput.clear()
                return self.poll()
            self.started = payload.get("started")
        self.throughput.extend(payload["series"]["tokens_per_s"])
        self.seq = payload["seq"]
        return payload


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.code}"


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 seconds, got {text}")
    return value


def add_top_parser(commands: argparse._SubParsersAction) -> None:
    top = commands.add_parser("top", help="live figures of a running server in the terminal (what /dashboard shows)")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    top.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    top.add_argument("--interval", type=positive_seconds, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame to stdout and exit (no terminal needed)")


def top_main(args: argparse.Namespace) -> int:
    client = TopClient(args.url, args.api_key)
    try:
        if args.once:
            payload = client.poll()
            print("\n".join(render_frame(payload, client.throughput, 120, args.url)))
            return 0
        return _interactive(client, args.interval)
    except TopError as error:
        print(f"conveyor top: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # --once: the server is not there
        print(f"conveyor top: cannot reach {args.url}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _interactive(client: TopClient, interval_s: float) -> int:
    try:
        import curses
    except ImportError:
        print("conveyor top: this Python has no curses; run `conveyor top --once` instead", file=sys.stderr)
        return 1
    if not sys.stdout.isatty():
        print("conveyor top: not a terminal; run `conveyor top --once` instead", file=sys.stderr)
        return 1

    def run(screen: Any) -> int:
        curses.curs_set(0)
        screen.timeout(int(interval_s * 1000))  # getch waits one interval: the refresh tick, and q quits at once
        while True:
            height, width = screen.getmaxyx()
            try:
                lines = render_frame(client.poll(), client.throughput, width - 1, client.url)
            except (ConnectionError, OSError) as error:  # the server went away: say so and keep trying
                lines = [f"Conveyor top · {client.url}", f"cannot reach the server: {error}"]
            screen.erase()
            for row, line in enumerate(lines[:height]):
                screen.addnstr(row, 0, line, width - 1)
            screen.refresh()
            if screen.getch() in (ord("q"), ord("Q"), 27):
                return 0

    return curses.wrapper(run)
