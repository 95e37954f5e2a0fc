"""The only place that touches tensors for a step: block copies, inputs, forward, logits, sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from flotilla.engine import cuda_graphs
from flotilla.engine.device_copy import to_device
from flotilla.engine.model import decode_kernel, prefill_kernel
from flotilla.engine.model.attention import AttentionMetadata, SeqChunk
from flotilla.engine.model.kv_cache import allocate_kv_cache, copy_blocks
from flotilla.engine.model.llama import LlamaForCausalLM
from flotilla.engine.grammar_backend import mask_logits
from flotilla.engine.kv_swap import KVSwapper
from flotilla.engine.request import PLACEHOLDER
from flotilla.engine.sampler import LogprobTensors, logprob_tensors, sample_ids, token_logprobs
from flotilla.engine.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput


class StepKVHook(Protocol):
    def begin_step(self, scheduler_output: SchedulerOutput) -> None: ...
    def on_layer(self, layer_index: int) -> None: ...
    def end_step(self) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
        default_seed: int = 0,
        attention_backend: str = "torch",
        graph_sizes: Sequence[int] = (),
        max_model_len: int | None = None,
        graph_memory_bytes: int = 2 << 30,
    ):
        """dtype: of the KV pool (the model's, or narrower: fp8). attention_backend: "torch" (gather + SDPA, the C
        decode kernel on CPUs) or "triton" (config.resolve_attention_backend). graph_sizes: decode batch sizes to
        replay from CUDA graphs (Triton backend only; max_model_len then sets the block-table width)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.default_seed = default_seed
        self.use_triton = attention_backend == "triton"
        # Graph padding writes its K/V into a spare block past the ones the KV manager hands out.
        spare = 1 if graph_sizes else 0
        self.kv_caches = allocate_kv_cache(model.config, num_blocks + spare, block_size, dtype, device)
        # Optional KV-transfer hook (flotilla.engine.remote_prefill.KVSender): told each step's chunks, called
        # after every layer, and at the end of the forward pass (where it waits for its writes).
        self.kv_hook: StepKVHook | None = None
        self.use_decode_kernel = not self.use_triton and decode_kernel.applies(self.kv_caches[0])
        self.use_prefill_kernel = not self.use_triton and prefill_kernel.applies(self.kv_caches[0])
        if self.use_triton and device.type == "cuda":  # compiled now, not at the first requests (nor in a capture)
            from flotilla.engine.model import triton_attention  # imports triton: only where it runs

            attentions = [layer.self_attn for layer in model.model.layers]
            triton_attention.warm_up(self.kv_caches[0], attentions[0].num_heads, model.model.embed_tokens.weight.dtype,
                                     {(attention.window, attention.softcap) for attention in attentions})
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        if graph_sizes:
            if not self.use_triton or max_model_len is None:
                raise ValueError("decode graphs need the triton attention backend and max_model_len")
            width = -(-max_model_len // block_size)
            self.graphs = cuda_graphs.DecodeGraphs(model, self.kv_caches, graph_sizes, width, block_size,
                                                   num_blocks * block_size, device, graph_memory_bytes)
        # Host copy of the pool for swap preemption; pinned so that copies from a GPU are asynchronous.
        self.host_kv_caches = (
            allocate_kv_cache(
                model.config, num_host_blocks, block_size, dtype, torch.device("cpu"), pin_memory=device.type == "cuda"
            )
            if num_host_blocks
            else []
        )
        self.swapper = KVSwapper(self.kv_caches, self.host_kv_caches) if num_host_blocks else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step, waited for: launch() then collect()."""
        return self.launch(scheduler_output).collect()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: PendingStep | None = None,
               defer_constrained: bool = False) -> PendingStep | DeferredSampling:
        """Queue the step's work on the device and return without waiting for it: on a GPU the sampled token ids
        come back through an asynchronous copy that PendingStep.collect() waits for (on a CPU it all ran here).
        previous: the step before, still running, whose sampled ids this step's PLACEHOLDER tokens are (read on
        the device: nothing waits for them). defer_constrained: when the step has grammar rows, stop after the
        logits and return DeferredSampling, whose sample() masks and samples once the grammars have consumed
        `previous`'s tokens (their masks need them)."""
        self._move_blocks(scheduler_output)
        if scheduler_output.is_empty:  # a step may only swap out
            return PendingStep([], None)
        # Decode chunks first, shortest context first: the attention metadata batches runs of one-token
        # chunks of similar length into one call each.
        chunks = sorted(scheduler_output.chunks, key=lambda chunk: (chunk.num_tokens != 1, chunk.end))
        hook = self.kv_hook
        input_ids = [c.request.token_ids_slice(c.start, c.end) for c in chunks]
        placeholders = _placeholders(chunks, input_ids, previous, self.device)
        if hook is None and self._replays(chunks):
            hidden = self.graphs.run([cuda_graphs.DecodeRow(ids[0], c.start, c.block_ids)
                                      for c, ids in zip(chunks, input_ids)], placeholders)
        else:
            hidden = self._forward(scheduler_output, chunks, input_ids, placeholders, hook)
        sampling = [i for i, chunk in enumerate(chunks) if chunk.samples]
        if not sampling:
            return PendingStep([], None)
        last_rows = to_device(_last_rows(chunks, sampling), self.device, torch.int64)
        logits = self.model.compute_logits(hidden[last_rows])
        requests = [chunks[i].request for i in sampling]
        if defer_constrained and any(request.grammar is not None for request in requests):
            return DeferredSampling(self, requests, logits)
        return self.sample(requests, logits)

    @torch.inference_mode()
    def sample(self, requests: Sequence, logits: torch.Tensor) -> PendingStep:
        """Sample one token per row of logits [N, V] (and the log-probabilities asked for) on the device."""
        # Structured outputs: constrained rows sample from masked logits; logprobs stay the model's own. A grammar
        # that completed since the launch (overlap: its request ended with the step before) masks nothing: that
        # row is dropped when it comes back.
        constrained = [i for i, request in enumerate(requests)
                       if request.grammar is not None and not request.grammar.is_stopped()]
        sampling_logits = (mask_logits(logits, constrained, [requests[i].grammar for i in constrained])
                           if constrained else logits)
        token_ids = sample_ids(sampling_logits, requests, self.default_seed)
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        read_back = [token_ids]
        if wanted:
            rows = to_device(wanted, self.device, torch.int64)
            max_top = max(requests[i].sampling_params.logprobs for i in wanted)
            read_back += logprob_tensors(logits[rows], token_ids[rows], max_top)
        return PendingStep(requests, token_ids, wanted, *_read_back(read_back))

    def _replays(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """An all-decode step that a captured graph holds (a KV-transfer hook needs the eager per-layer calls)."""
        return (self.graphs is not None and chunks[-1].num_tokens == 1
                and self.graphs.bucket_for(len(chunks)) is not None)

    def _forward(self, scheduler_output: SchedulerOutput, chunks: Sequence[ScheduledChunk],
                 chunk_input_ids: Sequence[list[int]], placeholders: Placeholders | None, hook) -> torch.Tensor:
        input_ids, positions = self._inputs(chunks, chunk_input_ids)
        if placeholders is not None:
            input_ids[placeholders.at] = placeholders.ids
        meta = AttentionMetadata.build(
            [SeqChunk(c.start, c.num_tokens, c.block_ids, _num_original_prompt_tokens(c.request)) for c in chunks],
            self.block_size,
            self.device,
            use_decode_kernel=self.use_decode_kernel,
            use_prefill_kernel=self.use_prefill_kernel,
            sliding_window=self.model.config.sliding_window,
            use_triton=self.use_triton,
        )
        if hook is not None:
            hook.begin_step(scheduler_output)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, hook.on_layer if hook is not None else None)
        if hook is not None:
            hook.end_step()
        return hidden

    def _move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        if self.swapper is not None:  # in kv_swap's order: a swap-out's blocks may be this step's swap-in targets
            self.swapper.apply(scheduler_output.swap_out, scheduler_output.swap_in)
        elif scheduler_output.swap_out or scheduler_output.swap_in:
            raise RuntimeError("the scheduler swapped blocks but this runner has no host pool")
        copy_blocks(self.kv_caches, [(copy.src, copy.dst) for copy in scheduler_output.block_copies])

    def _inputs(self, chunks: Sequence[ScheduledChunk], chunk_token_ids: Sequence[list[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        token_ids: list[int] = []
        positions: list[int] = []
        for chunk, ids in zip(chunks, chunk_token_ids):
            token_ids += ids
            positions += range(chunk.start, chunk.end)
        return (
            to_device(token_ids, self.device, torch.int64),
            to_device(positions, self.device, torch.int64),
        )


class DeferredSampling(NamedTuple):
    """A launched step whose forward pass is queued and whose sampling waits for its grammar rows' masks
    (ModelRunner.launch with defer_constrained): sample() once the grammars have consumed the step before's tokens."""

    runner: ModelRunner
    requests: Sequence
    logits: torch.Tensor

    def sample(self) -> PendingStep:
        return self.runner.sample(self.requests, self.logits)


class Placeholders(NamedTuple):
    """Where a step's inputs hold PLACEHOLDER tokens (flat input rows, on the device) and their ids there."""

    at: torch.Tensor
    ids: torch.Tensor


def _placeholders(chunks: Sequence[ScheduledChunk], input_ids: Sequence[list[int]], previous: PendingStep | None,
                  device: torch.device) -> Placeholders | None:
    """The step's PLACEHOLDER inputs, each the token the previous (still running) step sampled for its request. A
    request holds at most one, its last token (Request.awaits_token), so only a chunk's last input can be one."""
    at, rows, offset = [], [], 0
    for chunk, ids in zip(chunks, input_ids):
        offset += len(ids)
        if ids[-1] != PLACEHOLDER:
            continue
        row = previous.row_of(chunk.request.request_id) if previous is not None else None
        if row is None:
            raise RuntimeError(f"request {chunk.request.request_id}: a placeholder token that no running step samples")
        at.append(offset - 1)
        rows.append(row)
    if not at:
        return None
    return Placeholders(to_device(at, device, torch.int64), previous.token_ids[to_device(rows, device, torch.int64)])


def _read_back(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """The tensors as the host will read them, and what to wait for first: on a GPU, copies into pinned host memory
    queued behind the step's work, and an event after them; elsewhere the tensors themselves."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for target, tensor in zip(host, tensors):
        target.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class PendingStep:
    """A launched step's sampled tokens (and log-probabilities), not yet read on the host (ModelRunner.launch)."""

    def __init__(self, requests: Sequence, token_ids: torch.Tensor | None, logprob_rows: Sequence[int] = (),
                 host: Sequence[torch.Tensor] = (), done: torch.cuda.Event | None = None):
        self._requests = requests
        self._rows = {request.request_id: row for row, request in enumerate(requests)}
        self._token_ids = token_ids
        self._logprob_rows = logprob_rows  # the rows whose requests asked for log-probabilities
        self._host = host  # token ids, then (with logprob_rows) LogprobTensors' three, readable once `done` passed
        self._done = done

    @property
    def token_ids(self) -> torch.Tensor | None:
        """The sampled ids on the device, one per request in launch order (None: the step sampled nothing)."""
        return self._token_ids

    def row_of(self, request_id: str) -> int | None:
        return self._rows.get(request_id)

    def collect(self) -> ModelRunnerOutput:
        """Waits for the step (on a GPU, for its copies back) and returns its output."""
        if self._token_ids is None:
            return ModelRunnerOutput()
        if self._done is not None:
            self._done.synchronize()
        requests = self._requests
        token_ids = self._host[0].tolist()
        output = ModelRunnerOutput(sampled_token_ids={r.request_id: t for r, t in zip(requests, token_ids)})
        if self._logprob_rows:
            values = token_logprobs(LogprobTensors(*self._host[1:]),
                                    [requests[i].sampling_params.logprobs for i in self._logprob_rows])
            for i, value in zip(self._logprob_rows, values):
                output.logprobs[requests[i].request_id] = value
        return output


def _num_original_prompt_tokens(request) -> int:
    """The prompt as first submitted (a resumed stream's delivered tokens are its output): length-dependent RoPE
    rotates as transformers' generate would for that prompt (SeqChunk.num_prompt_tokens)."""
    return request.num_prompt_tokens - request.num_previous_output_tokens


def _last_rows(chunks: Sequence[ScheduledChunk], indices: Sequence[int]) -> list[int]:
    ends, total = [], 0
    for chunk in chunks:
        total += chunk.num_tokens
        ends.append(total - 1)
    return [ends[i] for i in indices]
