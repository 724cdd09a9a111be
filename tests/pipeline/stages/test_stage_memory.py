"""How the step planner composes a step through the stages and the cache manager, without a model:
every decode row gets its slots (a lookahead of 1 for one with a step in flight; all or nothing
then), the latest arrival gives its blocks back when they run out, and a prompt at the head takes
memory back from later arrivals."""
from __future__ import annotations

from pipeline.memory.cache_manager import CacheManager
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.request import Request, SamplingParams
from pipeline.scheduler import SeatPool, WaitingGauge
from pipeline.sequence import Sequence
from pipeline.stage import Stage
from pipeline.stages.decode import DecodeStage, InFlightStep
from pipeline.stages.prefill import PrefillStage
from pipeline.step_planner import WAIT_FOR_STEP, ComposedStep, StepPlanner

BLOCK = 4


def make_seq(arrival: int, prompt_len: int, max_total_tokens: int = 1000) -> Sequence:
    request = Request(f"r{arrival}", list(range(prompt_len)), SamplingParams(seed=1), frozenset({2}),
                      max_total_tokens=max_total_tokens, arrival_seq=arrival)
    return Sequence.from_request(request)


def decoding(cache: CacheManager, arrival: int, prompt_len: int, **kwargs) -> Sequence:
    """A sequence whose prompt is computed and whose first token is pending (as prefill hands it over)."""
    seq = make_seq(arrival, prompt_len, **kwargs)
    assert cache.allocate_slots(seq, prompt_len)
    seq.num_computed = prompt_len
    seq.append_token(7)
    return seq


class FakeExecutor:
    """Records launched plans instead of running them."""

    def __init__(self) -> None:
        self.plans: list = []

    def launch(self, plan, lane: str) -> object:
        self.plans.append((plan, lane))
        return object()


def stages(num_blocks: int, token_budget: int = 64) -> tuple[DecodeStage, PrefillStage, StepPlanner, CacheManager]:
    cache, seats, executor = CacheManager(KVBlockPool(num_blocks, BLOCK)), SeatPool(16), FakeExecutor()
    planner = StepPlanner(cache=cache, seats=seats, executor=executor, token_budget=token_budget)
    decode = DecodeStage(16, planner=planner, cache=cache, seats=seats, executor=executor, detokenize=None)
    prefill = PrefillStage(16, waiting_gauge=WaitingGauge(100, 10_000), planner=planner, decode=decode, cache=cache,
                           seats=seats, executor=executor, detokenize=None)
    planner.bind(decode=decode, prefill=prefill)
    return decode, prefill, planner, cache


def decode_stage(num_blocks: int) -> tuple[DecodeStage, CacheManager, Stage, StepPlanner]:
    decode, prefill, planner, cache = stages(num_blocks)
    return decode, cache, prefill, planner


def compose(stage: DecodeStage, planner: StepPlanner, step: InFlightStep | None = None):
    stage.in_flight = step
    return planner.compose(rows_in_flight=step is not None)


def in_flight(*seqs: Sequence) -> InFlightStep:
    return InFlightStep(list(seqs), None, 0.0, {seq.seq_id: row for row, seq in enumerate(seqs)})


def covered(seq: Sequence) -> int:
    return len(seq.block_ids) * BLOCK


def test_decode_grows_every_sequence_for_its_next_token():
    stage, cache, _, planner = decode_stage(num_blocks=9)
    a, b = decoding(cache, 1, 8), decoding(cache, 2, 6)  # 9 tokens in 8 slots; 7 tokens in 8 slots
    stage.running = [a, b]
    composed = compose(stage, planner)
    assert isinstance(composed, ComposedStep) and composed.batch == [a, b]
    assert covered(a) == 12 and covered(b) == 8
    assert cache.num_used == 5 and stage.preemptions == 0


def test_decode_preempts_the_latest_arrival_for_earlier_ones():
    stage, cache, prefill, planner = decode_stage(num_blocks=8)  # 7 usable
    a, b, c = decoding(cache, 1, 8), decoding(cache, 2, 8), decoding(cache, 3, 4)  # 2 + 2 + 1 blocks
    d = decoding(cache, 4, 4)
    assert cache.num_free == 1
    stage.running = [d, c, b, a]  # each needs one more block; arrival order decides, not list order
    assert isinstance(compose(stage, planner), ComposedStep)
    assert [s.preemptions for s in (a, b, c, d)] == [0, 0, 1, 1]
    assert covered(a) == 12 and covered(b) == 12
    assert c.block_ids == [] and c.num_computed == 0 and d.block_ids == []
    assert stage.running == [b, a] and stage.preemptions == 2
    assert prefill.waiting == [c, d]  # d made room for b; then c had none and was the latest itself
    assert cache.num_free == 1  # c's block


