"""How many drafts a row verifies (pipeline/spec/budget.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.engine import Engine
from pipeline.spec.budget import EXACT_TOKEN_COST, MAX_WAIT, DraftBudget, draft_token_cost, expected_tokens
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.pipeline.spec.test_engine_speculation import SPEC, greedy, prompts, run


def test_large_batches_draft_nothing_and_failing_sequences_one():
    budget = DraftBudget(k=5, max_rows=32)
    assert budget.for_step(1) == 5 and budget.for_step(32) == 5 and budget.for_step(33) == 0
    assert budget.for_sequence(5, 0.9) == 5 and budget.for_sequence(5, 0.1) == 1 and budget.for_sequence(0, 0.1) == 0


def test_acceptance_average():
    acceptance = 1.0
    for _ in range(10):
        acceptance = DraftBudget.observe(acceptance, 4, 0)
    assert acceptance == pytest.approx(0.8 ** 10)
    assert DraftBudget.observe(0.5, 0, 0) == 0.5  # a row without drafts says nothing
    assert DraftBudget.observe(0.0, 2, 2) == pytest.approx(0.2)


def test_failed_chances_wait_longer_and_an_accepted_draft_ends_the_wait():
    seq = SimpleNamespace(draft_acceptance=1.0, draft_wait=0, draft_backoff=0)
    chances, waits = [], []
    for step in range(400):
        if DraftBudget.tick([seq]):
            chances.append(step)
            DraftBudget.settle(seq, 4, 0)
            waits.append(seq.draft_wait)
    assert waits[:8] == [1, 2, 4, 8, 16, 32, 64, 64] and max(waits) == MAX_WAIT
    assert chances[:5] == [0, 2, 5, 10, 19] and len(chances) < 400 / MAX_WAIT + 6
    DraftBudget.settle(seq, 4, 1)
    assert seq.draft_backoff == 0 and DraftBudget.tick([seq]) is False  # the wait given before still runs out
    while not DraftBudget.tick([seq]):
        pass
    DraftBudget.settle(seq, 0, 0)  # nothing offered: one step, the backoff kept
    assert seq.draft_wait == 1 and seq.draft_backoff == 0


def test_expected_tokens():
    assert expected_tokens(0, 0.3) == 1.0 and expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75) and expected_tokens(3, 0.0) == 1.0


def test_costly_rows_verify_the_drafts_that_pay_and_probe_otherwise():
    exact = DraftBudget(k=4, token_cost=EXACT_TOKEN_COST)
    assert exact.priced(1) and not exact.priced(2) and not DraftBudget(k=4).priced(1)
    assert exact.for_sequence(4, 1.0, True) == 4  # every draft taken: the longest row gains most
    assert exact.for_sequence(4, 0.9, True) == 1  # 1.9 tokens for 1.85 steps beats 2.71 for 2.7
    assert exact.for_sequence(4, 0.5, True) == 1 and exact.for_sequence(4, 0.0, True) == 1  # none pays: a probe
    assert exact.for_sequence(0, 1.0, True) == 0
    assert exact.for_sequence(4, 0.5) == 4  # unpriced (a batch): the rule without a price
    cheap = DraftBudget(k=4, token_cost=0.05)
    assert cheap.for_sequence(4, 0.5, True) == 3  # 1.875 tokens for 1.15 steps: the best rate, not the longest row
    assert exact.pays(0.9) and not exact.pays(0.8)
    assert draft_token_cost(True, True) == EXACT_TOKEN_COST
    assert draft_token_cost(True, False) == draft_token_cost(False, True) == 0.0


def test_a_drafter_never_right_costs_little_where_rows_are_costly():
    """256 steps of one sequence whose drafts all fail, on exact rows (``EXACT_TOKEN_COST`` decode steps a draft):
    the steps its verify rows add. Priced rows probe with one draft after the first failure; the rule without a price
    keeps four drafts while the average stays above 0.3."""
    def added_steps(token_cost: float) -> float:
        budget = DraftBudget(k=4, token_cost=token_cost)
        seq = SimpleNamespace(draft_acceptance=1.0, draft_wait=0, draft_backoff=0)
        added = 0.0
        for _ in range(256):
            if DraftBudget.tick([seq]):
                k = budget.for_sequence(budget.for_step(1), seq.draft_acceptance, budget.priced(1))
                added += EXACT_TOKEN_COST * k
                DraftBudget.settle(seq, k, 0)
        return added

    priced, unpriced = added_steps(EXACT_TOKEN_COST), added_steps(0.0)
    assert priced < 0.05 * 256 and priced < 0.5 * unpriced


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize("error", [0.0, 0.3])
def test_priced_rows_verify_the_drafts_that_pay(tiny_model_dir, error):
    """Exact rows on a GPU cost about a decode step a token (``DraftBudget.token_cost``): one sequence whose drafts
    are right keeps K a row; one whose drafts fail three times in ten verifies one draft a row, with no fillers after
    it. The tokens equal plain decoding's either way."""
    batch, params = prompts(1), [greedy(160)]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    async def main() -> tuple[list, dict]:
        engine = await Engine.create(config_for(tiny_model_dir, **SPEC))
        engine.decode.drafter = ReplayDrafter(expected, error)
        engine.decode.draft_budget.token_cost = EXACT_TOKEN_COST
        try:
            results = [await collect(engine, prompt_token_ids=batch[0], params=params[0])]
            await settle(engine)
            assert_no_leaks(engine)
            return [[s.token_ids for s in r] for r in results], engine.stats()["speculation"]
        finally:
            await engine.shutdown()

    spec, counted = run_async(main())
    assert spec == plain and counted["filler_tokens"] == 0 and counted["verify_rows"] > 5
    if error:
        assert counted["drafted_tokens"] < 1.5 * counted["verify_rows"]
    else:
        assert counted["drafted_tokens"] > 3.5 * counted["verify_rows"]


def test_accepted_probes_back_off_while_drafting_does_not_pay():
    """Priced rows at an acceptance average where no row pays: an accepted one-draft probe moves the average up but
    the next chance still waits longer; once the average pays, an accepted row ends the wait."""
    budget = DraftBudget(k=4, token_cost=EXACT_TOKEN_COST)
    seq = SimpleNamespace(draft_acceptance=0.5, draft_wait=0, draft_backoff=0)
    waits = []
    for _ in range(5):  # each probe comes once the wait before it has run out
        seq.draft_wait = 0
        budget.after_row(seq, 1, 1, priced=True)
        waits.append(seq.draft_wait)
    assert waits == [1, 2, 4, 8, 16] and seq.draft_acceptance == pytest.approx(1 - 0.5 * 0.8 ** 5)  # 0.836
    seq.draft_wait = 0
    budget.after_row(seq, 1, 1, priced=True)  # 0.869: one draft pays
    assert budget.pays(seq.draft_acceptance) and seq.draft_wait == 0 and seq.draft_backoff == 0
    unpriced = SimpleNamespace(draft_acceptance=0.5, draft_wait=0, draft_backoff=0)
    budget.after_row(unpriced, 1, 1, priced=False)
    assert unpriced.draft_wait == 0
