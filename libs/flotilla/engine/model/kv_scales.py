"""Scale factors of an fp8 KV cache, one for K and one for V per layer: a checkpoint's own, or calibrated at start-up.

A cached value is stored as (value / scale) in fp8 and read back as stored * scale. e4m3 saturates at ±448, and
below 2**-6 it keeps fewer than its 3 mantissa bits, so a scale matters for a model whose keys or values pass
±448 (the cache would clip them) or mostly sit far below 1.

A checkpoint quantized for an fp8 cache (llm-compressor's kv_cache_scheme, AutoFP8) carries them as tensors per
layer: `self_attn.k_scale` and `v_scale` (and the older `k_proj.output_scale` / `v_proj.output_scale`, or one
`kv_scale` for both), in the same sense (stored = value / scale). Those are used when present (checkpoint_scales);
a scale per KV head is taken at its largest over the heads, which clips none of them. Otherwise the scales are
measured: one forward pass over a fixed text
(CALIBRATION_TEXT) with a cache in the model's own dtype records each layer's largest |K| and |V|. A scale is
the power of two that brings that largest value to at most 1/HEADROOM of the format's maximum, so traffic
that runs past the calibration text's range by up to HEADROOM still fits. Powers of two multiply exactly, and
two workers that measure a largest value in the same binade agree on the scale bit for bit, which
disaggregated workers need: the prefill worker's blocks are read by the decode worker.

The scale is applied without touching the attention kernels: K's scale is folded into q.k's scale and V's
scale multiplies the attention output (attention.paged_attention).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

# Traffic may reach this many times the calibration text's largest |K| or |V| before the cache saturates.
HEADROOM = 4.0

# Prose, dialogue, code, numbers and markup: a spread of what a serving fleet sees.
CALIBRATION_TEXT = """\
The lighthouse keeper climbed the spiral stairs at dusk, as he had every evening for thirty-one years. Below him
the sea broke against the rocks, grey and white, and the gulls wheeled over the harbour.
User: Can you explain how a refrigerator keeps food cold?
Assistant: A refrigerator moves heat out of its insulated box. A compressor squeezes a refrigerant gas, which
heats it; the hot gas gives its heat to the room through coils at the back, condenses into a liquid, then
expands through a valve and evaporates inside the box, absorbing heat from the food.
def reverse(head):
    previous = None
    while head is not None:
        head.next, previous, head = previous, head, head.next
    return previous
SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name ORDER BY 2 DESC;
{"id": 4127, "items": [{"sku": "A-19", "qty": 3, "price": 12.50}], "total": 37.50, "paid": true}
In 1789 the Estates-General met at Versailles; by July the Bastille had fallen, and on 26 August the Assembly
adopted the Declaration of the Rights of Man and of the Citizen. Prices: 3.14159, 2.71828, 1,000,000, -42, 7e-3.
<h1>Release notes</h1><ul><li>Faster prefill on long prompts</li><li>Fixed a crash on empty input</li></ul>
Bonjour, comment allez-vous ? Très bien, merci. ¿Dónde está la estación? 東京は日本の首都です。
"""


class KVScales(NamedTuple):
    """One layer's: stored K = K / k, stored V = V / v."""

    k: float
    v: float

    @property
    def is_unit(self) -> bool:
        return self.k == 1.0 and self.v == 1.0


UNIT = KVScales(1.0, 1.0)


def needs_scales(kv_dtype: torch.dtype) -> bool:
    """The 1-byte float formats: their range and precision are narrow enough for scales to matter."""
    return kv_dtype.is_floating_point and kv_dtype.itemsize == 1


def scale_for(largest: float, kv_dtype: torch.dtype, headroom: float = HEADROOM) -> float:
    """The power of two s with largest / s <= max(kv_dtype) / headroom, as large a stored value as that allows."""
    if not math.isfinite(largest):
        raise ValueError(f"the calibration pass gave a largest K/V of {largest}")
    if largest == 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(largest * headroom / torch.finfo(kv_dtype).max))


class RangeRecorder:
    """Each layer's largest |K| and |V| over the forward passes it watched (attention modules call `observe`)."""

    def __init__(self, num_layers: int) -> None:
        self.largest = [[0.0, 0.0] for _ in range(num_layers)]

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        entry = self.largest[layer]
        entry[0] = max(entry[0], k.abs().max().item())
        entry[1] = max(entry[1], v.abs().max().item())

    def scales(self, kv_dtype: torch.dtype) -> list[KVScales]:
        return [KVScales(scale_for(k, kv_dtype), scale_for(v, kv_dtype)) for k, v in self.largest]


# A checkpoint's KV-cache scale tensors: (layer, kind). q_scale and prob_scale (an fp8 attention computation's)
# match too, and are read as nothing: attention here computes in the model's dtype.
CHECKPOINT_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|q_scale|prob_scale|k_proj\.output_scale"
    r"|v_proj\.output_scale)$"
)
_KINDS = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v", "kv_scale": "kv"}


def checkpoint_scales(tensors: Mapping[str, torch.Tensor], num_layers: int) -> list[KVScales] | None:
    """Per-layer scales from a checkpoint's scale tensors (names matching CHECKPOINT_SCALE_NAME); None when it has
    no K/V scale. Raises ValueError when some layer lacks one, or one is not a positive finite number."""
    found: dict[tuple[int, str], float] = {}
    for name, tensor in tensors.items():
        layer, kind = CHECKPOINT_SCALE_NAME.match(name).groups()
        kind = _KINDS.get(kind)
        if kind is None:
            continue
        value = float(tensor.float().max()) if tensor.numel() else float("nan")  # a scale per KV head: the largest
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV-cache scale {name} is {value}: it must be a positive finite number")
        for part in ("k", "v") if kind == "kv" else (kind,):
            found[int(layer), part] = value
    if not found:
        return None
    lacking = [f"layer {layer} {part}_scale" for layer in range(num_layers) for part in ("k", "v")
               if (layer, part) not in found]
    if lacking:
        raise ValueError(f"KV-cache scales lack {', '.join(lacking[:4])}"
                         f"{' ...' if len(lacking) > 4 else ''} ({len(found)} of {2 * num_layers} given)")
    return [KVScales(found[layer, "k"], found[layer, "v"]) for layer in range(num_layers)]


def describe(kv_dtype: torch.dtype, scales: Sequence[KVScales]) -> str:
    """The cache's format as peers compare it before they move blocks: dtype, and the scales when any is not 1."""
    name = str(kv_dtype).removeprefix("torch.")
    if all(scale.is_unit for scale in scales):
        return name
    return name + " scales " + " ".join(f"{scale.k:g}/{scale.v:g}" for scale in scales)
