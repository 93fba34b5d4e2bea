"""Tiny random Whisper checkpoints, deterministic across torch versions (weights from numpy).

Hugging Face layout (``config.json`` + ``model.safetensors``, optionally Whisper's ``tokenizer.json``), loaded
through the same code path as a hub checkpoint. The default keeps Whisper's real geometry where the pipeline
depends on it (80 mel bins, 1500 encoder frames = 30-s windows, 448 positions, the English vocabulary of 51864
ids) and shrinks the rest. Untrained weights: their transcripts are gibberish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specstream.stages.speculative.models.tiny import save_checkpoint


@dataclass(frozen=True)
class TinyWhisperSpec:
    vocab_size: int = 51864
    d_model: int = 64
    encoder_layers: int = 2
    decoder_layers: int = 2
    attention_heads: int = 4
    ffn_dim: int = 128
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448
    std: float = 0.08
    embed_std: float = 0.6  # the tied output head: wide logit gaps keep greedy argmax away from ties
    extra: dict = field(default_factory=dict)

    def config_dict(self) -> dict:
        cfg = {
            "architectures": ["WhisperForConditionalGeneration"],
            "model_type": "whisper",
            "vocab_size": self.vocab_size,
            "num_mel_bins": self.num_mel_bins,
            "d_model": self.d_model,
            "encoder_layers": self.encoder_layers,
            "encoder_attention_heads": self.attention_heads,
            "encoder_ffn_dim": self.ffn_dim,
            "decoder_layers": self.decoder_layers,
            "decoder_attention_heads": self.attention_heads,
            "decoder_ffn_dim": self.ffn_dim,
            "max_source_positions": self.max_source_positions,
            "max_target_positions": self.max_target_positions,
            "activation_function": "gelu",
            "scale_embedding": False,
            "tie_word_embeddings": True,
            "bos_token_id": 50257,
            "eos_token_id": 50256,
            "pad_token_id": 50256,
            "decoder_start_token_id": 50257,
            "begin_suppress_tokens": [220, 50256],
            "suppress_tokens": [],
            "dtype": "float32",
        }
        cfg.update(self.extra)
        return cfg


def _sinusoids(length: int, channels: int) -> np.ndarray:
    """Whisper's encoder position table (``whisper.model.sinusoids``)."""
    inc = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def random_whisper_state(spec: TinyWhisperSpec, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    d, f = spec.d_model, spec.ffn_dim

    def w(*shape, std=spec.std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ln(prefix: str, out: dict) -> None:
        out[prefix + ".weight"] = (1.0 + w(d)).astype(np.float32)
        out[prefix + ".bias"] = w(d)

    def attn(prefix: str, out: dict) -> None:
        for name in ("q", "k", "v", "out"):
            out[f"{prefix}.{name}_proj.weight"] = w(d, d)
            if name != "k":
                out[f"{prefix}.{name}_proj.bias"] = w(d)

    state: dict[str, np.ndarray] = {
        "model.encoder.conv1.weight": w(d, spec.num_mel_bins, 3),
        "model.encoder.conv1.bias": w(d),
        "model.encoder.conv2.weight": w(d, d, 3),
        "model.encoder.conv2.bias": w(d),
        "model.encoder.embed_positions.weight": _sinusoids(spec.max_source_positions, d),
        "model.decoder.embed_tokens.weight": w(spec.vocab_size, d, std=spec.embed_std),
        "model.decoder.embed_positions.weight": w(spec.max_target_positions, d),
    }
    for side, n in (("encoder", spec.encoder_layers), ("decoder", spec.decoder_layers)):
        for i in range(n):
            p = f"model.{side}.layers.{i}"
            attn(p + ".self_attn", state)
            ln(p + ".self_attn_layer_norm", state)
            if side == "decoder":
                attn(p + ".encoder_attn", state)
                ln(p + ".encoder_attn_layer_norm", state)
            state[p + ".fc1.weight"], state[p + ".fc1.bias"] = w(f, d), w(f)
            state[p + ".fc2.weight"], state[p + ".fc2.bias"] = w(d, f), w(d)
            ln(p + ".final_layer_norm", state)
        ln(f"model.{side}.layer_norm", state)
    return state


def build_tiny_whisper(path: str | Path, spec: TinyWhisperSpec = TinyWhisperSpec(), seed: int = 0,
                       tokenizer_files: list[str | Path] = ()) -> Path:
    """Create a tiny random Whisper checkpoint at ``path``."""
    return save_checkpoint(path, spec.config_dict(), random_whisper_state(spec, seed), tokenizer_files)
