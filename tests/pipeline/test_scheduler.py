"""Scheduling policy on plain values: one step from decode rows and prompts, FCFS under one token
budget, memory fit, seats, one preemption rule, and the same step from the same state."""
import random

from pipeline.scheduler import (
    RunningRow,
    SeatPool,
    StepDecision,
    StepLimits,
    WaitingGauge,
    WaitingPrompt,
    plan_step,
)


def prompt(arrival: int, pending: int, *, computed: int = 0, held: int = 0, n: int = 1, seated: bool = False):
    return WaitingPrompt(arrival, (arrival, 0), computed, pending, held, n, seated)


def row(arrival: int, needed: int = 0, held: int = 1, tokens: int = 1) -> RunningRow:
    return RunningRow(arrival, (arrival, 0), tokens, needed, held)


def limits(budget: int = 100, free: int = 100, seats: int = 10, watermark: int = 0, in_flight: bool = False):
    return StepLimits(budget, free, 4, seats, watermark, in_flight)


def chunks(decision: StepDecision) -> list[tuple[int, int]]:
    return [(c.seq_id, c.num_tokens) for c in decision.chunks]


def test_fcfs_under_token_budget_chunks_the_head_and_stops():
    decision = plan_step([], [prompt(1, 10), prompt(2, 10)], limits(budget=6))
    assert [(c.seq_id, c.num_tokens, c.new_blocks, c.starts) for c in decision.chunks] == [(1, 6, 2, True)]


def test_several_prompts_share_the_budget_in_arrival_order():
    decision = plan_step([], [prompt(3, 5), prompt(1, 5), prompt(2, 5)], limits(budget=12))
    assert chunks(decision) == [(1, 5), (2, 5), (3, 2)]


def test_decode_rows_come_first_and_take_their_tokens_from_the_budget():
    decision = plan_step([row(5), row(6, tokens=4)], [prompt(1, 10)], limits(budget=8))
    assert decision.rows == (5, 6) and chunks(decision) == [(1, 3)]


def test_memory_limits_the_chunk_and_blocks_overtaking():
    assert chunks(plan_step([], [prompt(1, 20), prompt(2, 2)], limits(free=2))) == [(1, 8)]
    assert chunks(plan_step([], [prompt(1, 20), prompt(2, 2)], limits(free=0))) == []  # 2 must not overtake 1


def test_watermark_applies_to_new_sequences_only():
    assert chunks(plan_step([], [prompt(1, 8)], limits(free=2, watermark=1))) == [(1, 4)]
    started = prompt(1, 4, computed=4, held=1, seated=True)
    assert chunks(plan_step([], [started], limits(free=1, watermark=1))) == [(1, 4)]


def test_seats_for_all_samples_are_needed_to_start():
    assert chunks(plan_step([], [prompt(1, 4, n=3)], limits(seats=2))) == []
    assert plan_step([], [prompt(1, 4, n=3)], limits(seats=3)).chunks[0].starts


def test_a_row_takes_blocks_from_the_latest_later_arrival():
    decision = plan_step([row(1, needed=1), row(2, needed=1), row(3, needed=1), row(4, needed=1)], [], limits(free=1))
    assert decision.rows == (1, 2) and decision.preempt == (4, 3)  # 4 made room for 2; then 3 had none itself


def test_a_row_takes_blocks_from_a_later_prompt_before_a_later_row():
    decision = plan_step([row(1, needed=2), row(2)], [prompt(3, 8, computed=4, held=2, seated=True)], limits(free=0))
    assert decision.rows == (1, 2) and decision.preempt == (3,)


def test_a_victim_gives_back_only_the_blocks_it_holds_alone():
    """A prompt holding 3 blocks, 2 of them shared prefix blocks, frees 1: the row needing 2 takes it and the later
    row too, never counting the shared ones; one whose blocks are all shared frees nothing and is left alone."""
    shared = WaitingPrompt(3, (3, 0), 12, 4, 3, 1, True, blocks_released=1)
    decision = plan_step([row(1, needed=2), row(2, held=1)], [shared], limits(free=0, in_flight=False))
    assert decision.preempt == (3, 2) and decision.rows == (1,)
    all_shared = WaitingPrompt(3, (3, 0), 8, 4, 2, 1, True, blocks_released=0)
    decision = plan_step([row(1, needed=1), row(2, held=1)], [all_shared], limits(free=0, in_flight=False))
    assert decision.preempt == (2,) and decision.rows == (1,)


