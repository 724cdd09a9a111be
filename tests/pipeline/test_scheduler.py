"""Scheduling policy on plain sequences: FCFS, token budget, memory fit, seats, victims."""
from pipeline.request import Request, SamplingParams
from pipeline.scheduler import SeatPool, WaitingGauge, decode_victim, plan_prefill, prefill_victims
from pipeline.sequence import Sequence


def make_seq(arrival: int, prompt_len: int, n: int = 1) -> Sequence:
    request = Request(f"r{arrival}", list(range(prompt_len)), SamplingParams(n=n, seed=1), frozenset({2}),
                      max_total_tokens=1000, arrival_seq=arrival)
    return Sequence.from_request(request)


def plan(waiting, *, budget=100, free=100, seats=10, started=(), watermark=0):
    return plan_prefill(waiting, started=set(started), token_budget=budget, free_blocks=free, block_size=4,
                        seats_available=seats, watermark_blocks=watermark)


def test_fcfs_under_token_budget_chunks_the_head_and_stops():
    a, b = make_seq(1, 10), make_seq(2, 10)
    choices = plan([a, b], budget=6)
    assert [(c.seq, c.num_tokens, c.new_blocks, c.starts) for c in choices] == [(a, 6, 2, True)]


def test_several_prompts_share_the_budget_in_arrival_order():
    a, b, c = make_seq(1, 5), make_seq(2, 5), make_seq(3, 5)
    choices = plan([a, b, c], budget=12)
    assert [(ch.seq.request.request_id, ch.num_tokens) for ch in choices] == [("r1", 5), ("r2", 5), ("r3", 2)]


def test_memory_limits_the_chunk_and_blocks_overtaking():
    a, b = make_seq(1, 20), make_seq(2, 2)
    choices = plan([a, b], free=2)
    assert [(c.seq, c.num_tokens) for c in choices] == [(a, 8)]
    assert plan([a, b], free=0) == []  # b must not overtake a


def test_watermark_applies_to_new_sequences_only():
    a = make_seq(1, 8)
    assert plan([a], free=2, watermark=1)[0].num_tokens == 4
    a.block_ids = [7]
    a.num_computed = 4
    assert plan([a], free=1, watermark=1, started=[a.seq_id])[0].num_tokens == 4


def test_seats_for_all_samples_are_needed_to_start():
    a = make_seq(1, 4, n=3)
    assert plan([a], seats=2) == []
    assert plan([a], seats=3)[0].starts


def test_prefill_victims_are_later_arrivals_latest_first():
    head, mid, late = make_seq(1, 8), make_seq(2, 8), make_seq(3, 8)
    mid.block_ids, late.block_ids = [1, 2], [3]
    assert prefill_victims([head, mid, late], 1, head) == [late]
    assert prefill_victims([head, mid, late], 3, head) == [late, mid]
    assert prefill_victims([head, mid, late], 4, head) == []  # cannot free enough: preempt nobody


def test_decode_victim_is_the_latest_arrival():
    a, b = make_seq(1, 4), make_seq(2, 4)
    assert decode_victim([a, b]) is b
    assert decode_victim([b, a]) is b


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
