"""The engine loop: schedule -> run -> update from output -> emit tokens. Synchronous; one thread owns it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from flotilla.engine.batch_bound import BatchBoundConfig
from flotilla.engine.block_hash import chain_root
from flotilla.engine import cuda_graphs, host_malloc
from flotilla.engine.config import (
    EngineConfig,
    default_kv_budget,
    resolve_attention_backend,
    resolve_block_size,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from flotilla.engine.detokenizer import IncrementalDetokenizer
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.kv_cache_manager import KVCacheManager
from flotilla.engine.kv_calibration import calibrate_kv_scales
from flotilla.engine.model import cpu_linear, kv_scales
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.kv_cache import num_blocks_for_budget
from flotilla.engine.model.loader import checkpoint_kv_scales, load_model
from flotilla.engine.model.moe import settle_experts_way
from flotilla.engine.model.rope import prompt_length_key
from flotilla.engine.model_runner import DeferredSampling, ModelRunner, PendingStep
from flotilla.engine.new_request import NewRequest
from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.engine.request import FinishReason, Priority, Request
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from flotilla.engine.stop_checker import StopChecker
from flotilla.engine.grammar_backend import GrammarBackend
from flotilla.engine.tokenizer import Tokenizer


@dataclass
class _Tracked:
    """Engine-side state of a request besides the scheduler's: its text and stop conditions."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = resolve_block_size(config.block_size, self.device)
        stored_kv_scales = self._checkpoint_kv_scales()  # before the weights load: a refusal comes at once
        if self.device.type == "cpu":
            if config.keep_freed_host_memory:
                host_malloc.keep_freed_host_memory()  # before the weights and KV pool: they come from the heap too
            if config.onednn_primitive_cache_capacity is not None:
                cpu_linear.bound_primitive_caches(config.onednn_primitive_cache_capacity)  # before oneDNN's first use
        self.linear_backend = cpu_linear.resolve(config.cpu_linear_backend, self.device, self.dtype)
        self.tokenizer = Tokenizer.from_pretrained(config.model_dir)
        # Structured outputs (grammar_backend.py); llguidance's vocabulary is built at the first such request.
        self.grammars = GrammarBackend(self.tokenizer.to_json, self.model_config.vocab_size,
                                       sorted(self.tokenizer.eos_token_ids))
        self.max_model_len = min(self.model_config.max_model_len, config.max_model_len or 1 << 62)
        self.model_version = model_version(config.model_dir)
        model = load_model(config.model_dir, self.dtype, self.device)
        if self.linear_backend != "torch":
            cpu_linear.pack_linears(model, self.linear_backend)
        self.moe_grouped = settle_experts_way(model)  # before graphs, overlap and calibration run the model
        self.kv_scales = stored_kv_scales or self._calibrated_kv_scales(model)
        for layer, layer_scales in zip(model.model.layers, self.kv_scales):
            layer.self_attn.kv_scales = layer_scales
        # What a peer's cache must match before blocks move between the two (kv_handoff.ensure_peer).
        self.kv_cache_format = kv_scales.describe(self.kv_cache_dtype, self.kv_scales)
        num_blocks = config.num_kv_blocks or self._blocks_for_budget()
        self.runner = ModelRunner(
            model, num_blocks, self.block_size, self.kv_cache_dtype, self.device, config.num_host_kv_blocks,
            config.seed, self.attention_backend, self._graph_sizes(model), self.max_model_len,
            config.cuda_graph_memory_bytes,
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, config.enable_prefix_caching, config.num_host_kv_blocks
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                num_lookahead_steps=config.num_lookahead_steps,
                preemption_mode=config.preemption_mode,
                max_model_len=self.max_model_len,
                batch_bound=BatchBoundConfig(config.target_tpot_s) if config.target_tpot_s else None,
                hold_batch=config.hold_batch,
                hold_batch_max_steps=config.hold_batch_max_steps,
            ),
            self.kv_cache_manager,
        )
        if self.device.type == "cpu":
            host_malloc.release_load_transients()
        self._tracked: dict[str, _Tracked] = {}
        # Requests whose blocks remote_prefill.try_reserve holds outside the scheduler (a remote prefill).
        self.reserved_request_ids: set[str] = set()
        # By default on CUDA, but not for MoE models whose experts run the Python loop there: it reads expert counts
        # back in every layer (moe.py), which waits for the running step anyway.
        overlap = config.overlap_output_processing
        default_overlap = self.device.type == "cuda" and (self.model_config.moe is None or self.moe_grouped)
        self.overlap_output_processing = default_overlap if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # launched, not yet collected
        self._num_preemptions = 0
        self._last_step_seconds = 0.0
        self._num_prompt_tokens_total = 0
        self._num_output_tokens_total = 0

    def _checkpoint_kv_scales(self) -> list[kv_scales.KVScales] | None:
        """An fp8 cache's scales from the checkpoint (kv_cache_scales auto or checkpoint), or None: calibrate."""
        mode = self.config.kv_cache_scales
        if not kv_scales.needs_scales(self.kv_cache_dtype) or mode not in ("auto", "checkpoint"):
            return None
        stored = checkpoint_kv_scales(self.config.model_dir, self.model_config.num_layers)
        if stored is None and mode == "checkpoint":
            raise ValueError(f"kv_cache_scales 'checkpoint': {self.config.model_dir} has no KV-cache scale "
                             "tensors (self_attn.k_scale / v_scale); use 'calibrate' to measure them")
        return stored

    def _calibrated_kv_scales(self, model) -> list[kv_scales.KVScales]:
        """An fp8 cache's measured scales (unit for other caches, or asked for), found before the runner captures
        CUDA graphs (which hold them as constants)."""
        if not kv_scales.needs_scales(self.kv_cache_dtype) or self.config.kv_cache_scales == "unit":
            return [kv_scales.UNIT] * self.model_config.num_layers
        token_ids = self.tokenizer.encode(kv_scales.CALIBRATION_TEXT)[: self.max_model_len]
        return calibrate_kv_scales(model, token_ids, self.dtype, self.kv_cache_dtype, self.block_size, self.device)

    def _graph_sizes(self, model) -> list[int]:
        """Decode batch sizes to capture: on cuda with the Triton kernel, for models whose steps replay fixed work."""
        config = self.config
        if not (config.cuda_graphs and self.device.type == "cuda" and self.attention_backend == "triton"
                and cuda_graphs.graphs_apply(model)):
            return []
        largest = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs,
                      config.max_num_batched_tokens)  # no decode step has more rows than either allows
        return cuda_graphs.capture_sizes(largest)

    def _blocks_for_budget(self) -> int:
        budget = self.config.kv_cache_memory_bytes or default_kv_budget(self.device)
        num_blocks = num_blocks_for_budget(self.model_config, self.block_size, self.kv_cache_dtype, budget)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {self.block_size} tokens")
        return num_blocks

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, new: NewRequest) -> None:
        """Validate and queue a request. Raises InvalidRequestError (or ContextLengthError) naming the field
        before any state changes. A resumed stream (its delivered tokens, new_request.py) is prefilled with
        them; sampling continues at output index len(delivered), text continues after theirs."""
        request = self._build_request(new)
        self.scheduler.add_request(request)  # validates id, context window and KV capacity
        self._tracked[new.request_id] = self._track(request)
        self._num_prompt_tokens_total += request.num_prompt_tokens

    def _build_request(self, new: NewRequest) -> Request:
        new.sampling_params.validate(max_tokens_limit=self.max_model_len)
        if not new.prompt_token_ids:  # a resumed stream too: its own prompt, not only what it delivered
            raise InvalidRequestError("prompt", "must contain at least one token")
        structured = new.sampling_params.structured_output
        return Request(
            request_id=new.request_id,
            prompt_token_ids=self._validated_prompt([*new.prompt_token_ids, *new.delivered_token_ids]),
            sampling_params=new.sampling_params,
            priority=Priority(new.priority),
            cache_salt=new.cache_salt,
            cache_root=chain_root(prompt_length_key(self.model_config, len(new.prompt_token_ids))),
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            num_previous_output_tokens=len(new.delivered_token_ids),
            # A resumed stream's matcher replays what was delivered: the output goes on inside the grammar.
            grammar=self.grammars.matcher(structured, new.delivered_token_ids) if structured is not None else None,
        )

    def _track(self, request: Request) -> _Tracked:
        """Text state of a new request; a resumed one replays its earlier output so that the detokenizer and
        stop checker hold back exactly what the first worker held back (nothing is sent twice or lost)."""
        num_original = request.num_prompt_tokens - request.num_previous_output_tokens
        tracked = _Tracked(
            request,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids=request.prompt_token_ids[:num_original]),
            StopChecker(request, self.max_model_len),
        )
        for token_id in request.prompt_token_ids[num_original:]:
            tracked.stop_checker.replay(tracked.detokenizer.push([token_id]))
        return tracked

    # ---- remote prefill (see flotilla.engine.remote_prefill) -----------------------------------------
    def new_request(self, new: NewRequest) -> Request:
        """A validated request that is NOT queued: a decode worker reserves its KV blocks first (a resumed
        stream's too, as in add_request)."""
        request = self._build_request(new)
        self.scheduler.validate_new(request)
        return request

    def add_prefilled_request(
        self, request: Request, first_token_id: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Admit a request whose prompt K/V already sit in its blocks (written by a prefill worker) and
        continue from the first token that prefill produced; returns the output for that token."""
        request.num_computed_tokens = request.num_prompt_tokens
        try:
            self.kv_cache_manager.publish_blocks(request, 0, request.num_prompt_tokens)
            self.scheduler.adopt_running(request)
        except BaseException:
            # Not admitted: its reservation is freed here, since its holder has handed it over. (A request
            # id the scheduler already runs is another request's: its blocks are not this one's to free.)
            if request.request_id in self.reserved_request_ids:
                self.kv_cache_manager.free(request)
                self.reserved_request_ids.discard(request.request_id)
            raise
        self.reserved_request_ids.discard(request.request_id)  # the scheduler owns its blocks now
        request.output_token_ids.append(first_token_id)
        tracked = self._tracked[request.request_id] = self._track(request)
        self._num_prompt_tokens_total += request.num_prompt_tokens
        runner_output = ModelRunnerOutput(logprobs={request.request_id: logprobs} if logprobs else {})
        return self._advance(tracked, first_token_id, runner_output)

    def _validated_prompt(self, prompt: list[int]) -> list[int]:
        vocab_size = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
        return prompt

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already finished."""
        self._tracked.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        # A launched step's live requests are the scheduler's still; one whose every request has ended or been aborted
        # since it was launched has nothing to deliver, and the next step() collects it (dropping those rows).
        return self.scheduler.has_unfinished_requests

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, launch, and the outputs of the step whose tokens came back.

        Without overlap: schedule -> launch -> collect -> finishes -> text, all for this step. With
        overlap_output_processing (on by default on CUDA) the step launched by the last call is still running when
        this one schedules and launches the next: each of its decodes reads the token it waits for (a PLACEHOLDER
        in its request) on the device, from that step's sampled ids. Then this call collects that step (waits for
        its ids), fills the placeholders in, ends the requests that stop without text (EOS, stop token ids,
        length, a complete grammar), detokenizes and matches stop strings, all while the device runs the step
        just launched, and returns the collected step's outputs. A request that ended there has a row in the
        launched step: it is dropped when it comes back, and the K/V it writes lands in blocks already freed,
        which later steps (queued behind it on the same stream) overwrite. A request whose last token is in flight
        is not scheduled again. A grammar request's next mask needs the token in flight: a step with grammar rows
        is launched up to its logits, and its sampling follows the collection of the step before (the host computes
        the masks while the device runs the forward pass). When a KV-transfer hook is set, the call collects first,
        as without overlap."""
        started = time.perf_counter()
        self.release_expired_quarantine()
        outputs = []
        # The step this call waits for last: its time is the call's (with overlap, the one launched by the last
        # call, not the one this call launches).
        waited_for = None
        if self._in_flight is not None and not self._overlaps():
            waited_for = self._in_flight[0]
            outputs += self._emit(self._collect(self._take_in_flight()))
        scheduler_output = self.scheduler.schedule()
        self._num_preemptions += len(scheduler_output.preempted)
        previous = self._take_in_flight()
        if scheduler_output.is_empty and not scheduler_output.swap_out:
            self._last_step_seconds = 0.0
            return outputs + self._emit(self._collect(previous))
        pending = self.runner.launch(scheduler_output, previous[1] if previous is not None else None,
                                     defer_constrained=previous is not None)
        collected = self._collect(previous)
        if isinstance(pending, DeferredSampling):  # its grammar rows' masks needed the tokens just collected
            pending = pending.sample()
        if previous is not None:
            waited_for = previous[0]
        self.scheduler.publish_filled(scheduler_output)
        outputs += self._emit(collected)
        self.scheduler.advance(scheduler_output)  # after the text: the stop checks saw the counts of `previous`
        self._in_flight = (scheduler_output, pending)
        if not self._overlaps():
            waited_for = scheduler_output
            outputs += self._emit(self._collect(self._take_in_flight()))
        self._last_step_seconds = time.perf_counter() - started
        if waited_for is not None:  # the batch bound's feedback: a step's time with the sequences it ran
            self.scheduler.observe_step(self._last_step_seconds, len(waited_for.chunks))
        return outputs

    def _overlaps(self) -> bool:
        """Whether a launched step is left running past this call (a KV-transfer hook ships a step's K/V as it
        runs and wants the step done within it)."""
        return self.overlap_output_processing and self.runner.kv_hook is None

    def _take_in_flight(self) -> tuple[SchedulerOutput, PendingStep] | None:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _collect(self, launched: tuple[SchedulerOutput, PendingStep] | None
                 ) -> list[tuple[_Tracked, int, bool, ModelRunnerOutput]]:
        """Waits for a launched step, fills its tokens in and applies the finishes that need no text. Returns, per
        request still tracked, (tracked, token id, grammar complete, the step's output) for _emit."""
        if launched is None:
            return []
        scheduler_output, pending = launched
        runner_output = pending.collect()
        self.scheduler.fill_sampled(scheduler_output, runner_output)
        launched_requests = {chunk.request.request_id: chunk.request for chunk in scheduler_output.chunks}
        collected = []
        for request_id, token_id in runner_output.sampled_token_ids.items():
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.request is not launched_requests[request_id]:
                continue  # ended (or aborted, and perhaps its id reused) since the launch
            grammar_complete = self._take_token(tracked.request, token_id)  # before the next step's mask
            reason = tracked.stop_checker.finish_without_text(token_id, grammar_complete)
            if reason is not None:  # out of the next schedule; _advance still makes its last output
                self.scheduler.finish_request(request_id, reason)
            collected.append((tracked, token_id, grammar_complete, runner_output))
        return collected

    def _take_token(self, request: Request, token_id: int) -> bool:
        """Counts a sampled token and feeds it to the request's grammar; whether the grammar can take no more."""
        self._num_output_tokens_total += 1
        if request.grammar is None:
            return False
        request.grammar.consume_token(token_id)
        return request.grammar.is_stopped()

    def _emit(self, collected: list[tuple[_Tracked, int, bool, ModelRunnerOutput]]) -> list[RequestOutput]:
        return [self._advance(tracked, token_id, runner_output, grammar_complete)
                for tracked, token_id, grammar_complete, runner_output in collected]

    def _advance(self, tracked: _Tracked, token_id: int, runner_output: ModelRunnerOutput,
                 grammar_complete: bool | None = None) -> RequestOutput:
        """The token's text and output. grammar_complete None: the token is new here (a remote prefill's first
        token, sampled under the same grammar on the prefill worker): taken as _collect takes a step's tokens."""
        request = tracked.request
        if grammar_complete is None:
            grammar_complete = self._take_token(request, token_id)
        decision = tracked.stop_checker.after_token(token_id, tracked.detokenizer.push([token_id]), grammar_complete)
        text = decision.text_delta
        if decision.finish_reason is not None:
            if not isinstance(decision.stop_reason, str):  # a stop string cuts the text; anything else flushes
                text += tracked.stop_checker.finish_with(tracked.detokenizer.flush())
            self.scheduler.finish_request(request.request_id, decision.finish_reason)
            request.finish_reason = decision.finish_reason  # a stop string outranks the reason found without text
            del self._tracked[request.request_id]
        logprobs = runner_output.logprobs.get(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            text_delta=text,
            finished=decision.finish_reason is not None,
            finish_reason=decision.finish_reason,
            stop_reason=decision.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            logprobs=[logprobs] if logprobs is not None else [],
        )

    # ---- offline use ---------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts (text or token ids) to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        results = {request_id: GenerationResult([], "", None, 0, 0) for request_id in ids}
        for request_id, prompt, sampling in zip(ids, prompts, params_list):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.add_request(NewRequest(request_id, tuple(token_ids), sampling))
            results[request_id].num_prompt_tokens = len(token_ids)
        pending = set(ids)
        while pending:
            for output in self.step():
                if output.request_id in pending:
                    results[output.request_id].absorb(output)
                    if output.finished:
                        pending.discard(output.request_id)
        return [results[request_id] for request_id in ids]

    # ---- load figures --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_queued_tokens=sum(r.num_uncomputed_tokens for r in scheduler.requests.values()),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            block_size=kv.block_size,
            prefix_hit_rate=kv.prefix_hit_rate,
            num_preemptions=self._num_preemptions,
            last_step_num_tokens=scheduler.last_num_scheduled_tokens,
            last_step_seconds=self._last_step_seconds,
            num_output_tokens_total=self._num_output_tokens_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            seq_limit=scheduler.seq_limit,
        )

    def release_expired_quarantine(self) -> int:
        """Free the blocks of abandoned KV hand-offs whose quarantine ended (remote_prefill.quarantine)."""
        return self.kv_cache_manager.release_expired_quarantine(time.monotonic())

    def next_quarantine_release(self) -> float | None:
        """time.monotonic() when the next quarantine ends; None without one."""
        return self.kv_cache_manager.next_quarantine_release()

    def check_integrity(self, reserved_request_ids: Collection[str] | None = None) -> bool:
        """The KV invariants, including that every block table belongs to a live request: a scheduled one
        or a reservation (`reserved_request_ids` from whoever holds them, else this engine's own record)."""
        reserved = self.reserved_request_ids if reserved_request_ids is None else reserved_request_ids
        live = set(self.scheduler.requests) | set(reserved)
        return self.kv_cache_manager.check_integrity(live_request_ids=live)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int

    def absorb(self, output: RequestOutput) -> None:
        self.token_ids += output.new_token_ids
        self.text += output.text_delta
        self.num_cached_prompt_tokens = output.num_cached_prompt_tokens
        if output.finished:
            self.finish_reason = output.finish_reason


def model_version(model_dir: str | Path) -> str:
    """Digest of the config and weights: two workers share a version only when their weights are equal."""
    digest = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted([root / "config.json", *root.glob("*.safetensors")]):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:12]