def test_with_rows_in_flight_no_row_is_preempted_the_step_is_read_first():
    decision = plan_step([row(1, needed=1), row(2, needed=1)], [], limits(free=1, in_flight=True))
    assert decision.wait_for_step and decision.rows == () and decision.preempt == ()
    # a later prompt's blocks may still be taken: no launched step writes them
    decision = plan_step([row(1, needed=1)], [prompt(3, 8, computed=4, held=1, seated=True)],
                         limits(free=0, in_flight=True))
    assert decision.rows == (1,) and decision.preempt == (3,)


def test_the_head_prompt_takes_memory_back_from_later_arrivals_only():
    waiting = [prompt(1, 12), prompt(2, 12, computed=8, held=2, seated=True)]
    decision = plan_step([], waiting, limits(free=0, watermark=1))
    assert decision.preempt == (2,) and chunks(decision) == [(1, 4)]
    assert plan_step([], [prompt(2, 12), prompt(1, 12, computed=8, held=2, seated=True)],
                     limits(free=0)).preempt == ()  # an earlier arrival keeps its blocks


def random_state(rng: random.Random):
    arrivals = rng.sample(range(1, 100), rng.randint(1, 12))
    running, waiting = [], []
    for arrival in arrivals:
        if rng.random() < 0.5:
            running.append(row(arrival, needed=rng.randint(0, 2), held=rng.randint(1, 6), tokens=rng.randint(1, 4)))
        else:
            computed = rng.choice([0, 4, 8])
            waiting.append(prompt(arrival, rng.randint(1, 40), computed=computed, held=computed // 4,
                                  n=rng.randint(1, 3), seated=computed > 0 or rng.random() < 0.3))
    return running, waiting, limits(budget=rng.randint(1, 64), free=rng.randint(0, 12), seats=rng.randint(0, 6),
                                    watermark=rng.randint(0, 2), in_flight=rng.random() < 0.4)


def test_the_same_state_gives_the_same_step():
    rng = random.Random(7)
    for _ in range(500):
        running, waiting, lim = random_state(rng)
        decision = plan_step(running, waiting, lim)
        shuffled_running, shuffled_waiting = running[:], waiting[:]
        rng.shuffle(shuffled_running)
        rng.shuffle(shuffled_waiting)
        assert plan_step(shuffled_running, shuffled_waiting, lim) == decision  # input order is not state
        assert plan_step(running, waiting, lim) == decision


def test_every_step_fits_its_limits_and_only_later_arrivals_give_way():
    rng = random.Random(11)
    for _ in range(2000):
        running, waiting, lim = random_state(rng)
        d = plan_step(running, waiting, lim)
        if d.wait_for_step:
            assert lim.rows_in_flight and not d.rows and not d.chunks and not d.preempt
            continue
        by_id = {r.seq_id: r for r in running} | {w.seq_id: w for w in waiting}
        freed = sum(by_id[s].blocks_held for s in d.preempt)
        used = sum(by_id[s].blocks_needed for s in d.rows) + sum(c.new_blocks for c in d.chunks)
        assert used <= lim.free_blocks + freed
        assert not set(d.preempt) & (set(d.rows) | {c.seq_id for c in d.chunks})
        if lim.rows_in_flight:
            assert not set(d.preempt) & {r.seq_id for r in running}
        row_tokens = sum(by_id[s].num_tokens for s in d.rows)
        assert sum(c.num_tokens for c in d.chunks) <= max(1, lim.token_budget - row_tokens)
        served = [by_id[s].arrival for s in d.rows] + [by_id[c.seq_id].arrival for c in d.chunks]
        for victim in d.preempt:  # a victim arrived after someone it made room for (or is the row itself)
            assert any(by_id[victim].arrival >= a for a in served) or victim in {r.seq_id for r in running}
        starts = [c for c in d.chunks if c.starts]
        assert sum(by_id[c.seq_id].num_samples for c in starts) <= lim.free_seats
        arrivals = [by_id[c.seq_id].arrival for c in d.chunks]
        assert arrivals == sorted(arrivals)
        if d.chunks:  # no overtaking: every prompt before the last chosen one got a chunk or gave way
            last = arrivals[-1]
            assert all(w.seq_id in {c.seq_id for c in d.chunks} or w.seq_id in d.preempt
                       for w in waiting if w.arrival < last)


def test_seats_and_waiting_gauge():
    seats = SeatPool(2)
    assert seats.acquire(2) and not seats.acquire(1)
    seats.release(2)
    gauge = WaitingGauge(max_requests=1, max_tokens=10)
    assert gauge.refusal(11) is not None
    gauge.add(5)
    assert "waiting requests" in gauge.refusal(1)
    gauge.remove(5)
    assert gauge.refusal(10) is None
