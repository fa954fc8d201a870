"""Scheduler: who runs this step, with one token budget and no separate prefill or decode phases.

Running sequences go first, each taking what it still needs (one token for a decode, the next chunk of
a prompt); when blocks run out the most recently admitted running sequence is preempted (blocks freed,
recomputed later from the head of the waiting queue). Waiting sequences are then admitted in order
while the budget, `max_num_seqs` and free blocks allow, reusing cached prefix blocks. Without chunked
prefill a prompt is only admitted when it fits the budget whole.

`max_num_seqs` counts every sequence a running request will run, as vLLM does: a request with n outputs
takes n seats when its prompt is admitted (its other outputs fork off it later), a beam search takes
beam_width; a request that does not fit waits. So the running list, and the sampler's rows (profiled at
max_num_seqs), never exceed the cap.

With `max_batch_prefill_tokens`, a step that decodes anything computes at most that many prompt tokens
(summed over the prompt chunks it schedules): every running stream waits for the whole step, so this
bounds how much an arriving prompt delays the streams' next token while decodes keep the full budget.
A step with no decode gives prompts the whole budget (nobody is waiting on a token).

With the "priority" policy (vLLM's), the waiting queue is kept in (priority, arrival) order, lower first,
and the running sequence preempted when blocks run out is the one latest in that order instead of the
most recently admitted.

With the prefix cache's CPU-RAM tier, a waiting sequence whose prefix hit is partly in the tier is admitted for
loading: it takes its blocks (fresh ones for the tier's part, whose copies are queued) and a seat, but no tokens,
and waits in `loading` until the copies of its batch have run (never scheduled, never preempted: its blocks are
being written); then it goes back to the head of the queue as a sequence with computed tokens and runs like one.
A loading sequence that is aborted keeps its blocks until its copies have run.

A prompt with images (engine/multimodal) also spends the step's encoder budget: a chunk that reaches an image
whose embeddings the worker does not hold yet asks for its encoding (`SchedulerOutput.encoder`), and stops before
an image that does not fit what is left of the budget or the encoder cache (it is encoded in a later step). For
a model whose image tokens attend to each other both ways (Gemma), a chunk never ends inside an image.

A running sequence whose request is `paused` (its caller stopped reading) is skipped: it keeps its blocks
and resumes when the caller reads again, unless a waiting sequence needs its blocks or its seat (then it
is preempted to the back of the queue); a paused sequence in the queue is not admitted until it resumes.

Under async scheduling the engine schedules step N+1 before step N's results: `launched` counts step N's
tokens as computed at once and gives each sampling sequence a token on its way (`num_pending`), which its next
decode takes as input on the device; a sequence whose token on its way is its last (max_tokens, max_model_len)
is not scheduled again, and one preempted with a token on its way waits in the queue until it has arrived.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.kv.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence, SequenceStatus
from engine.multimodal.encoder_cache import EncoderCacheManager, EncoderWork
from engine.multimodal.inputs import MultiModalItem

logger = logging.getLogger("pagedesk.engine")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    is_prefill: bool = False  # a prompt (or recompute) chunk, not the one-token step of a decode
    num_draft_tokens: int = 0  # speculative drafts verified after the decode token (in num_new_tokens)
    num_accepted: int = 0  # of them, kept this step (set by the output processor)
    num_pending: int = 0  # async scheduling: its last token is still on the device (fed there, not by the host)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last known token, so its logits are sampled (never for an
        embedding request: it is pooled instead)."""
        if self.seq.request.pooling is not None:
            return False
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == seq.num_tokens + self.num_pending


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # hybrid models: forks' state slots
    too_long: list[Sequence] = field(default_factory=list)  # can never fit the pool: finish as "length"
    kv_transfers: object = None  # KVTransfers: the CPU-RAM tier's copies and the forward's fence (None: neither)
    encoder: EncoderWork = field(default_factory=EncoderWork)  # images to encode (and entries to drop) first
    counted: bool = False  # its tokens were counted as computed at launch (async scheduling: `launched`)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, max_batch_prefill_tokens: int | None = None,
                 policy: str = "fcfs", encoder: EncoderCacheManager | None = None,
                 whole_images: bool = False) -> None:
        """`encoder`: a vision-language model's encoder cache; `whole_images`: never cut a chunk inside an image."""
        self.kv = kv
        self.encoder, self.whole_images = encoder, whole_images
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.max_batch_prefill_tokens = max_batch_prefill_tokens if enable_chunked_prefill else None
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # waiting for their prefix's copies from the CPU-RAM tier
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float]:
        return seq.request.priority, seq.request.arrival_time

    def _insert_waiting(self, seq: Sequence) -> None:
        """Before the first waiting sequence that ranks after it (equal ranks keep arrival order)."""
        rank = self._rank(seq)
        index = next((i for i, other in enumerate(self.waiting) if self._rank(other) > rank), len(self.waiting))
        self.waiting.insert(index, seq)

    def _pop_victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted, or under the priority policy the one
        ranked last."""
        if not self.by_priority:
            return self.running.pop()
        victim = max(reversed(self.running), key=self._rank)  # reversed: among equals, the latest admitted
        self.running.remove(victim)
        return victim

    @staticmethod
    def _width(seq: Sequence) -> int:
        """How many sequences the request of `seq` runs at most: its beams, or its n outputs."""
        request = seq.request
        return request.beam.params.beam_width if request.beam is not None else request.params.n

    def _num_seats(self) -> tuple[int, set[str]]:
        """Seats the running sequences hold (each one, plus the sequences its request will still fork into),
        and the requests already counted."""
        seats, counted = len(self.running) + len(self.loading), set()
        for seq in self.running + self.loading:
            request = seq.request
            if request.request_id not in counted:
                counted.add(request.request_id)
                seats += self._unforked(seq)
        return seats, counted

    def _unforked(self, seq: Sequence) -> int:
        """Sequences the request of `seq` will still fork into (the sequence itself is one of its own)."""
        return max(0, self._width(seq) - max(1, len(seq.request.seqs)))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loading:
            self._finish_loads()
        preempted = self._schedule_running(out, self.max_num_batched_tokens)
        if not preempted:
            self._schedule_waiting(out, self.max_num_batched_tokens - out.num_tokens, self._prefill_left(out))
        if self.encoder is not None and out.scheduled:  # a step that runs nothing drops nothing yet
            out.encoder.free = self.encoder.take_frees()
        out.block_copies = self.kv.take_copies()
        if out.scheduled:  # a step that runs nothing applies no copy: they wait for the next forward
            out.state_copies = self.kv.take_state_copies()
        if self.kv.offload is not None:
            out.kv_transfers = self.kv.offload.take(forward=bool(out.scheduled))
        return out

    def _finish_loads(self) -> None:
        """Loading sequences whose copies have run go back to the head of the queue (their blocks now findable, the
        coming forward fenced on their batch on every rank); aborted ones give their blocks back."""
        done = self.kv.offload.completed if self.kv.offload is not None else 0
        ready = [s for s in self.loading if s.kv_load_batch <= done]
        if not ready:
            return
        self.loading = [s for s in self.loading if s.kv_load_batch > done]
        for seq in reversed(ready):  # appendleft: the first ready ends up first
            self.kv.offload.require(seq.kv_load_batch)
            if seq.is_finished:
                self.kv.free(seq)
                continue
            self.kv.finish_load(seq)
            if self.by_priority:
                self._insert_waiting(seq)
            else:
                self.waiting.appendleft(seq)

    def _prefill_left(self, out: SchedulerOutput) -> int | None:
        """Prompt tokens this step may still take, or None for no cap: capped once a decode is in the step."""
        if self.max_batch_prefill_tokens is None or all(item.is_prefill for item in out.scheduled):
            return None
        return self.max_batch_prefill_tokens - sum(i.num_new_tokens for i in out.scheduled if i.is_prefill)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        """Decodes first, then prompt chunks of running sequences; preempt from the tail when out of blocks."""
        preempted = False
        picked: dict[int, ScheduledSeq] = {}
        decodes, chunks = [], []
        for s in self.running:
            left = len(s.token_ids) + s.num_pending - s.num_computed_tokens
            if s.num_pending and len(s.token_ids) + s.num_pending >= s.request.max_num_tokens:
                continue  # the token on its way is its last: it ends as "length" when that arrives
            if left and not s.request.paused:  # paused: its caller is not reading; it keeps its blocks
                (decodes if left == 1 else chunks).append((s, left))
        prefill_left = None
        for i, (seq, left) in enumerate(decodes + chunks):
            if i == len(decodes):
                prefill_left = self._prefill_left(out)
            if budget <= 0 or prefill_left is not None and prefill_left <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(left, budget) if prefill_left is None else min(left, budget, prefill_left)
            images = []
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # past its prompt: no image, no snapshot to align
                num_new = self._snapshot_aligned(seq, seq.num_computed_tokens, num_new)
                num_new, images = self._fit_images(seq, seq.num_computed_tokens, num_new, out)
                if not num_new:
                    continue  # its next image waits for encoder room
            drafts = 0
            if left == 1 and seq.spec_token_ids:  # a decode with speculative drafts: 1 + k query tokens
                drafts = min(len(seq.spec_token_ids), budget - 1)
                del seq.spec_token_ids[drafts:]
                num_new += drafts
            while not self.kv.allocate_slots(seq, num_new - drafts, num_lookahead_tokens=drafts):
                if drafts:  # out of blocks: the drafts go before anyone is preempted
                    num_new, drafts, seq.spec_token_ids = num_new - drafts, 0, []
                    continue
                preempted = True
                victim = self._pop_victim()
                if victim.seq_id in picked:  # scheduled earlier this step: give its tokens back
                    undone = picked.pop(victim.seq_id)
                    out.scheduled.remove(undone)
                    budget += undone.num_new_tokens
                    if undone.is_prefill and prefill_left is not None:
                        prefill_left += undone.num_new_tokens
                if victim is seq and not self.running:  # alone and still no room: it can never fit the pool
                    self._warn_too_long(seq, seq.num_computed_tokens, num_new)
                    self.kv.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    out.too_long.append(seq)
                    self._release_images(seq, finished=True)
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                if images:
                    self._encode(seq, images, out)
                picked[seq.seq_id] = ScheduledSeq(seq, num_new, is_prefill=left > 1, num_draft_tokens=drafts,
                                                  num_pending=seq.num_pending)
                out.scheduled.append(picked[seq.seq_id])
                budget -= num_new
                if prefill_left is not None and left > 1:
                    prefill_left -= num_new
        return preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, prefill_left: int | None) -> None:
        if not self.waiting:  # the common decode step: no seat count to make
            return
        if prefill_left is not None:
            budget = min(budget, prefill_left)
        seats, counted = self._num_seats()
        rotated = 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # Preempted while its caller was not reading: it waits until it reads (or, under async scheduling,
            # until the token that was on its way when it was preempted has arrived).
            if seq.request.paused or seq.num_pending:
                if rotated >= len(self.waiting):
                    break
                self.waiting.rotate(-1)
                rotated += 1
                continue
            request_id = seq.request.request_id
            need = 1 if request_id in counted else 1 + self._unforked(seq)
            if seats + need > self.max_num_seqs:
                if self._preempt_paused(out):  # a stalled reader's seat goes to one that reads
                    seats, counted = self._num_seats()
                    continue
                break
            computed = self.kv.get_computed_blocks(seq)
            if computed and computed.needs_copies:
                if self.kv.allocate_slots(seq, 0, computed):  # its tier blocks are copied in; it waits for them
                    self.waiting.popleft()
                    self.loading.append(seq)
                    seats += need
                    counted.add(request_id)
                    continue
                computed = self.kv.get_computed_blocks(seq, use_tier=False)  # no room for the copies: compute
            num_new = seq.num_tokens - seq.num_computed_tokens - len(computed) * self.kv.block_size
            if num_new > budget:
                if not self.chunked:
                    break
                num_new = budget
            start = seq.num_computed_tokens + len(computed) * self.kv.block_size
            num_new = self._snapshot_aligned(seq, start, num_new)
            full = num_new
            num_new, images = self._fit_images(seq, start, num_new, out)
            if not num_new or num_new < full and not self.chunked:
                break  # its images wait for encoder room; the queue keeps its order
            if not self.kv.allocate_slots(seq, num_new, computed):
                if self._preempt_paused(out):
                    seats, counted = self._num_seats()
                    continue  # a stalled reader's blocks go to one that reads
                if self.running or out.scheduled or self.loading:
                    break
                self.waiting.popleft()  # the whole pool is free and it still does not fit
                self._warn_too_long(seq, seq.num_computed_tokens + len(computed) * self.kv.block_size, num_new)
                seq.status = SequenceStatus.FINISHED
                out.too_long.append(seq)
                self._release_images(seq, finished=True)
                continue
            self.waiting.popleft()
            self._encode(seq, images, out)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += need
            counted.add(request_id)
            out.scheduled.append(ScheduledSeq(seq, num_new, is_prefill=True))
            budget -= num_new

    def _fit_images(self, seq: Sequence, start: int, num_new: int,
                    out: SchedulerOutput) -> tuple[int, list[MultiModalItem]]:
        """The chunk [start, start + num_new) cut before the first image it cannot take (no encoder budget or cache
        room left this step; or, with whole images, one it would end inside), and the images it must encode."""
        mm = getattr(seq.request, "mm", None)
        if mm is None or not mm.items or self.encoder is None:
            return num_new, []
        stop, chosen, spent = start + num_new, [], sum(i.num_embeds for i in out.encoder.encode)
        request_id = seq.request.request_id
        scheduled = {i.mm_hash for i in out.encoder.encode}
        for item in mm.items:
            if item.offset >= stop:
                break
            if item.end <= start:
                continue
            if self.whole_images and stop < item.end:
                stop = max(start, item.offset)
                break
            if self.encoder.is_cached(item.mm_hash) or item.mm_hash in scheduled:
                self.encoder.hold(request_id, item.mm_hash)
                continue
            pending = sum(i.num_embeds for i in chosen)
            if not self.encoder.can_encode(item, self.encoder.budget - spent - pending, pending):
                stop = max(start, item.offset)
                break
            chosen.append(item)
            scheduled.add(item.mm_hash)
        return stop - start, chosen

    def _encode(self, seq: Sequence, images: list[MultiModalItem], out: SchedulerOutput) -> None:
        """A scheduled chunk's new images: their cache entries reserved, their encodings asked for this step."""
        for item in images:
            self.encoder.allocate(seq.request.request_id, item)
            out.encoder.encode.append(item)

    def _release_images(self, seq: Sequence, finished: bool = False) -> None:
        """A request lets go of the images its computed tokens have passed (all of them once it finishes)."""
        mm = getattr(seq.request, "mm", None)
        if mm is None or self.encoder is None:
            return
        for item in mm.items:
            if finished or item.end <= seq.num_computed_tokens:
                self.encoder.release(seq.request.request_id, item.mm_hash)

    def _snapshot_aligned(self, seq: Sequence, start: int, num_new: int) -> int:
        """A hybrid model with prefix caching keeps state snapshots only where a step ends on a block boundary:
        a prompt chunk that would end past one stops at the last boundary inside the prompt (its tail runs in
        the next step), so the prompt's last full block gets a snapshot."""
        if not self.kv.num_snapshot_slots:
            return num_new
        bs = self.kv.block_size
        aligned = min(start + num_new, seq.num_prompt_tokens) // bs * bs
        return aligned - start if start < aligned < start + num_new else num_new

    def _warn_too_long(self, seq: Sequence, num_computed: int, num_new: int) -> None:
        """A sequence that ends as "length" before max_tokens or max_model_len says why, with the numbers."""
        logger.warning("request %s stops at %d tokens with finish_reason 'length': %s", seq.request.request_id,
                       seq.num_tokens, self.kv.explain_misfit(num_computed, num_new))

    def _preempt(self, seq: Sequence, to_back: bool = False) -> None:
        self.kv.free(seq)
        seq.spec_token_ids, seq.num_draft_computed = [], 0  # recomputed later: no drafts, no draft KV
        seq.status = SequenceStatus.WAITING
        if to_back:
            self.waiting.append(seq)
        elif self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def release_all(self) -> None:
        """Every sequence gives its blocks back and waits (sleep mode drops the KV cache): running ones are
        preempted in order to the head of the queue, loading ones join them (the caller waited for their copies,
        so `_finish_loads` takes them all), and waiting ones holding blocks free them."""
        self._finish_loads()
        assert not self.loading, "release_all waits for the tier's copies first"
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []
        for seq in self.waiting:
            if seq.block_table:
                self.kv.free(seq)

    def _preempt_paused(self, out: SchedulerOutput) -> bool:
        """Free the latest-admitted paused running sequence (its caller is not reading) for a waiting one;
        it goes to the back of the queue and is recomputed when its turn comes."""
        scheduled = {id(item.seq) for item in out.scheduled}
        victim = next((s for s in reversed(self.running) if s.request.paused and id(s) not in scheduled), None)
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim, to_back=True)
        return True

    def launched(self, out: SchedulerOutput) -> None:
        """Async scheduling: the step's forward is queued and the next step is scheduled before its results
        come back, so its tokens count as computed now and each sampling sequence has one token on its way
        (`num_pending`; a step that runs ahead has no drafts and no forks)."""
        for item in out.scheduled:
            seq, samples = item.seq, item.samples
            seq.num_computed_tokens += item.num_new_tokens
            seq.num_pending += samples
        self._snapshot_states(out)
        out.counted = True

    def _snapshot_states(self, out: SchedulerOutput) -> None:
        if self.kv.num_snapshot_slots:  # before any fork or finish: the state a chunk left, at a block boundary
            for item in out.scheduled:
                self.kv.snapshot_state(item.seq)

    def update_from_output(self, out: SchedulerOutput, forks: list[tuple[Sequence, list[Sequence]]],
                           finished: list[Sequence]) -> None:
        """After a step: the scheduled tokens are computed (unless `launched` counted them); forked sequences
        take their parent's blocks by reference and join the running list (before any parent that finished
        frees its own); finished sequences give their blocks back, and leave the waiting queue if a
        preemption put them there while their last token was on its way."""
        if not out.counted:
            for item in out.scheduled:  # drafts count only as far as they were accepted: the rest is rolled back
                item.seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens + item.num_accepted
            self._snapshot_states(out)
        for item in out.scheduled:  # a launched step encoded its images when it was queued: passed ones go
            if item.is_prefill:
                self._release_images(item.seq)
        if self.waiting and any(not s.block_table for s in finished):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        if self.kv.state is not None and forks:  # hybrid: state slots are bounded by the seats
            self._fork_states(forks, finished)
            return
        for parent, children in forks:
            for child in children:
                self.kv.fork(parent, child)
                if not child.is_finished:
                    child.status = SequenceStatus.RUNNING
                self.running.append(child)
        self.finish([s for s in finished if s.block_table])

    def _fork_states(self, forks: list[tuple[Sequence, list[Sequence]]], finished: list[Sequence]) -> None:
        """Forks of a hybrid model: finished sequences nobody forks off give their slots back first, and a
        parent that ends now hands its slot to its last child, so a beam step of k beams never holds more than
        k state slots (the pool has one per seat)."""
        forked = {id(seq) for parent, children in forks for seq in (parent, *children)}
        self.finish([s for s in finished if s.block_table and id(s) not in forked])
        children_left: dict[int, int] = {}
        for parent, children in forks:
            children_left[id(parent)] = children_left.get(id(parent), 0) + len(children)
        for parent, children in forks:
            for child in children:
                children_left[id(parent)] -= 1
                self.kv.fork(parent, child, take_state=parent.is_finished and not children_left[id(parent)])
                if not child.is_finished:
                    child.status = SequenceStatus.RUNNING
                self.running.append(child)
        self.finish([s for s in finished if s.block_table and id(s) in forked])

    def abort(self, seqs: list[Sequence]) -> None:
        """End sequences wherever they are: running ones give their blocks back, waiting ones leave the queue."""
        was_waiting = any(s.status is SequenceStatus.WAITING for s in seqs)
        for seq in seqs:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            self._release_images(seq, finished=True)
        # A loading sequence's blocks are being written by its copies: `_finish_loads` frees them once they ran.
        self.finish([s for s in seqs if s.block_table and not s.kv_load_batch])
        if was_waiting:
            self.waiting = deque(s for s in self.waiting if not s.is_finished)

    def finish(self, seqs: list[Sequence]) -> None:
        """Free finished sequences' blocks and drop them from the running list (one pass per step)."""
        if not seqs:
            return
        for seq in seqs:
            self.kv.free(seq)
            self._release_images(seq, finished=True)
        self.running = [s for s in self.running if not s.is_finished]
