"""Decoder configuration read from a Hugging Face ``config.json``.

Both spellings of the fields that changed across transformers releases are read: ``rope_parameters``
(transformers 5.x) and ``rope_theta`` / ``rope_scaling`` (older files); ``dtype`` and ``torch_dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from specstream.errors import UnsupportedArchitectureError

#: ``model_type`` values whose decoder the engine runs (Llama family).
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (RoFormer, Su et al. 2021; scaling as in HF's rope utils)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """Return (inverse frequencies ``[head_dim // 2]`` float64, attention scaling factor).

        Raises:
            UnsupportedArchitectureError: for rope types whose frequencies depend on the sequence length.
        """
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if self.rope_type == "default":
            return inv, 1.0
        if self.rope_type == "linear":
            return inv / self.factor, 1.0
        if self.rope_type == "llama3":
            # Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`).
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            out = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * out / self.factor + smooth * out
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, out), 1.0
        raise UnsupportedArchitectureError(
            f"rope type {self.rope_type!r} is not supported (supported: default, linear, llama3)"
        )


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of a Llama-family decoder the runtime needs. Built by :func:`decoder_config_from_dict`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def decoder_config_from_dict(cfg: dict[str, Any]) -> DecoderConfig:
    """Build a :class:`DecoderConfig` from a parsed ``config.json`` (a text model's, or a VLM's ``text_config``).

    Raises:
        UnsupportedArchitectureError: when ``model_type`` is not a Llama-family decoder or a field is unusable.
    """
    model_type = cfg.get("model_type")
    if model_type not in LLAMA_FAMILY:
        archs = cfg.get("architectures") or []
        raise UnsupportedArchitectureError(
            f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
            f"the engine decodes {', '.join(LLAMA_FAMILY)} (and LLaVA models built on them)"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    qwen2 = model_type == "qwen2"
    sliding = cfg.get("sliding_window")
    if qwen2 and not cfg.get("use_sliding_window", False):
        sliding = None
    return DecoderConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope_from_dict(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen2 else bool(cfg.get("attention_bias", False)),
        o_bias=False if qwen2 else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        raw=dict(cfg),
    )