def test_decode_preempts_the_sequence_itself_when_it_is_the_latest():
    stage, cache, prefill, planner = decode_stage(num_blocks=4)  # 3 usable
    a, b = decoding(cache, 1, 4), decoding(cache, 2, 7)  # a: 5 tokens in 4 slots; b: 8 in 8
    stage.running = [a, b]
    assert cache.num_free == 0
    assert isinstance(compose(stage, planner), ComposedStep)
    assert prefill.waiting == [b] and stage.running == [a]
    assert covered(a) == 8 and cache.num_free == 1


def test_a_row_in_flight_counts_its_device_token_as_a_lookahead_of_one():
    stage, cache, _, planner = decode_stage(num_blocks=9)
    a = decoding(cache, 1, 7)  # 8 tokens in 8 slots: the token in flight is the 9th
    b = decoding(cache, 2, 7)  # the same, but not in the step in flight (just arrived from prefill)
    stage.running = [a, b]
    assert compose(stage, planner, in_flight(a)).batch == [a, b]
    assert covered(a) == 12 and covered(b) == 8


def test_no_blocks_for_a_row_whose_token_in_flight_ends_it():
    stage, cache, _, planner = decode_stage(num_blocks=9)
    a = decoding(cache, 1, 7, max_total_tokens=9)  # the token in flight is its last
    stage.running = [a]
    assert compose(stage, planner, in_flight(a)) is None  # nothing to launch
    assert covered(a) == 8 and cache.num_used == 2


def test_with_a_step_in_flight_it_allocates_all_or_nothing():
    stage, cache, prefill, planner = decode_stage(num_blocks=6)  # 5 usable
    a, b = decoding(cache, 1, 7), decoding(cache, 2, 7)  # 2 blocks each, each needs 1 more ahead
    assert cache.num_free == 1
    stage.running = [a, b]
    before = (list(a.block_ids), list(b.block_ids))
    assert compose(stage, planner, in_flight(a, b)) is WAIT_FOR_STEP  # the caller reads the step first
    assert (a.block_ids, b.block_ids) == before and cache.num_free == 1
    assert stage.preemptions == 0 and prefill.waiting == []


def test_prefill_plans_with_the_cache_and_takes_memory_back_for_its_head():
    decode, stage, planner, cache = stages(num_blocks=6)  # 5 usable
    head, late = make_seq(1, 12), make_seq(2, 20)
    assert cache.allocate_slots(late, 8)  # a later arrival's first chunk holds 2 blocks
    late.num_computed = 8
    assert cache.allocate_slots(make_seq(3, 12), 12)  # another stage holds the other 3
    stage.waiting = [head, late]
    stage.started = {late.seq_id}
    stage.seats.acquire(1)
    assert isinstance(planner.compose(rows_in_flight=False), ComposedStep)
    assert late.block_ids == [] and late.num_computed == 0  # released: the head comes first
    assert [(seq, tokens) for seq, tokens, _ in stage.grant.chunks] == [(head, 4)]  # one block kept free (watermark)
    assert len(head.block_ids) == 1 and cache.num_free == 1
    (plan, lane), = planner.executor.plans
    assert lane == "prefill" and plan.forward.num_tokens == 4 and plan.num_rows == 0


def test_a_prompt_joins_the_decode_rows_under_one_budget():
    decode, prefill, planner, cache = stages(num_blocks=20, token_budget=6)
    a, b = decoding(cache, 1, 8), decoding(cache, 2, 5)
    decode.running = [a, b]
    prompt = make_seq(3, 10)
    prefill.waiting = [prompt]
    composed = compose(decode, planner)
    assert composed.batch == [a, b]
    (plan, lane), = planner.executor.plans
    assert lane == "decode" and plan.forward.query_start_loc.tolist() == [0, 1, 2, 6]  # 2 rows + 4 prompt tokens
    assert prefill.grant is not None and prefill.grant.first_row == 2
    assert compose(decode, planner, in_flight(a, b)).batch == [a, b]  # its chunk is in flight: rows only
    assert planner.executor.plans[-1][0].forward.num_tokens == 2


def test_prefill_wakes_when_the_cache_frees_blocks():
    _, stage, _, cache = stages(num_blocks=6)
    seq = make_seq(1, 4)
    assert cache.allocate_slots(seq, 4)
    assert not stage._wake.is_set()
    cache.free(seq)
    assert stage._wake.is_set()
