"""What bench/overload.py's runs come to: the phases and request outcomes it records, and their summaries (counts,
percentiles, refusals by reason, a per-second count, the server-side cuts seen in its samples)."""
from __future__ import annotations

from dataclasses import dataclass, field

from serve import percentile


@dataclass(slots=True)
class Phase:
    name: str
    clients: int
    prompt_tokens: int
    output_tokens: int
    seconds: float


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    phase: str
    sent: float  # seconds since the run started
    status: int
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    error_code: str | None = None  # of a 503 body, or of an error event inside a stream
    error_type: str | None = None
    retry_after: str | None = None
    error_message: str | None = None
    done: bool = False  # the stream ended with data: [DONE]


def parse_metrics(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def summarize(outcomes: list[Outcome], seconds: float) -> dict:
    accepted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 503]
    ttft = [o.ttft for o in accepted if o.ttft is not None]
    gaps = [g for o in accepted for g in o.gaps]
    reasons: dict[str, int] = {}
    for o in refused:  # the message names the bound ("too many waiting requests (8, limit 8)")
        reason = f"{o.error_type}: {(o.error_message or '').split(' (')[0]}"
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"requests": len(outcomes), "accepted": len(accepted), "refused_503": len(refused),
            "other_status": sorted({o.status for o in outcomes} - {200, 503}),
            "refused_per_s": round(len(refused) / seconds, 1), "accepted_per_s": round(len(accepted) / seconds, 2),
            "refusals_by_reason": reasons, "retry_after": sorted({o.retry_after for o in refused if o.retry_after}),
            "completed_in_full": sum(o.done and o.tokens > 0 and o.error_code is None for o in accepted),
            "output_tok_s": round(sum(o.tokens for o in accepted) / seconds, 1),
            "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p90": ms(percentile(ttft, 90)),
                        "p99": ms(percentile(ttft, 99)), "max": ms(max(ttft, default=None))},
            "itl_ms": {"p50": ms(percentile(gaps, 50)), "p90": ms(percentile(gaps, 90)),
                       "p99": ms(percentile(gaps, 99)), "max": ms(max(gaps, default=None))}}


def cuts_seen(samples: list[dict]) -> list[dict]:
    """Samples in which requests ended as aborted without being refused (/metrics counts a refusal as an abort
    too): here, the stalled readers that --write-timeout cut. Their server-side end, to the sampler's second."""
    cuts, before = [], 0.0
    for sample in samples:
        aborted = sample["finished"].get("abort", 0.0) - sum(sample["rejected"].values())
        if aborted > before:
            cuts.append({"t": sample["t"], "requests": aborted - before})
        before = aborted
    return cuts


def per_second(outcomes: list[Outcome]) -> list[dict]:
    """Requests sent in each second of the run: accepted, refused."""
    seconds: dict[int, list[int]] = {}
    for o in outcomes:
        counts = seconds.setdefault(int(o.sent), [0, 0])
        counts[0 if o.status == 200 else 1] += 1
    return [{"t": t, "accepted": c[0], "refused": c[1]} for t, c in sorted(seconds.items())]
