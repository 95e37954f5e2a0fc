"""The engine side of structured outputs (structured_output.py): per request a llguidance matcher that follows
its output, per step one batched bitmask call for the constrained rows and -inf for what they may not emit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from flotilla.engine.device_copy import to_device
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.structured_output import FIELD, StructuredOutput, compile_grammar

_executor: Any = None  # llguidance.LLExecutor: its thread pool computes a step's masks together


class GrammarBackend:
    """One engine's vocabulary for llguidance, built on first use (~0.5 s for SmolLM2's 49k tokens)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]):
        """`tokenizer_json()`: tokenizer.json text, asked for only at the first structured request (serialising a
        large vocabulary costs start-up time every engine would otherwise pay)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the logits' width (the embedding may be larger than the tokenizer)
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def matcher(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> Any:
        """A matcher at the start of the output, then past `replay` (a resumed stream's delivered tokens);
        InvalidRequestError (field structured_output) for a spec or a replay the grammar refuses."""
        import llguidance

        if not isinstance(spec, StructuredOutput):
            raise InvalidRequestError(FIELD, "must be a StructuredOutput")
        grammar = compile_grammar(spec)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(FIELD, f"invalid {spec.kind}: {matcher.get_error()}")
        if replay and not matcher.consume_tokens(list(replay)):
            raise InvalidRequestError(FIELD, f"the delivered output does not follow the {spec.kind}: "
                                             f"{matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos_token_ids or None)
            return self._tokenizer


def mask_logits(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> torch.Tensor:
    """A copy of `logits` [N, V] whose `rows` have every token their matcher disallows at -inf."""
    global _executor
    import llguidance

    words = (logits.shape[1] + 31) // 32
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4,
                                      len(rows))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little", count=logits.shape[1])
    disallowed = to_device(bits, logits.device) == 0
    if list(rows) == list(range(logits.shape[0])):  # every row constrained: no gather, no scatter
        return logits.masked_fill(disallowed, float("-inf"))
    index = to_device(list(rows), logits.device, torch.int64)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill_(disallowed, float("-inf"))
    return masked
