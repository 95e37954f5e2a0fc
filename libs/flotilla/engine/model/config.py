"""Model shape and numerics parsed from a Hugging Face checkpoint's config.json (no transformers import)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# rope type -> (required keys, optional keys) of its scaling parameters, as transformers names them
_ROPE_KEYS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "longrope": (("short_factor", "long_factor", "factor", "original_max_position_embeddings"), ("attention_factor",)),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    # max_position_embeddings is ours: transformers' dynamic NTK reads it from the config, not the rope dict
    "dynamic": (("factor", "max_position_embeddings"), ()),
}
SUPPORTED_ROPE_TYPES = ("default", *_ROPE_KEYS)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MLP layers (Qwen3-MoE): `sparse_layers` lists the layers whose MLP is the experts."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a Llama-family or Gemma 2/3 decoder.

    Sliding-window attention is masked per layer: a query at position p of a layer in `sliding_layers` sees
    the keys at positions p - sliding_window + 1 .. p (Mistral, Phi-3 and Qwen3-MoE: every layer when the
    config has a window; Qwen2/3: the layers from max_window_layers on; Gemma 2/3: their sliding layers).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    # None means plain RoPE; else {"rope_type": "linear"|"llama3"|"longrope"|"yarn"|"dynamic", ...} with HF's keys.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma's GeGLU)
    torch_dtype: torch.dtype = torch.float32  # the checkpoint's dtype; float32 when config.json omits it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation_config.json's list when present, else config.json's
    sliding_window: int | None = None  # None exactly when no layer slides
    sliding_layers: tuple[int, ...] = ()  # the layers whose attention sees only the last sliding_window keys
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim dims of each head (Phi-3/4)
    moe: MoEConfig | None = None
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits (Gemma 2/3)
    # Gemma 3's sliding layers rotate with their own RoPE (rope_local_base_freq); None: the one above
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = _read_json(model_dir / "config.json")
        generation = _read_json(model_dir / "generation_config.json", required=False)
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architecture = _architecture(raw)
        gemma = architecture in GEMMA_ARCHITECTURES
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or (256 if gemma else hidden_size // num_heads))  # Gemma's default
        num_layers = int(raw["num_hidden_layers"])
        hidden_act = _check_supported(raw, architecture, num_heads, num_kv_heads)
        full_rope, sliding_rope = _rope_sources(raw, architecture)
        rope_theta, rope_scaling, partial_rotary_factor = _rope(raw, architecture, full_rope)
        window, sliding_layers = _sliding_layers(raw, architecture, num_layers)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_model_len=_max_model_len(int(raw["max_position_embeddings"]), rope_scaling),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma configs tie by default
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            hidden_act=hidden_act,
            torch_dtype=_dtype(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            sliding_window=window,
            sliding_layers=sliding_layers,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            partial_rotary_factor=partial_rotary_factor,
            moe=_moe(raw, architecture),
            **_gemma_fields(raw, architecture, sliding_rope),
        )


def _read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ValueError(f"no {path.name} in {path.parent}")
        return None
    with path.open() as f:
        return json.load(f)


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_supported(raw: dict[str, Any], architecture: str, num_heads: int, num_kv_heads: int) -> str:
    """Raises for what the engine does not build; returns the MLP activation."""
    if architecture in GEMMA_ARCHITECTURES:
        activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers ignores hidden_act here
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {activation!r}; only 'gelu_pytorch_tanh'")
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
    else:
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported hidden_act {activation!r}; only 'silu'")
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    return activation


def _rope_sources(raw: dict[str, Any], architecture: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The RoPE parameters of the full-attention layers, and of the sliding ones where they differ (Gemma 3).

    Gemma 3 as Gemma3TextConfig reads it: transformers 5 nests `rope_parameters` by layer type; transformers 4
    has `rope_theta` (default 1e6) and `rope_scaling` for the full layers, `rope_local_base_freq` (default 1e4)
    for the sliding ones."""
    if architecture != "Gemma3ForCausalLM":
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if any(isinstance(value, dict) for value in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        return dict(params), None
    nested = raw.get("rope_parameters") or {}
    full = dict(nested.get("full_attention") or {})
    sliding = dict(nested.get("sliding_attention") or {})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return full, sliding


def _rope(raw: dict[str, Any], architecture: str, params: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, partial_rotary_factor) from transformers 4 (`rope_theta` + `rope_scaling`) or 5
    (`rope_parameters`) layouts; `original_max_position_embeddings` at the top level wins, as in transformers."""
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config's reading of early Phi-3 configs
    partial = float(params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None, partial
    max_positions = int(raw["max_position_embeddings"])
    if rope_type in ("llama3", "longrope", "yarn"):
        default_original = 4096 if architecture == "Phi3ForCausalLM" else max_positions  # Phi3Config's default
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(original or default_original)
    if rope_type in ("longrope", "yarn") and params.get("factor") is None:
        params["factor"] = max_positions / params["original_max_position_embeddings"]
    if rope_type == "dynamic":
        params["max_position_embeddings"] = max_positions
    required, optional = _ROPE_KEYS[rope_type]
    missing = [key for key in required if params.get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {missing}")
    scaling = {key: params[key] for key in (*required, *optional) if params.get(key) is not None}
    return theta, {"rope_type": rope_type, **scaling}, partial


def _max_model_len(max_positions: int, scaling: dict[str, Any] | None) -> int:
    """transformers sets no limit. As vLLM does, YaRN serves original_max_position_embeddings * factor and dynamic
    NTK max_position_embeddings * factor (the lengths they stretch to); every other type max_position_embeddings."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "yarn":
        return max(max_positions, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    if rope_type == "dynamic":
        return max(max_positions, int(max_positions * scaling["factor"]))
    return max_positions


def _gemma_fields(raw: dict[str, Any], architecture: str, sliding_rope: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 2/3's attention scale, soft-caps and local RoPE, with Gemma2Config's / Gemma3TextConfig's defaults."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    is_gemma2 = architecture == "Gemma2ForCausalLM"
    fields: dict[str, Any] = {
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcap": _float_or_none(raw.get("final_logit_softcapping", 30.0 if is_gemma2 else None)),
        # Gemma 3's config carries attn_logit_softcapping but transformers' Gemma 3 attention never applies it
        "attn_logit_softcap": _float_or_none(raw.get("attn_logit_softcapping", 50.0)) if is_gemma2 else None,
    }
    if sliding_rope is not None:
        theta, scaling, _ = _rope(raw, architecture, sliding_rope)
        fields.update(sliding_rope_theta=theta, sliding_rope_scaling=scaling)
    return fields


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _moe(raw: dict[str, Any], architecture: str) -> MoEConfig | None:
    if architecture != "Qwen3MoeForCausalLM":
        return None
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    num_layers, step = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    top_k = int(raw.get("num_experts_per_tok", 0))
    if sparse and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
    return MoEConfig(num_experts, top_k, int(raw.get("moe_intermediate_size") or 0),
                     bool(raw.get("norm_topk_prob", False)), sparse)


_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_EVERY_LAYER_SLIDES = ("MistralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_layers(raw: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to) as transformers 5 decides them; (None, ()) when no layer slides."""
    gemma = architecture in GEMMA_ARCHITECTURES
    window = raw.get("sliding_window", 4096) if gemma else raw.get("sliding_window")  # Gemma's default
    if architecture == "LlamaForCausalLM" or not window:
        return None, ()
    if architecture in _QWEN and not raw.get("use_sliding_window", False):
        return None, ()  # Qwen2/3 configs carry a sliding_window that is off unless use_sliding_window
    if architecture in _EVERY_LAYER_SLIDES:
        return int(window), tuple(range(num_layers))
    layer_types = raw.get("layer_types") or _default_layer_types(raw, architecture, num_layers)
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must give one of {_LAYER_TYPES} per layer, got {layer_types!r}")
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    return (int(window), layers) if layers else (None, ())


def _default_layer_types(raw: dict[str, Any], architecture: str, num_layers: int) -> list[str]:
    """Configs written before transformers saved layer_types: Qwen2/3 slide from max_window_layers on, Gemma 2
    alternates (sliding first), Gemma 3 has a full layer every sliding_window_pattern (6) layers."""
    if architecture in _QWEN:
        first = int(raw.get("max_window_layers", 28))
        return [_LAYER_TYPES[i >= first] for i in range(num_layers)]
    pattern = 2 if architecture == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
    return [_LAYER_TYPES[bool((i + 1) % pattern)] for i in range(num_layers)]


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}")
    return _DTYPES[name]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
