"""A step's one-pass grammar plan (ext/grammar_rows) equals the general path (take_tokens and the
fill's rows, pipeline/grammar/state.py) wherever it plans, and declines, booking nothing, wherever
a round more than one would be needed; compiled and twin."""
from __future__ import annotations

import copy
import random

import pytest

from pipeline.grammar.state import TokenRound, take_tokens
from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("grammar_rows")
STOP = 2


class FakeState:
    """What the plan reads and books of a GrammarState (its matcher is the fill's business)."""

    __slots__ = ("recorded", "taken", "ended", "refused", "stop_ids")

    def __init__(self, recorded: list[int], taken: int, ended: bool) -> None:
        self.recorded, self.taken, self.ended, self.refused = recorded, taken, ended, False
        self.stop_ids = frozenset({STOP})


class Other:
    """A row whose state is not the plan's type (the general path's test doubles)."""

    ended = False


def scenario(rng: random.Random, usual: bool) -> tuple[list[tuple[int, object, int, int]], list[int]]:
    """Rows of one step: states caught up, behind by one (recorded, or one step ahead with the token in
    `host`), ended; unless `usual`, also states behind by more, missing tokens and foreign states."""
    host = [rng.choice([STOP, 5, 6, 7]) for _ in range(8)]
    rows = []
    for row in range(rng.randrange(0, 9)):
        recorded = [rng.choice([5, 6, 7, STOP if rng.random() < 0.2 else 8]) for _ in range(rng.randrange(0, 5))]
        kind = rng.choice(["caught up", "behind", "ahead", "ended"] + ([] if usual else ["far", "missing", "other"]))
        taken = len(recorded)
        position, previous = taken, -1
        if kind == "behind" and recorded:
            taken, position = len(recorded) - 1, len(recorded)
        elif kind == "ahead":
            position, previous = taken + 1, rng.randrange(len(host))
        elif kind == "far":
            taken, position = 0, len(recorded) + 1
        elif kind == "missing":
            position = taken + 1
        state = Other() if kind == "other" else FakeState(recorded, taken, kind == "ended")
        rows.append((row, state, previous, position))
    return rows, host


def general_path(rows, host):
    accepts = take_tokens([(state, position, host[previous] if previous >= 0 else None)
                           for _, state, previous, position in rows if isinstance(state, FakeState)], keep_last=True)
    return accepts, [(row, state) for row, state, _, _ in rows if not state.ended]


def described(rows, planned) -> tuple:
    """The plan with states named by their rows, and every state's bookkeeping after it."""
    names = {id(state): row for row, state, _, _ in rows}
    accepts, fills = planned
    round_ = None if accepts is None else ([names[id(s)] for s in accepts.states], list(accepts.tokens))
    books = [(s.taken, s.ended) for _, s, _, _ in rows if isinstance(s, FakeState)]
    return round_, [(row, names[id(state)]) for row, state in fills], books


@pytest.mark.parametrize("module", MODULES)
def test_the_plan_equals_the_general_path_on_usual_steps(module) -> None:
    rng = random.Random(0)
    planned_any = 0
    for _ in range(400):
        rows, host = scenario(rng, usual=True)
        mine, reference = copy.deepcopy((rows, host)), copy.deepcopy((rows, host))
        planned = module.plan_step(mine[0], mine[1], FakeState, TokenRound)
        assert planned is not None
        assert described(mine[0], planned) == described(reference[0], general_path(*reference))
        planned_any += planned[0] is not None
    assert planned_any > 200


@pytest.mark.parametrize("module", MODULES)
def test_the_plan_declines_without_booking_where_the_general_path_needs_more(module) -> None:
    rng = random.Random(1)
    declined = planned_steps = 0
    for _ in range(400):
        rows, host = scenario(rng, usual=False)
        mine, reference = copy.deepcopy((rows, host)), copy.deepcopy((rows, host))
        before = [(s.taken, s.ended) for _, s, _, _ in mine[0] if isinstance(s, FakeState)]
        planned = module.plan_step(mine[0], mine[1], FakeState, TokenRound)
        if planned is None:
            declined += 1
            assert [(s.taken, s.ended) for _, s, _, _ in mine[0] if isinstance(s, FakeState)] == before
        else:
            planned_steps += 1
            assert described(mine[0], planned) == described(reference[0], general_path(*reference))
    assert declined > 100 and planned_steps > 50


def test_twin_and_compiled_agree_on_every_step() -> None:
    modules = [param.values[0] for param in MODULES if param.values[0] is not None]
    if len(modules) < 2:
        pytest.skip("ext/grammar_rows not built")
    rng = random.Random(2)
    for _ in range(400):
        rows, host = scenario(rng, usual=rng.random() < 0.5)
        results = []
        for module in modules:
            mine = copy.deepcopy((rows, host))
            planned = module.plan_step(mine[0], mine[1], FakeState, TokenRound)
            results.append(None if planned is None else described(mine[0], planned))
        assert results[0] == results[1]
