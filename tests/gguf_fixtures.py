"""Tiny GGUF files written with the ``gguf`` package (as llama.cpp's converter writes them), for loader tests.

A byte-level BPE vocabulary (the 256 GPT-2 byte symbols, a few merges, ChatML's special tokens), random weights
from a numpy seed, and llama.cpp's conventions: q/k rows permuted per head for the ``llama`` architecture, the
output projection stored only when untied, K-quant-free types that numpy can quantise (Q8_0, F16, F32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
          ("r", "e"), ("a", "t")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()
    tokens = [byte_symbols[b] for b in range(256)] + ["".join(m) for m in MERGES] + SPECIALS
    types = [1] * (256 + len(MERGES)) + [3] * len(SPECIALS)  # NORMAL, CONTROL
    return tokens, types, [" ".join(m) for m in MERGES]


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The per-head row order llama.cpp's converter gives ``q_proj``/``k_proj`` of the ``llama`` architecture
    (each head's two halves interleaved pairwise)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def random_state(arch: str, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 96, seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """A Hugging Face-layout float32 state dict of a tiny Llama / Qwen2 decoder."""
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary()[0])
    head_dim = hidden // heads

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0),
             "model.norm.weight": 1 + w(hidden, scale=0.05)}
    if not tied:
        state["lm_head.weight"] = w(vocab, hidden, scale=0.6)
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": 1 + w(hidden, scale=0.05),
            p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.05),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
        })
        if arch == "qwen2":
            state.update({p + "self_attn.q_proj.bias": w(heads * head_dim, scale=0.05),
                          p + "self_attn.k_proj.bias": w(kv_heads * head_dim, scale=0.05),
                          p + "self_attn.v_proj.bias": w(kv_heads * head_dim, scale=0.05)})
    return state


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"


def write_gguf(path: Path, arch: str, state: dict[str, np.ndarray], heads: int = 4, kv_heads: int = 2,
               quantize: str = "F32", theta: float = 10000.0, tokenizer_model: str = "gpt2",
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write ``state`` as a GGUF file of ``arch`` (``llama`` permutes q/k as llama.cpp does).

    ``quantize``: ``F32``, ``F16``, ``Q8_0`` or ``Q4_0`` for the 2-D weights (norms and biases stay F32).
    """
    import gguf

    tokens, types, merges = vocabulary()
    hidden = state["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    ffn = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test decoder")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
             "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}[quantize]
    items = list(state.items())
    for name, value in items:
        data = value
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(value, heads if ".q_proj." in name else kv_heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(gguf_name(name), packed, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
