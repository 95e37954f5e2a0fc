"""The one-rule scheduler: each step, give every request min(known - computed tokens, budget left).

That single rule covers prefill (many known tokens), chunked prefill (the budget cuts it), prefix hits
(computed starts ahead) and decode (one known token ahead). A step is a short pipeline:
  1. running requests, in order, each allocating its slots (preempting the lowest-priority, newest
     request not yet scheduled this step when blocks run out);
  2. waiting requests, strictly head-of-line in (priority class, preempted first, arrival) order,
     admitted only when their projected KV blocks fit.
With a batch bound (batch_bound.py) a step runs at most `cap` sequences: running ones interactive first,
then by arrival, so batch-class sequences are the first to wait (they keep their KV blocks, paused), and
waiting ones are admitted only while the step has room under the cap.
With `hold_batch` (on by default) batch-class sequences sit out every step in which an interactive request waits
for or is in its prefill (paused, blocks kept), so that the prefill gets the whole step and token budget; interactive
decodes run on, and a stream of them alone never holds batch back. At most `hold_batch_max_steps` held steps in a
row, then one step runs batch too: a flood of interactive prefills slows the batch tier, it does not stop it. An
interactive request that finds no free blocks or seat preempts batch-class sequences (newest first) to get in.
No tensors here: the output names block ids and copies for the model runner.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

from flotilla.engine.batch_bound import BatchBound, BatchBoundConfig
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.kv_cache_manager import KVCacheManager
from flotilla.engine.request import PLACEHOLDER, FinishReason, Priority, Request, RequestStatus
from flotilla.engine.scheduler_output import (
    BlockCopy,
    ModelRunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)

PreemptionMode = Literal["recompute", "swap"]


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 256  # running requests at most
    num_lookahead_steps: int = 4  # tokens of decode growth an admission must leave room for
    preemption_mode: PreemptionMode = "recompute"
    max_model_len: int | None = None  # prompt + max_tokens limit; None = only the KV capacity limits
    batch_bound: BatchBoundConfig | None = None  # sequences per step bounded by a target TPOT; None = off
    hold_batch: bool = True  # batch-class sequences wait while an interactive prefill is pending
    hold_batch_max_steps: int = 8  # held steps in a row at most; then one step runs batch too

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "hold_batch_max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_lookahead_steps < 0:
            raise ValueError(f"num_lookahead_steps must be >= 0, got {self.num_lookahead_steps}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    budget: int
    hold_batch: bool = False  # batch-class requests sit this step out
    output: SchedulerOutput = field(default_factory=SchedulerOutput)
    scheduled_ids: set[str] = field(default_factory=set)

    def add_chunk(self, request: Request, num_tokens: int, block_ids: list[int], copies: list[BlockCopy]):
        self.output.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_tokens, block_ids))
        self.output.block_copies.extend(copies)
        self.output.num_scheduled_tokens += num_tokens
        self.scheduled_ids.add(request.request_id)
        self.budget -= num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        self._waiting: list[Request] = []  # kept sorted by _waiting_key
        self._arrival_seq: dict[str, int] = {}  # FCFS tie-break that does not depend on clocks
        self._next_seq = 0
        self._checked_idle = True
        self.last_num_scheduled_tokens = 0
        self.bound = BatchBound(config.batch_bound, config.max_num_seqs) if config.batch_bound else None
        self._held_in_a_row = 0
        self.num_held_steps = 0  # steps that held batch-class requests back, since start

    # ---- views ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def requests(self) -> dict[str, Request]:
        return self._requests

    # ---- request lifecycle ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._validate_new(request)
        self._requests[request.request_id] = request
        self._arrival_seq[request.request_id] = self._next_seq
        self._next_seq += 1
        self._checked_idle = False
        self._enqueue_waiting(request)

    def validate_new(self, request: Request) -> None:
        """The checks add_request makes, without queueing (a decode worker reserving KV for a remote prefill)."""
        self._validate_new(request)

    def adopt_running(self, request: Request) -> None:
        """Take a request whose blocks are already allocated and computed (a remote prefill) straight into
        the running batch."""
        self._validate_known_blocks(request)
        self._requests[request.request_id] = request
        self._arrival_seq[request.request_id] = self._next_seq
        self._next_seq += 1
        self._checked_idle = False
        request.status = RequestStatus.RUNNING
        self._running.append(request)

    def _validate_known_blocks(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already scheduled")
        if len(self.kv.block_ids(request.request_id)) * self.kv.block_size < request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}: its blocks do not cover its computed tokens")

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request at once (from waiting or running) and free its blocks; None if unknown."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request in self._running:
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        self.kv.free(request)
        del self._arrival_seq[request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.end_step()  # normally done by update_from_output; harmless twice
        self._check_integrity_when_idle()
        step = _Step(budget=self.config.max_num_batched_tokens, hold_batch=self._hold_batch_this_step())
        self._schedule_running(step)
        self._schedule_waiting(step)
        self.last_num_scheduled_tokens = step.output.num_scheduled_tokens
        return step.output

    def observe_step(self, step_s: float, num_seqs: int) -> None:
        """A finished step's wall time and the sequences it ran: the batch bound's feedback."""
        if self.bound is not None:
            self.bound.observe(step_s, num_seqs)

    @property
    def seq_limit(self) -> int:
        """Sequences one step may run now: the batch bound's cap, else max_num_seqs."""
        return self.bound.cap if self.bound is not None else self.config.max_num_seqs

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """Advance each scheduled request by its chunk and append its sampled token. Requests finished
        or aborted since schedule() are skipped (their blocks are already free)."""
        self.advance(scheduler_output)
        self.fill_sampled(scheduler_output, model_runner_output)

    def advance(self, scheduler_output: SchedulerOutput) -> None:
        """A launched step's chunks count as computed, and each sampling chunk's token as known but not yet read:
        a PLACEHOLDER until fill_sampled. With overlap (engine.py) the next step is scheduled in between: a decode
        then reads the placeholder's id on the device. Requests finished or aborted since schedule() are skipped."""
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"request {request.request_id}: chunk starts at {chunk.start} but "
                    f"{request.num_computed_tokens} tokens are computed (output applied twice?)"
                )
            samples = chunk.samples
            request.num_computed_tokens += chunk.num_tokens
            if samples:
                request.output_token_ids.append(PLACEHOLDER)
        self.kv.end_step()

    def fill_sampled(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """The step's sampled tokens in place of its placeholders, for every request still here (one preempted since
        keeps its token: its recompute covers it)."""
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request or not request.awaits_token:
                continue
            token_id = model_runner_output.sampled_token_ids.get(request.request_id)
            if token_id is None:
                raise RuntimeError(f"model runner output has no sampled token for {request.request_id}")
            request.output_token_ids[-1] = token_id

    def publish_filled(self, scheduler_output: SchedulerOutput) -> None:
        """Publish to the prefix cache the blocks of this step's chunks that were scheduled while their last token
        was a placeholder (their hashes need its id), now that fill_sampled has it."""
        for chunk in scheduler_output.unpublished:
            request = chunk.request
            if (self._requests.get(request.request_id) is request and request.status is RequestStatus.RUNNING
                    and not request.awaits_token):
                self.kv.publish_blocks(request, chunk.start, chunk.end)

    # ---- pipeline steps ------------------------------------------------------------------------
    def _schedule_running(self, step: _Step) -> None:
        limit = self.seq_limit
        running = list(self._running)
        reserved = {}  # by class: slots kept for waiting requests of classes served before it
        if self.bound is not None and len(running) + len(self._waiting) > limit:
            # The bound may bind: interactive first, oldest first. A batch-class sequence also leaves its slot
            # to an interactive request still waiting; the rest wait (paused, blocks kept) this step.
            running.sort(key=lambda r: (r.priority, self._arrival_seq[r.request_id]))
            reserved = {r.priority: self._num_waiting_before(r.priority) for r in running}
        for request in running:
            if step.budget == 0 or len(step.scheduled_ids) + reserved.get(request.priority, 0) >= limit:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if step.hold_batch and request.priority >= Priority.BATCH:
                continue  # paused for an interactive prefill, blocks kept
            if self._last_token_in_flight(request):
                continue  # its last token is on the device still: nothing more to compute
            awaits_token = request.awaits_token
            num_new_tokens = min(request.num_uncomputed_tokens, step.budget)
            if num_new_tokens <= 0:
                continue
            copies = self._allocate_or_preempt(request, num_new_tokens, step, publish=not awaits_token)
            if copies is not None:
                step.add_chunk(request, num_new_tokens, self.kv.block_ids(request.request_id), copies)
                if awaits_token:
                    step.output.unpublished.append(step.output.chunks[-1])

    def _schedule_waiting(self, step: _Step) -> None:
        while self._waiting and step.budget > 0 and len(step.scheduled_ids) < self.seq_limit:
            request = self._waiting[0]
            if step.hold_batch and request.priority >= Priority.BATCH:
                return
            if request in step.output.preempted:
                return  # memory ran short this very step; re-admitting now would only thrash
            if len(self._running) >= self.config.max_num_seqs and not self._preempt_batch_for(request, step):
                return
            if not self._try_admit(request, step):
                return  # strict head-of-line: later requests do not overtake

    def _last_token_in_flight(self, request: Request) -> bool:
        """Its last token (max_tokens or the context window) is a placeholder: the engine finishes it once the id
        comes back."""
        return request.awaits_token and request.reached_length(self.config.max_model_len)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _Step,
                             publish: bool = True) -> list[BlockCopy] | None:
        """Allocate, preempting victims until it fits; None when the request itself was the victim. publish=False:
        the last token is a placeholder, and the blocks it fills are published later (publish_filled)."""
        while True:
            copies = self.kv.allocate_slots(request, num_new_tokens, publish=publish)
            if copies is not None:
                return copies
            victim = self._pick_victim(step)
            self._preempt(victim, step)
            if victim is request:
                return None

    def _pick_victim(self, step: _Step) -> Request:
        """Lowest priority (highest value), then newest, among running requests not scheduled yet; one whose last
        token is in flight (it ends when the token is read) only when there is no other."""
        candidates = [r for r in self._running if r.request_id not in step.scheduled_ids]
        lasting = [r for r in candidates if not self._last_token_in_flight(r)]
        return max(lasting or candidates, key=self._victim_key)

    def _victim_key(self, request: Request) -> tuple:
        return request.priority, request.arrival_time, self._arrival_seq[request.request_id]

    def _preempt(self, request: Request, step: _Step) -> None:
        self._running.remove(request)
        swap_copies = self.kv.swap_out(request) if self.config.preemption_mode == "swap" else None
        if swap_copies is None:  # recompute mode, or the host slots are full
            self.kv.free(request)
            request.num_computed_tokens = 0  # prefill re-covers prompt + outputs so far
        else:
            step.output.swap_out.extend(swap_copies)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        step.output.preempted.append(request)
        self._enqueue_waiting(request)

    def _preempt_batch_for(self, request: Request, step: _Step) -> bool:
        """Preempt the newest batch-class request not scheduled this step to make room for an interactive one
        (with hold_batch); False when there is none to preempt."""
        if not self.config.hold_batch or request.priority >= Priority.BATCH:
            return False
        if step.output.swap_in:
            return False  # a victim's swap-out would run before that swap-in and could take its freed host slots
        candidates = [r for r in self._running
                      if r.priority >= Priority.BATCH and r.request_id not in step.scheduled_ids]
        if not candidates:
            return False
        self._preempt(max(candidates, key=self._victim_key), step)
        return True

    def _try_admit(self, request: Request, step: _Step) -> bool:
        while True:
            computed = None if self.kv.is_swapped(request) else self.kv.get_computed_blocks(request)
            num_needed = self.kv.num_blocks_needed(request, self._projected_num_tokens(request), computed)
            if self.kv.can_fit(num_needed):
                break
            if not self._preempt_batch_for(request, step):
                return False
        if computed is None:
            swap_copies = self.kv.swap_in(request)
            if swap_copies is None:
                raise RuntimeError(f"swap-in of {request.request_id} failed after it was checked to fit")
            step.output.swap_in.extend(swap_copies)
            start = request.num_computed_tokens
        else:
            start = computed.num_tokens
        num_new_tokens = min(request.num_tokens - start, step.budget)
        copies = self.kv.allocate_slots(request, num_new_tokens, computed)
        if copies is None:
            raise RuntimeError(f"allocation for {request.request_id} failed after it was checked to fit")
        self._waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        step.add_chunk(request, num_new_tokens, self.kv.block_ids(request.request_id), copies)
        return True

    # ---- helpers -------------------------------------------------------------------------------
    def _hold_batch_this_step(self) -> bool:
        """Whether batch-class requests sit out the coming step: an interactive request waits for or is in its
        prefill, batch work exists, and fewer than hold_batch_max_steps steps in a row were held already."""
        if not (self.config.hold_batch and self._batch_work_exists() and self._interactive_prefill_pending()):
            self._held_in_a_row = 0
            return False
        if self._held_in_a_row >= self.config.hold_batch_max_steps:
            self._held_in_a_row = 0  # the starvation cap: this step runs batch too
            return False
        self._held_in_a_row += 1
        self.num_held_steps += 1
        return True

    def _batch_work_exists(self) -> bool:
        # The waiting list is sorted by class first: its last entry is of the lowest class waiting.
        return (bool(self._waiting) and self._waiting[-1].priority >= Priority.BATCH) or any(
            r.priority >= Priority.BATCH for r in self._running)

    def _interactive_prefill_pending(self) -> bool:
        if self._waiting and self._waiting[0].priority < Priority.BATCH:
            return True
        return any(r.priority < Priority.BATCH and (r.num_uncomputed_tokens > 1 or not r.output_token_ids)
                   for r in self._running)

    def _num_waiting_before(self, priority: int) -> int:
        """Waiting requests of classes served before `priority` (the waiting list is sorted by class first)."""
        count = 0
        for waiting in self._waiting:
            if waiting.priority >= priority:
                break
            count += 1
        return count

    def _projected_num_tokens(self, request: Request) -> int:
        """Known tokens plus a few steps of growth, capped where the request must stop anyway."""
        growth = request.num_tokens + self.config.num_lookahead_steps
        return max(request.num_tokens, min(growth, self._max_total_tokens(request)))

    def _max_total_tokens(self, request: Request) -> int:
        limit = request.num_prompt_tokens + request.sampling_params.max_tokens
        if self.config.max_model_len is not None:
            limit = min(limit, self.config.max_model_len)
        return limit

    def _waiting_key(self, request: Request) -> tuple:
        preempted_first = 0 if request.status is RequestStatus.PREEMPTED else 1
        return (request.priority, preempted_first, request.arrival_time, self._arrival_seq[request.request_id])

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self._waiting, request, key=self._waiting_key)

    def _validate_new(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already scheduled")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is not a fresh request")
        max_tokens = request.sampling_params.max_tokens
        max_len = self.config.max_model_len
        if max_len is not None and request.num_prompt_tokens + max_tokens > max_len:
            raise ContextLengthError(request.num_prompt_tokens, max_tokens, max_len)
        num_blocks = -(-self._max_total_tokens(request) // self.kv.block_size)
        if num_blocks > self.kv.num_blocks:
            # Alone on the engine it could never finish: admitting it would preempt itself forever.
            raise InvalidRequestError(
                "max_tokens", f"needs {num_blocks} KV blocks, the cache holds only {self.kv.num_blocks}"
            )

    def _check_integrity_when_idle(self) -> None:
        """The full invariant check is O(blocks): run it once each time the engine drains."""
        if not self._requests and not self._checked_idle:
            self.kv.check_integrity()
            self._checked_idle = True
