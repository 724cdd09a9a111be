"""Pure-Python twin of ext/detokenize_rows.pyx: one decode step's rows of the detokenize stage, the common
row done here and every other row handed to the stage's general path.

DetokenizeStage._process (pipeline/stages/detokenize.py) runs on the event loop once per decode step and
sees every row of the batch: about 1 us a row in Python, 0.27 ms a step at batch 256. Nearly every row is
a plain next token: its sample has state that is not done, the token is an id (>= 0), the owner did not
finish the sequence, the sample has no stop strings and the request asks no logprobs. That row's whole
work is one detokenizer push and one OutputDelta, which this function does itself; any other row goes to
`general(r)`, the stage's full per-row logic, which appends its own delta. Rows are walked in order, so
`out` keeps the per-row loop's order, and the general path stays the one definition of every other case
(tests/ext/test_detokenize_rows.py checks both modules against a copy of that loop).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def detokenize_rows(requests: list[Any], indices: list[int], finish: list[Any], tokens: list[int],
                    output_counts: list[int], samples: dict[tuple[str, int], Any], out: list[tuple[Any, Any]],
                    general: Callable[[int], None], delta_type: Callable[..., Any]) -> None:
    """Appends (request, delta) to `out` for each row r of a StepTokens message's lists (tokens: its
    token_ids as a list), calling general(r) for every row that is not the common one. samples maps
    (request_id, index) to the sample's SampleText; delta_type is OutputDelta (ext does not import pipeline)."""
    covered = min(len(indices), len(finish), len(tokens), len(output_counts))  # rows past it: the general path raises
    for r in range(len(requests)):
        if r >= covered or not _push_common(requests[r], r, indices, finish, tokens, output_counts, samples, out,
                                            delta_type):
            general(r)


def _push_common(request: Any, r: int, indices: list[int], finish: list[Any], tokens: list[int],
                 output_counts: list[int], samples: dict[tuple[str, int], Any], out: list[tuple[Any, Any]],
                 delta_type: Callable[..., Any]) -> bool:
    """Row r's delta when it is the common row (then True); False, with nothing done, for any other row."""
    if finish[r] is not None:
        return False
    index = indices[r]
    request_id = request.request_id
    state = samples.get((request_id, index))
    if state is None or state.done or state.stops is not None:
        return False
    token = tokens[r]
    if not (token >= 0) or request.params.logprobs is not None:
        return False
    text = state.detokenizer.push_one(token)
    out.append((request, delta_type(request_id, index, text, [token], None, None, None,
                                    len(request.prompt_token_ids), output_counts[r], request.prompt_opens_thinking)))
    return True
