"""The decode stage: the continuous batch. Every running sequence advances one token per step.

Steps run back to back while anything runs, one step ahead: step N+1 is launched before the host
reads step N's tokens, feeding them to N+1 on the device, so the host's bookkeeping (and the
detokenizer's, and the streams') hides behind the device's work. A sequence that turns out to end
at step N wasted one row of step N+1; that row is dropped when it arrives. Requests whose next
token depends on the values of earlier ones on the host (penalties, min_tokens still pending)
make the stage wait for step N before launching N+1.

Before each launch it applies cancellations (the sequence ends and frees its blocks at once;
stopping is never just hiding output), then asks the step planner (pipeline/step_planner.py) for
the step: its rows, each with the cache's slots for its next token, beside any prompt chunks that
fit. When blocks run out the latest arrival goes back to prefill, but never a row of the step in
flight: then the stage reads that step first and asks again. Freeing blocks a launched step still
writes is safe: every later use of a block is a later step on the same device stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.messages import StepTokensBuilder
from pipeline.runner.executor import LaunchedStep
from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner.step_plan import ScheduledChunk
from pipeline.scheduler import RunningRow
from pipeline.spec.acceptance import SpecStats, accepted_drafts
from pipeline.spec.budget import DraftBudget
from pipeline.spec.device_drafts import DeviceDrafts
from pipeline.spec.drafter import Drafter
from pipeline.sequence import Sequence
from pipeline.stages.device_stage import OWN_GRAMMAR, DeviceStage
from pipeline.stages.verify import VerifyStage
from pipeline.step_planner import WAIT_FOR_STEP, ComposedStep, StepPlanner


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    batch: list[Sequence]  # in row order: each sequence's next token, then one row per draft of it (speculation)
    step: LaunchedStep
    launched_at: float
    rows: dict[int, int]  # seq_id -> row (steps without drafts: what the next step feeds from the device)
    drafts: list[list[int]] | None = None  # per sequence of the batch: the drafts its rows verify
    # per sequence with drafts: (tokens it feeds before its last one; filler drafts at the end)
    layout: list[tuple[int, int]] | None = None
    # drafts the rows took from the device (their placeholders in ``drafts`` are filled once the step is read), and
    # each such sequence's row in them
    device_drafts: DeviceDrafts | None = None
    fed_rows: dict[int, int] | None = None


def _needs_draft_values(seq: Sequence) -> bool:
    """Its verify rows' sampling depends on the drafts' values (what ``DecodeStage._verify_rows`` sets after them:
    penalty counts, a grammar's masks, a thinking budget's forced token): its drafts are read before its step is
    planned."""
    return seq.token_counts is not None or seq.grammar is not None or seq.thinking is not None


def _last_token_in_flight(seq: Sequence) -> bool:
    """The token the step in flight picks for `seq` surely ends it (its length limit)."""
    return len(seq.token_ids) + 1 >= seq.request.max_total_tokens


class DecodeStage(DeviceStage):
    name = "decode"

    def __init__(self, inbox_size: int, *, planner: StepPlanner, run_ahead: bool = True,
                 verify: VerifyStage | None = None, num_speculative_tokens: int = 0, draft_token_cost: float = 0.0,
                 **resources) -> None:
        super().__init__(inbox_size, **resources)
        self.planner = planner
        self.verify = verify  # speculation: where drafts come from (a row feeds them, and samples at each)
        drafter = verify.drafter if verify is not None else None
        self.draft_budget = DraftBudget(num_speculative_tokens if drafter is not None else 0,
                                        token_cost=draft_token_cost)
        self.spec = SpecStats(accepted_per_row=[0] * (self.draft_budget.k + 1))
        self._drafts: dict[int, list[int]] = {}  # seq_id -> drafts offered for the step being composed
        self._fillers: dict[int, int] = {}  # seq_id -> how many of its drafts are fillers (``_fill_rows``)
        self._device_drafts: DeviceDrafts | None = None  # the drafts offered, when left on the device
        self._fed_rows: dict[int, int] = {}  # seq_id -> its row in them
        self.running: list[Sequence] = []
        self.run_ahead = run_ahead
        self.preemptions = 0
        self.steps_ahead = 0  # steps launched while the previous one was still in flight
        self.in_flight: InFlightStep | None = None  # the launched step whose tokens are unread

    @property
    def drafter(self) -> Drafter | None:
        return self.verify.drafter if self.verify is not None else None

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:  # (benchmarks and tests swap drafters)
        assert self.verify is not None
        self.verify.drafter = drafter

    async def run(self) -> None:
        while True:
            in_flight = self.in_flight
            if not self.running and in_flight is None:
                self.planner.set_decode_drives(False)
                self.running.append(await self.receive())
            self.planner.set_decode_drives(True)
            self.running.extend(self.receive_ready())
            events = StepTokensBuilder()
            output: SamplerOutput | None = None
            reads_own_tokens = self._reap_cancelled(events)
            # a row's drafts follow its last token, which the host must have read: no running ahead while rows draft
            drafting = (self.drafter is not None and self.draft_budget.for_step(len(self.running)) > 0
                        and DraftBudget.tick(self.running))
            # nor ahead of a verify step: how many tokens its rows add is known once it is read
            can_run_ahead = (self.run_ahead and not drafting and not reads_own_tokens
                             and (in_flight is None or in_flight.drafts is None))
            if in_flight is not None and not can_run_ahead:
                output = await self._complete(in_flight, events)
                in_flight = None
            self.in_flight = in_flight  # what offer_rows/build_rows read
            launched: InFlightStep | None = None
            self._drafts.clear()
            self._fillers.clear()
            self._device_drafts = None
            self._fed_rows.clear()
            if self.drafter is not None and self.running and in_flight is None:
                if drafting:
                    await self._draft()
                self._fill_rows()
            if self.running:
                composed = self.planner.compose(rows_in_flight=in_flight is not None)
                if composed is WAIT_FOR_STEP:  # the rows fit only once the step in flight is read
                    assert in_flight is not None
                    output = await self._complete(in_flight, events)
                    in_flight = self.in_flight = None
                    composed = self.planner.compose(rows_in_flight=False)
                if isinstance(composed, ComposedStep) and composed.batch:
                    self.steps_ahead += in_flight is not None
                    drafts = layout = None
                    if self._drafts or self._fillers:
                        drafts = [self._drafts.get(seq.seq_id, []) for seq in composed.batch]
                        layout = [(seq.num_pending - 1, self._fillers.get(seq.seq_id, 0))
                                  if d or seq.seq_id in self._fillers else (0, 0)
                                  for seq, d in zip(composed.batch, drafts)]
                    launched = InFlightStep(composed.batch, composed.step, time.monotonic(),
                                            {seq.seq_id: i for i, seq in enumerate(composed.batch)}, drafts, layout,
                                            self._device_drafts, dict(self._fed_rows) if self._fed_rows else None)
            if in_flight is not None:
                output = await self._complete(in_flight, events)
            self.in_flight = launched
            await self.emit(events, output)

    def _reap_cancelled(self, events: StepTokensBuilder) -> bool:
        """Finish the cancelled sequences; returns whether a remaining one reads its own tokens (then
        the stage may not run ahead). One pass, per sequence per step: two cheap screens first (a
        set flag, and what could make a sequence read its tokens: a thinking budget, penalties, which
        come with token counts, or min_tokens), the exact checks only past them."""
        keep: list[Sequence] = []
        reads_own_tokens = False
        for seq in self.running:
            request = seq.request
            flag = request.cancel
            if flag.reason is not None or flag.children:
                reason = seq.cancel_reason()
                if reason is not None:
                    self.finish(seq, reason, events)
                    continue
            keep.append(seq)
            if (seq.thinking is not None or seq.token_counts is not None or request.params.min_tokens) \
                    and seq.reads_own_tokens:
                reads_own_tokens = True
        self.running = keep
        return reads_own_tokens

    # --- what the planner asks -------------------------------------------------------------------
    def _ahead(self, seq: Sequence) -> int:
        """Tokens of `seq` sampled in the step in flight, not yet read: -1 when that token surely ends
        it (nothing to launch for it)."""
        in_flight = self.in_flight
        if in_flight is None or seq.seq_id not in in_flight.rows:
            return 0
        return -1 if _last_token_in_flight(seq) else 1

    def offer_rows(self, exact_release: bool = False) -> list[RunningRow]:
        """Every running sequence's next row: its pending tokens, plus the one in flight (a lookahead:
        the step samples it on the device and the next step feeds it from there). What preempting a row gives back
        is its block count, or with ``exact_release`` the blocks it holds alone (counted only when the planner is
        about to preempt: a shared prefix block stays with its other holders)."""
        cache = self.cache
        held = cache.blocks_released if exact_release else lambda seq: len(seq.block_ids)
        rows: list[RunningRow] = []
        for seq in self.running:
            ahead = self._ahead(seq)
            if ahead < 0:
                continue
            drafts = self._drafts.get(seq.seq_id, ()) if self._drafts else ()
            rows.append(RunningRow(seq.seq_id, seq.arrival, seq.num_pending + len(drafts),
                                   cache.blocks_needed(seq, seq.num_pending + len(drafts), ahead), held(seq)))
        return rows

    async def _draft(self) -> None:
        """Drafts for the step being composed (``_drafts``): up to the budget's count for every sequence whose turn
        it is (pipeline/spec/budget.py), no more than its length limit leaves room for after its next token. A hybrid
        model's sequence drafts no more than it has spare state slots for (``CacheManager.keep_states``). A model
        drafter writes KV at the drafts' positions, so their slots are allocated first (a sequence whose blocks do
        not fit does not draft)."""
        drafter, cache, budget = self.drafter, self.cache, self.draft_budget
        limit, priced = budget.for_step(len(self.running)), budget.priced(len(self.running))
        wanted: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.draft_wait or seq.num_pending != 1:
                continue
            k = min(budget.for_sequence(limit, seq.draft_acceptance, priced),
                    seq.request.max_total_tokens - len(seq.token_ids) - 1)
            if seq.state_slot is not None:
                k = min(k, cache.keepable(seq))
            if k > 0 and (not drafter.on_device or cache.allocate_slots(seq, seq.num_pending + k)):
                wanted.append((seq, k))
        if not wanted:
            return
        # a model drafter's drafts stay on the device unless a row's sampling needs their values
        proposals = await self.verify.drafts(wanted, not any(_needs_draft_values(seq) for seq, _ in wanted))
        if isinstance(proposals, DeviceDrafts):  # (as many for every sequence; placeholders until read)
            self._device_drafts = proposals
            for row, (seq, _) in enumerate(wanted):
                self._drafts[seq.seq_id] = [seq.token_ids[-1]] * proposals.width
                self._fed_rows[seq.seq_id] = row
            return
        for (seq, k), drafts in zip(wanted, proposals):
            if drafts:
                self._drafts[seq.seq_id] = list(drafts[:k])
            else:
                DraftBudget.settle(seq, 0, 0)  # nothing to offer: wait before asking again

    def _fill_rows(self) -> None:
        """Rows of one length where it is safe: a CUDA graph serves only rows of one length, and an eager step of a
        large model costs tens of milliseconds of kernel launches. In a step with drafts, a row without recurrent
        state gets filler drafts (its last token again, now and then right) up to K + 1 tokens, verified like
        drafts and counted apart from the drafter's (a hybrid model's row as far as it has spare state slots for). A
        row feeding more than one token takes logits at every one."""
        if not self._drafts and all(seq.num_pending == 1 for seq in self.running):
            return
        k = self.draft_budget.for_step(len(self.running))
        if self.draft_budget.priced(len(self.running)):  # a filler costs as much as a draft: rows of one length only
            k = max(seq.num_pending + len(self._drafts.get(seq.seq_id, [])) for seq in self.running) - 1
        for seq in self.running if k else ():
            drafts = self._drafts.get(seq.seq_id, [])
            fill = min(k + 1 - seq.num_pending - len(drafts),
                       seq.request.max_total_tokens - len(seq.token_ids) - 1 - len(drafts))
            if seq.state_slot is not None:
                fill = min(fill, self.cache.keepable(seq) - len(drafts))
                if seq.num_pending > 1 and fill <= 0:
                    self._fillers[seq.seq_id] = 0
            if fill > 0:
                self._drafts[seq.seq_id] = drafts + [seq.token_ids[-1]] * fill
                self._fillers[seq.seq_id] = fill

    def preempt_now(self, seq_id: int) -> Sequence:
        """Resume later: give the KV back (swapped to host, or to be recomputed), keep the tokens and the seat;
        the planner hands it to prefill."""
        seq = next(s for s in self.running if s.seq_id == seq_id)
        self.running.remove(seq)
        self.cache.preempt(seq)  # swapped to host where the cache has a host tier with room
        seq.num_samples = 1
        seq.preemptions += 1
        self.preemptions += 1
        if self.trace.recording:
            self.trace.preempted(seq)
        return seq

    def build_rows(self, seq_ids: tuple[int, ...]) -> tuple[list[Sequence], list[ScheduledChunk]]:
        """Slots and chunks for the chosen rows (arrival order from the planner; run in running order)."""
        chosen = set(seq_ids)
        rows = self.in_flight.rows if self.in_flight is not None else {}
        batch: list[Sequence] = []
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            if seq.seq_id not in chosen:
                continue
            row = rows.get(seq.seq_id, -1)
            drafts = self._drafts.get(seq.seq_id, [])
            keeps = None
            if drafts and seq.state_slot is not None:
                kept = self.cache.keep_states(seq, seq.num_pending - 1 + len(drafts))
                if kept is None:  # no spare slots after all: no drafts
                    drafts = self._drafts[seq.seq_id] = []
                    self._fillers.pop(seq.seq_id, None)
                else:  # the state after each token but the last
                    keeps = kept + [-1]
            if not self.cache.allocate_slots(seq, seq.num_pending + len(drafts),
                                             1 if row >= 0 else 0):
                raise RuntimeError("the planner counted blocks the cache does not have")
            num_tokens = len(seq.token_ids)
            if drafts or seq.seq_id in self._fillers:  # pending tokens and drafts, a pick after each (a verify row)
                known = seq.num_pending - 1  # tokens before its last one: their picks are not read
                fed = self._fed_rows.get(seq.seq_id) if drafts else None
                if fed is not None:  # its drafts (then any fillers) are fed from the device
                    width = self._device_drafts.width
                    fed = (self._device_drafts, num_tokens - seq.num_computed, fed * width, width)
                chunk = ScheduledChunk(seq.token_ids[seq.num_computed:] + drafts, seq.num_computed, seq.block_ids,
                                       [self.sampling_row(seq, None, 0, None) for _ in range(known)]
                                       + self._verify_rows(seq, drafts), -1, list(range(known + len(drafts) + 1)),
                                       seq.state_slot, keeps, fed)
            elif row >= 0:  # its token is still on the device: feed it from there
                # positional arguments: this runs per sequence per step, and keywords cost more
                chunk = ScheduledChunk([0], num_tokens, seq.block_ids,
                                       [self.sampling_row(seq, None, 1, OWN_GRAMMAR, row)], row, None, seq.state_slot)
            else:
                chunk = ScheduledChunk(seq.token_ids[seq.num_computed:], seq.num_computed, seq.block_ids,
                                       [self.sampling_row(seq)], -1, None, seq.state_slot)
            batch.append(seq)
            chunks.append(chunk)
        return batch, chunks

    def _verify_rows(self, seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
        """The sampling rows after the last token and after each draft, each as plain decoding would have it if the
        drafts before it were accepted: its output position (the random key, min_tokens), with penalties the counts
        with those drafts added, with a grammar the mask after them (``fill_draft_rows``), with a thinking budget the
        token it forces after them."""
        rows = [self.sampling_row(seq, None, i) for i in range(len(drafts) + 1)]
        for i in range(1, len(rows)):
            before = drafts[:i]
            if seq.token_counts is not None:
                rows[i].counts = seq.token_counts.with_tokens(before)
            if seq.grammar is not None:
                rows[i].grammar_drafts = tuple(before)
            if seq.thinking is not None:
                rows[i].forced_token = seq.thinking.forced_after(before)
        return rows

    async def _complete(self, in_flight: InFlightStep, events: StepTokensBuilder) -> SamplerOutput:
        """Read a step's tokens and record them; rows of sequences that ended meanwhile are dropped."""
        output = await self.executor.fetch(in_flight.step)
        tokens = output.token_ids.tolist()
        if in_flight.device_drafts is not None:
            self._read_device_drafts(in_flight)
        if in_flight.drafts is not None:
            self._complete_verify(in_flight, tokens, events)
        block_size = self.cache.block_size
        for row, seq in enumerate(in_flight.batch if in_flight.drafts is None else ()):
            if seq.finish_reason is not None:
                continue  # ended by the previous step or cancelled while this one ran
            before = seq.num_computed
            seq.num_computed = len(seq.token_ids)  # the row fed its pending tokens
            if seq.num_computed // block_size != before // block_size:  # a block filled: the prefix cache may key it
                self.cache.register_computed(seq)
            self.record_token(seq, tokens[row], row, events)
        self.running = [seq for seq in self.running if seq.finish_reason is None]
        batch_size = len(in_flight.batch)
        self.record(in_flight.launched_at, batch_size, batch_size)
        return output

    def _read_device_drafts(self, in_flight: InFlightStep) -> None:
        """The drafts the step took from the device, in place of their placeholders (their copy to the host was
        queued before the step, so it is done)."""
        device_drafts, fed_rows = in_flight.device_drafts, in_flight.fed_rows
        values, width = device_drafts.values(), device_drafts.width
        for seq, drafts in zip(in_flight.batch, in_flight.drafts):
            row = fed_rows.get(seq.seq_id)
            if row is not None and drafts:
                drafts[:width] = values[row]
                self.spec.device_drafts += width

    def _complete_verify(self, in_flight: InFlightStep, tokens: list[int], events: StepTokensBuilder) -> None:
        """A step of verify rows: each sequence takes its accepted drafts and the pick after them
        (pipeline/spec/acceptance.py). The KV of the rejected drafts stays past ``num_computed`` and is written over
        by the next steps. A hybrid model's recurrent state cannot be trimmed that way: the row kept it after each
        token in spare slots, and on a rejection the one after the last accepted token goes back into the
        sequence's slot."""
        block_size, spec = self.cache.block_size, self.spec
        accepts_all = self.drafter is not None and self.drafter.accepts_all
        row = 0
        for seq, drafts, (known, fillers) in zip(in_flight.batch, in_flight.drafts, in_flight.layout):
            first, row = row + known, row + known + len(drafts) + 1
            if seq.finish_reason is not None:
                continue  # ended by the previous step or cancelled while this one ran
            accepted = accepted_drafts(drafts, tokens, first, accepts_all)
            proposed = len(drafts) - fillers  # the drafter's; the fillers follow them
            spec.count_row(proposed, fillers, accepted)
            seq.request.count_drafts(proposed, min(accepted, proposed))
            if proposed:
                self.draft_budget.after_row(seq, proposed, min(accepted, proposed),
                                            self.draft_budget.priced(len(in_flight.batch)))
            before = seq.num_computed
            if seq.state_slot is not None and accepted < len(drafts):
                # hybrid: the state went past the rejected drafts; the one kept after the last accepted token
                self.cache.restore_kept(seq, known + accepted)
            seq.num_computed = len(seq.token_ids) + accepted  # its pending tokens and the accepted drafts
            if seq.num_computed // block_size != before // block_size:  # a block filled: the prefix cache may key it
                self.cache.register_computed(seq)
            for i in range(accepted + 1):  # the drafts taken (equal to the picks, unless forced), then the next pick
                if not self.record_token(seq, drafts[i] if i < accepted else tokens[first + i], first + i, events):
                    break

