"""Tiny random Llama-family checkpoints, deterministic across torch versions (weights from numpy).

Used by the embedded default models and by the tests. The files are ordinary Hugging Face checkpoints
(``config.json`` + ``model.safetensors``) loaded through the same code path as a hub checkpoint.
Untrained weights: their text is gibberish.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyDecoderSpec:
    """Shape of a tiny decoder. ``head_scale`` multiplies the output head (wider logit gaps: see tests)."""

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    head_scale: float = 8.0
    std: float = 0.08
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def config_dict(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        cfg = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": None,
            "dtype": "float32",
            "attention_bias": False,
        }
        if self.model_type == "mistral":
            cfg["sliding_window"] = None
        cfg.update(self.extra)
        return cfg


def random_decoder_state(spec: TinyDecoderSpec, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * hd

    def w(*shape, scale=1.0):
        return (rng.standard_normal(shape) * spec.std * scale).astype(np.float32)

    state = {"model.embed_tokens.weight": w(v, h, scale=12.0)}
    qkv_bias = spec.model_type == "qwen2"
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        state[p + "self_attn.q_proj.weight"] = w(spec.num_attention_heads * hd, h)
        state[p + "self_attn.k_proj.weight"] = w(kv, h)
        state[p + "self_attn.v_proj.weight"] = w(kv, h)
        state[p + "self_attn.o_proj.weight"] = w(h, spec.num_attention_heads * hd)
        if qkv_bias:
            state[p + "self_attn.q_proj.bias"] = w(spec.num_attention_heads * hd)
            state[p + "self_attn.k_proj.bias"] = w(kv)
            state[p + "self_attn.v_proj.bias"] = w(kv)
        state[p + "mlp.gate_proj.weight"] = w(i, h)
        state[p + "mlp.up_proj.weight"] = w(i, h)
        state[p + "mlp.down_proj.weight"] = w(h, i)
        state[p + "input_layernorm.weight"] = (1.0 + w(h)).astype(np.float32)
        state[p + "post_attention_layernorm.weight"] = (1.0 + w(h)).astype(np.float32)
    state["model.norm.weight"] = (1.0 + w(h)).astype(np.float32)
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = w(v, h, scale=spec.head_scale)
    return state


def noised_state(state: dict[str, np.ndarray], noise: float, seed: int) -> dict[str, np.ndarray]:
    """A copy of ``state`` with relative Gaussian noise (a draft that agrees with the target partly)."""
    rng = np.random.default_rng(seed)
    return {k: (a + rng.standard_normal(a.shape).astype(np.float32) * noise * float(np.abs(a).mean()))
            .astype(np.float32) for k, a in state.items()}


def save_checkpoint(path: str | Path, config: dict, state: dict[str, np.ndarray],
                    tokenizer_files: list[str | Path] = (), shards: int = 1) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (or ``shards`` files with an index) to ``path``."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    keys = sorted(state)
    if shards <= 1:
        save_file({k: np.ascontiguousarray(state[k]) for k in keys}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        weight_map = {}
        chunks = np.array_split(np.arange(len(keys)), shards)
        for n, idx in enumerate(chunks):
            name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
            part = {keys[j]: np.ascontiguousarray(state[keys[j]]) for j in idx}
            save_file(part, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
        total = int(sum(a.nbytes for a in state.values()))
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for f in tokenizer_files:
        shutil.copy(f, path / Path(f).name)
    return path


def build_tiny_decoder(path: str | Path, spec: TinyDecoderSpec = TinyDecoderSpec(), seed: int = 0,
                       noise_from: dict[str, np.ndarray] | None = None, noise: float = 0.0,
                       tokenizer_files: list[str | Path] = (), shards: int = 1) -> Path:
    """Create a tiny random decoder checkpoint at ``path`` (a noised copy of ``noise_from`` if given)."""
    state = random_decoder_state(spec, seed) if noise_from is None else noised_state(noise_from, noise, seed)
    return save_checkpoint(path, spec.config_dict(), state, tokenizer_files, shards)


def layer_skip_state(state: dict[str, np.ndarray], keep_layers: int) -> dict[str, np.ndarray]:
    """A self-speculative draft (LayerSkip-style): the target's first ``keep_layers`` layers, embeddings and head."""
    out = {}
    for k, a in state.items():
        if k.startswith("model.layers."):
            if int(k.split(".")[2]) >= keep_layers:
                continue
        out[k] = a
    return out
