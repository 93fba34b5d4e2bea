"""llama.cpp GGUF files (Llama and Qwen2 families) converted once into ordinary checkpoint directories.

A GGUF file holds the weights (often quantised: Q4_K, Q6_K, Q5_0, Q8_0, ...), the model's shape and its
tokenizer as metadata under llama.cpp's key names. The engine loads Hugging Face checkpoint directories, so a
GGUF file is converted once into the model cache and every later load reads that directory (seconds, where
de-quantising the file takes about a minute per billion parameters on two cores):

- weights: read with the ``gguf`` package (published by the llama.cpp project), de-quantised with its
  ``gguf.quants.dequantize`` to float32 (the exact values the quantised blocks encode; the engine casts to
  its own dtype when it loads), renamed from llama.cpp's tensor names to the Hugging Face layout, and written
  as safetensors shards with an index;
- the ``llama`` architecture: llama.cpp's converter permutes the rows of ``q_proj`` and ``k_proj`` (weights
  and biases) per head so that its rotary embedding can rotate adjacent pairs; the permutation is inverted here
  (the same inversion transformers applies when it loads such a file). ``qwen2`` files are stored unpermuted
  (llama.cpp rotates them NeoX-style) and carry q/k/v biases;
- ``config.json`` from the metadata (``{arch}.block_count``, ``.embedding_length``, ...); the output
  projection is untied whenever the file stores ``output.weight`` (llama.cpp writes it only when it differs
  from the embedding matrix);
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) through transformers'
  GGUF tokenizer conversion;
- ``generation_config.json`` with every end-of-generation id: the file's ``eos``/``eot``/``eom`` ids plus the
  vocabulary's end-of-turn tokens, the rule llama.cpp's vocabulary loader applies (for Qwen2.5-Coder:
  ``<|im_end|>`` 151645 and ``<|endoftext|>`` 151643, which is also what Qwen publishes in its own
  ``generation_config.json``).

The converted directory lives in ``$SPECSTREAM_CACHE/converted/<file stem>-<fingerprint>`` (default
``~/.cache/specstream``); the fingerprint covers the file's resolved path, size and modification time and this
converter's version, so a changed file converts again (and the stale conversion of the same path is deleted).
A free-space check runs first; the conversion writes into a temporary directory beside the target and renames it
into place when complete, so an interrupted conversion never leaves a directory that looks converted. A file
lock serialises concurrent conversions of the same file.

Errors: :class:`~specstream.errors.CheckpointNotFoundError` (no such file, not a GGUF file),
:class:`~specstream.errors.UnsupportedArchitectureError` (another architecture, an unknown tensor, a rope
scaling the engine does not run), :class:`~specstream.errors.InsufficientSpaceError` (nothing was written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import CheckpointNotFoundError, InsufficientSpaceError, UnsupportedArchitectureError

#: bumped whenever the converted output changes, so old conversions are not reused
CONVERTER_VERSION = 1
#: float32 bytes per safetensors shard (bounds the conversion's memory)
SHARD_BYTES = 1 << 30
#: free bytes required beyond the de-quantised weights (tokenizer files, configs, filesystem slack)
SPACE_MARGIN = 64 << 20
#: llama.cpp architectures whose decoder the engine runs -> Hugging Face (model_type, architecture class)
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
#: end-of-turn token texts llama.cpp's vocabulary loader treats as end of generation (llama-vocab.cpp)
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
                     "<｜end▁of▁sentence｜>", "<|eom_id|>")
_MAGIC = b"GGUF"


def cache_root() -> Path:
    """``$SPECSTREAM_CACHE/converted`` (default ``~/.cache/specstream/converted``)."""
    return Path(os.environ.get("SPECSTREAM_CACHE") or Path.home() / ".cache" / "specstream").expanduser() / "converted"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for a readable file that starts with the GGUF magic bytes."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == _MAGIC
    except OSError:
        return False


def gguf_in_dir(path: str | os.PathLike) -> Path | None:
    """The one ``*.gguf`` file of a directory without ``config.json`` (a fetched model's folder), else None.

    Raises:
        CheckpointNotFoundError: the directory holds several GGUF files (say which one to load).
    """
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointNotFoundError(f"{p} holds several GGUF files ({', '.join(f.name for f in files)}): "
                                      f"pass the path of the one to load")
    return files[0] if files else None


# -- metadata --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file and where it goes.

    Attributes:
        gguf_name: llama.cpp's name (``blk.3.attn_q.weight``).
        hf_name: the Hugging Face name (``model.layers.3.self_attn.q_proj.weight``).
        shape: the Hugging Face shape (``[out_features, in_features]`` for a linear weight).
        qtype: the ggml type name (``Q4_K``, ``F32``, ...).
        nbytes: bytes once de-quantised to float32.
    """

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    qtype: str
    nbytes: int


@dataclass(frozen=True)
class GgufModel:
    """What :func:`read_gguf` learns from a file's metadata (no tensor data is read).

    Attributes:
        path: the file.
        architecture: llama.cpp's ``general.architecture`` (``llama``, ``qwen2``).
        config: the Hugging Face ``config.json`` contents.
        generation_config: ``generation_config.json`` contents (every end-of-generation id).
        tensors: every tensor, in file order.
        reader: the open ``gguf.GGUFReader`` (memory-mapped; parsing its header is the slow part of a read).
    """

    path: Path
    architecture: str
    config: dict[str, Any]
    generation_config: dict[str, Any]
    tensors: tuple[GgufTensor, ...]
    reader: Any = field(default=None, repr=False, compare=False)

    @property
    def float32_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _tensor_names(num_layers: int) -> dict[str, str]:
    """llama.cpp tensor name (without ``.weight``/``.bias``) -> Hugging Face module name, from gguf's own
    name table (``gguf.TENSOR_NAMES``)."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    names = {TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
             TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm",
             TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head"}
    per_layer = {MODEL_TENSOR.ATTN_NORM: "input_layernorm", MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
                 MODEL_TENSOR.ATTN_K: "self_attn.k_proj", MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
                 MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj", MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
                 MODEL_TENSOR.FFN_GATE: "mlp.gate_proj", MODEL_TENSOR.FFN_UP: "mlp.up_proj",
                 MODEL_TENSOR.FFN_DOWN: "mlp.down_proj"}
    for i in range(num_layers):
        for tensor, hf in per_layer.items():
            names[TENSOR_NAMES[tensor].format(bid=i)] = f"model.layers.{i}.{hf}"
    return names


def end_of_generation_ids(tokens: list[str], eos: int | None, eot: int | None = None,
                          eom: int | None = None) -> list[int]:
    """Every id that ends generation, in llama.cpp's manner: ``eos``, ``eot``, ``eom``, then each vocabulary
    entry whose text is a known end-of-turn token (:data:`END_OF_TURN_TEXTS`). ``eos`` first."""
    out: list[int] = []
    for i in (eos, eot, eom):
        if i is not None and 0 <= int(i) < len(tokens) and int(i) not in out:
            out.append(int(i))
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    for text in END_OF_TURN_TEXTS:
        i = index.get(text)
        if i is not None and i not in out:
            out.append(i)
    return out


def _config(reader, arch: str, tensor_names: set[str], vocab_size: int) -> dict[str, Any]:
    def key(name: str, default: Any = None, required: bool = True) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None and required:
            raise UnsupportedArchitectureError(f"GGUF metadata lacks {arch}.{name}")
        return value

    model_type, cls = ARCHITECTURES[arch]
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedArchitectureError("GGUF with per-layer kv head counts is not a Llama-family decoder")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", None) or hidden // heads)
    rotary = _field(reader, f"{arch}.rope.dimension_count", None)
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedArchitectureError(f"partial rotary embedding ({rotary} of {head_dim} dims) is not supported")
    theta = float(key("rope.freq_base", 10000.0, required=False))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _field(reader, f"{arch}.rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedArchitectureError(f"GGUF rope scaling {scaling!r} is not supported (none, linear)")
        rope = {"rope_type": "linear", "rope_theta": theta,
                "factor": float(key("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedArchitectureError("GGUF with per-frequency rope factors (rope_freqs, Llama 3.1 scaling) "
                                           "is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": rope,
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
        "gguf_source": {"name": _field(reader, "general.name"), "file_type": _field(reader, "general.file_type")},
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = dict(rope)
    if model_type == "qwen2":
        config.update({"use_sliding_window": False, "sliding_window": None})
    else:
        bias = any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for n in tensor_names)
        config.update({"attention_bias": bias, "mlp_bias": False})
    return config


def read_gguf(path: str | os.PathLike) -> GgufModel:
    """Read a GGUF file's metadata and tensor table (the tensor data stays on disk, memory-mapped).

    Raises:
        CheckpointNotFoundError: missing or not a GGUF file.
        UnsupportedArchitectureError: not a Llama/Qwen2 decoder, or tensors the engine has no place for.
    """
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise CheckpointNotFoundError(f"GGUF file {p} does not exist")
    if not is_gguf_file(p):
        raise CheckpointNotFoundError(f"{p} is not a GGUF file (no GGUF magic bytes)")
    try:
        reader = GGUFReader(p)
    except Exception as exc:  # a truncated or damaged file
        raise CheckpointNotFoundError(f"{p}: cannot read the GGUF file ({type(exc).__name__}: {exc})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{p.name}: GGUF architecture {arch!r} is not supported; the engine decodes {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise UnsupportedArchitectureError(f"{p.name}: no token_embd.weight tensor")
    vocab_size = int(embd.shape[-1])
    config = _config(reader, arch, names, vocab_size)
    mapping = _tensor_names(config["num_hidden_layers"])
    tensors, unknown = [], []
    for t in reader.tensors:
        stem, _, suffix = t.name.rpartition(".")
        hf = mapping.get(stem)
        if hf is None or suffix not in ("weight", "bias"):
            unknown.append(t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dimension first
        n = int(np.prod(shape))
        tensors.append(GgufTensor(t.name, f"{hf}.{suffix}", shape, t.tensor_type.name, 4 * n))
    if unknown:
        raise UnsupportedArchitectureError(f"{p.name}: tensors with no place in a {arch} decoder: {unknown[:5]}")
    eog = end_of_generation_ids(tokens, config["eos_token_id"], _field(reader, "tokenizer.ggml.eot_token_id"),
                                _field(reader, "tokenizer.ggml.eom_token_id"))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eog or config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"]}
    return GgufModel(p, arch, config, generation, tuple(tensors), reader)


# -- weights ---------------------------------------------------------------------------------------------------


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's per-head row permutation of ``q_proj``/``k_proj`` (``convert_hf_to_gguf.py``
    ``LlamaModel.permute``: each head's rows ``[first halves | second halves]`` were interleaved pairwise)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantized_tensors(model: GgufModel):
    """Yield ``(GgufTensor, float32 ndarray in the Hugging Face layout)`` in file order, one at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = model.reader if model.reader is not None else GGUFReader(model.path)
    by_name = {t.name: t for t in reader.tensors}
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    for info in model.tensors:
        raw = by_name[info.gguf_name]
        values = np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32).reshape(info.shape)
        if model.architecture == "llama":
            if ".attn_q." in info.gguf_name:
                values = _unpermute(values, heads)
            elif ".attn_k." in info.gguf_name:
                values = _unpermute(values, kv_heads)
        yield info, np.ascontiguousarray(values)


# -- quantized conversion (int8 / int4 checkpoints, kernels/quant.py) ---------------------------------------------

#: marker file of a quantized converted checkpoint: {"dtype": label, "fingerprint": ..., "tensors": {name: how}}
QUANTIZED_MARKER = "QUANTIZED.json"


def int4_from_blocks(raw, qtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Int4 group-32 codes of a Q4_0 or Q4_K tensor read from its own blocks (no float32 copy of the tensor):
    ``(codes [N, K] uint8 in 0..15, scales_and_zeros [K / 32, N, 2] float32)`` in the convention of
    PyTorch's int4 kernels, ``w = (q - 8) * scale + zero``. None for other types.

    - Q4_0 (blocks of 32: fp16 ``d``, ``w = d * (q - 8)``): scale ``d``, zero 0;
    - Q4_K (super-blocks of 256 = 8 sub-blocks of 32, ``w = d * sc_j * q - dmin * m_j``, 6-bit ``sc``/``m``):
      scale ``d * sc_j``, zero ``8 * d * sc_j - dmin * m_j``.

    The codes are llama.cpp's own; the result is exact up to the bfloat16 rounding of scale and zero (relative
    2^-9) when the caller stores them in bfloat16.
    """
    from gguf.quants import Q4_K

    n, k = shape
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if qtype == "Q4_0":
        blocks = data.reshape(-1, 18)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        qs = blocks[:, 2:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)  # element j: low nibble j, element j+16: high nibble
        scale, zero = d, np.zeros_like(d)
    elif qtype == "Q4_K":
        blocks = data.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 15).reshape(-1, 256)  # chunk i: low nibbles sub-block 2i, high nibbles 2i + 1
        scale = (d * sc.astype(np.float32)).reshape(-1)
        zero = 8.0 * scale - (dmin * m.astype(np.float32)).reshape(-1)
    else:
        return None
    codes = codes.reshape(n, k).astype(np.uint8)
    sz = np.stack([scale.reshape(n, k // 32).T, zero.reshape(n, k // 32).T], axis=-1)
    return codes, np.ascontiguousarray(sz)


def _raw_tensors(model: GgufModel):
    from gguf import GGUFReader

    reader = model.reader if model.reader is not None else GGUFReader(model.path)
    return {t.name: t for t in reader.tensors}


def _is_linear_weight(info: GgufTensor) -> bool:
    return info.hf_name.endswith(".weight") and len(info.shape) == 2


def convert_gguf_quantized(src: str | os.PathLike, dst: str | os.PathLike, label: str,
                           show_progress: bool | None = None) -> Path:
    """Convert the GGUF file ``src`` into a quantized checkpoint directory ``dst`` for weight format ``label``
    (``int8``, ``int4``, ``int4-g64``): each 2-D weight becomes ``NAME.int8`` + ``NAME.scales`` or ``NAME.int4``
    (row-major nibbles, ``[N, K / 2]`` uint8, even column low) + ``NAME.scales_and_zeros``; norms and biases stay
    float32. Packing into the kernels' layout happens at load time (it is the machine's).

    From the file's own blocks where that is exact: Q4_0 / Q4_K -> int4 groups of 32 (:func:`int4_from_blocks`).
    Q8_0 -> int8 is not: its scales are per block of 32, int8 here is per output channel, so such tensors (and
    every other type: Q6_K, Q5_*, F16, F32) are de-quantized one tensor at a time and re-quantized, with a log
    line per type. ``QUANTIZED.json`` records, per tensor, which way it went.

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, InsufficientSpaceError.
    """
    import logging

    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from specstream.kernels.quant import int4_packable, parse_weight_format, quantize_int4, quantize_int8

    log = logging.getLogger("specstream.gguf")
    fmt = parse_weight_format(label)
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    model = read_gguf(src)
    check_space(dst.parent, model.float32_bytes // 4 + SPACE_MARGIN, "converting", _CONVERT_SPACE)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    raw_by_name = _raw_tensors(model)
    how: dict[str, str] = {}
    logged: set[str] = set()
    try:
        out: dict[str, torch.Tensor] = {}
        for info in model.tensors:
            raw = raw_by_name[info.gguf_name]
            qtype = raw.tensor_type.name
            rows = None
            if model.architecture == "llama" and ".attn_q." in info.gguf_name:
                rows = heads
            elif model.architecture == "llama" and ".attn_k." in info.gguf_name:
                rows = kv_heads
            direct = None
            if _is_linear_weight(info) and fmt.name == "int4" and fmt.group_size == 32:
                direct = int4_from_blocks(raw.data, qtype, info.shape)
            if direct is not None:
                codes, sz = direct
                if rows is not None:
                    codes = _unpermute(codes, rows)
                    sz = np.ascontiguousarray(_unpermute(sz.swapaxes(0, 1), rows).swapaxes(0, 1))
                q = torch.from_numpy(np.ascontiguousarray(codes))
                out[info.hf_name + ".int4"] = (q[:, ::2] | q[:, 1::2] << 4).contiguous()
                out[info.hf_name + ".scales_and_zeros"] = torch.from_numpy(sz).to(torch.bfloat16)
                how[info.hf_name] = f"{qtype} blocks -> int4 g32"
                continue
            values = np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32).reshape(info.shape)
            if rows is not None:
                values = _unpermute(values, rows)
            w = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
            if not _is_linear_weight(info):
                out[info.hf_name] = w
                how[info.hf_name] = f"{qtype} -> float32"
                continue
            if qtype not in logged:
                logged.add(qtype)
                log.info("%s: %s tensors de-quantized one at a time and re-quantized to %s%s", src.name, qtype,
                         fmt.label, " (Q8_0's per-block scales are not per-channel int8)" if qtype == "Q8_0" else "")
            packable = int4_packable(*info.shape, fmt.group_size) if fmt.name == "int4" else False
            if fmt.name == "int8" or not packable:  # int4 the kernel cannot pack (K % group): int8
                q8, s8 = quantize_int8(w)
                out[info.hf_name + ".int8"], out[info.hf_name + ".scales"] = q8, s8
                if fmt.name == "int4":
                    how[info.hf_name] = f"{qtype} de-quantized -> int8 (shape not packable as {fmt.label})"
                    continue
            else:
                q4, sz4 = quantize_int4(w, fmt.group_size)
                out[info.hf_name + ".int4"] = (q4[:, ::2] | q4[:, 1::2] << 4).contiguous()
                out[info.hf_name + ".scales_and_zeros"] = sz4
            how[info.hf_name] = f"{qtype} de-quantized -> {fmt.label}"
            del w, values
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": "gguf"})
        del out
        (tmp / "config.json").write_text(json.dumps(model.config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2))
        _write_tokenizer(model, tmp)
        (tmp / QUANTIZED_MARKER).write_text(json.dumps({
            "dtype": fmt.label, "source": str(src.resolve()), "fingerprint": fingerprint(src),
            "seconds": round(time.perf_counter() - t0, 1), "tensors": how}, indent=2))
        st = src.resolve().stat()
        (tmp / "CONVERTED_FROM").write_text(json.dumps({
            "source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "fingerprint": fingerprint(src), "dtype": fmt.label, "converter_version": CONVERTER_VERSION}, indent=2))
        _publish(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def fingerprint(path: str | os.PathLike) -> str:
    """16 hex digits naming a file's conversion: resolved path, size, modification time, converter version."""
    p = Path(path).resolve()
    st = p.stat()
    text = f"{p}:{st.st_size}:{st.st_mtime_ns}:v{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_CONVERT_SPACE = "the de-quantised float32 weights"


def check_space(folder: Path, need: int, doing: str, what: str) -> None:
    """Raise unless ``need`` bytes are free on the disk of ``folder`` (or of its nearest existing parent).

    ``doing`` and ``what`` name the work in the message: "{doing} needs about N GiB free under {folder} ({what})".
    Used here (GGUF conversion) and by ``pipeline/models_fetch.py`` (fetching weights).

    Raises:
        InsufficientSpaceError: less than ``need`` bytes free.
    """
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise InsufficientSpaceError(
            f"{doing} needs about {need / 2**30:.2f} GiB free under {folder} ({what}), but only "
            f"{free / 2**30:.2f} GiB is free; free some space or set SPECSTREAM_CACHE to another disk")


#: what :func:`_write_tokenizer` leaves in a conversion (transformers' ``save_pretrained`` of a GGUF tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "added_tokens.json")


def _sibling_tokenizer(src: Path) -> Path | None:
    """A complete conversion of the same file (the same fingerprint) for another weight format that holds its
    tokenizer, or None."""
    fp = fingerprint(src)
    root = cache_root()
    if not root.is_dir():
        return None
    base = f"{src.expanduser().stem}-{fp}"  # cache_key's names: base, base-int8, base-int4, ...
    for folder in sorted(p for p in root.iterdir() if p.name == base or p.name.startswith(base + "-")):
        label = folder.name[len(base) + 1:] or "float32"  # the inverse of cache_key
        if _converted_ok(folder, fp, label) and (folder / "tokenizer.json").is_file():
            return folder
    return None


def _write_tokenizer(model: GgufModel, out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (chat template included) via transformers' GGUF tokenizer
    conversion; copied instead from a conversion of the same file for another weight format when one exists (the
    tokenizer does not depend on the weights' format: rebuilding it parses the file's 151,936-entry vocabulary and
    merges again: the 1.5B Qwen2.5 file's int4 conversion took 32.6 s with it and 21.5 s without, AMD EPYC Zen 4,
    2026-12-07; ``docs/models.md``)."""
    sibling = _sibling_tokenizer(model.path)
    if sibling is not None:
        for name in TOKENIZER_FILES:
            if (sibling / name).is_file():
                shutil.copyfile(sibling / name, out / name)
        return
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    except Exception as exc:  # a tokenizer type transformers cannot rebuild
        raise UnsupportedArchitectureError(
            f"{model.path.name}: cannot rebuild its tokenizer (tokenizer.ggml.model) with transformers: "
            f"{type(exc).__name__}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").exists():
        raise UnsupportedArchitectureError(f"{model.path.name}: transformers wrote no tokenizer.json for this file")


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, show_progress: bool | None = None) -> Path:
    """Convert the GGUF file ``src`` into the checkpoint directory ``dst`` (replaced if it exists).

    Writes ``model-0000N-of-0000M.safetensors`` (float32, shards of at most :data:`SHARD_BYTES`) with
    ``model.safetensors.index.json``, ``config.json``, ``generation_config.json``, the tokenizer files and
    ``CONVERTED_FROM`` (source, fingerprint, seconds taken). The directory appears only when complete.

    Args:
        show_progress: a tqdm bar on stderr with the float32 bytes written (default: when stderr is a terminal).

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, InsufficientSpaceError.
    """
    from safetensors.numpy import save_file
    from tqdm import tqdm

    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    model = read_gguf(src)
    check_space(dst.parent, model.float32_bytes + SPACE_MARGIN, "converting", _CONVERT_SPACE)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    show = sys.stderr.isatty() if show_progress is None else show_progress
    try:
        weight_map: dict[str, str] = {}
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        with tqdm(total=model.float32_bytes, desc=f"convert {src.name}", unit="B", unit_scale=True,
                  unit_divisor=1024, disable=not show, file=sys.stderr, dynamic_ncols=True) as bar:
            def flush() -> None:
                index = len(shards)
                name = f"model-{index:05d}.safetensors"
                save_file(shards[-1], str(tmp / name), metadata={"format": "pt", "source": "gguf"})
                for k in shards[-1]:
                    weight_map[k] = name
                shards[-1] = {}

            for info, values in dequantized_tensors(model):
                if shards[-1] and size + info.nbytes > SHARD_BYTES:
                    flush()
                    shards.append({})
                    size = 0
                shards[-1][info.hf_name] = values
                size += info.nbytes
                bar.update(info.nbytes)
            flush()
        # name shards -0000i-of-0000n as Hugging Face does, now that their count is known
        total = len(shards)
        renames = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{total:05d}.safetensors"
                   for i in range(1, total + 1)}
        for old, new in renames.items():
            (tmp / old).rename(tmp / new)
        index = {"metadata": {"total_size": model.float32_bytes},
                 "weight_map": {k: renames[v] for k, v in sorted(weight_map.items())}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(model.config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2))
        _write_tokenizer(model, tmp)
        st = src.resolve().stat()
        (tmp / "CONVERTED_FROM").write_text(json.dumps({
            "source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "fingerprint": fingerprint(src), "converter_version": CONVERTER_VERSION,
            "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
        _publish(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _publish(tmp: Path, dst: Path) -> None:
    """Move a complete conversion ``tmp`` into place at ``dst`` (replacing a stale one): readable like any checkpoint
    (mkdtemp made it private), and renamed last, so an interrupted conversion never looks converted."""
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def _converted_ok(folder: Path, fp: str, label: str = "float32") -> bool:
    marker = folder / "CONVERTED_FROM"
    try:
        info = json.loads(marker.read_text())
        return (info.get("fingerprint") == fp and info.get("dtype", "float32") == label
                and (folder / "config.json").exists())
    except (OSError, ValueError):
        return False


def cache_key(src: str | os.PathLike, label: str = "float32") -> str:
    """The cache folder name of ``src`` converted for weight format ``label``: ``<stem>-<fingerprint>`` for
    float32 (the de-quantized checkpoint, also what bfloat16 loads), ``<stem>-<fingerprint>-<label>`` for the
    quantized ones; a conversion for one dtype is never used for another."""
    p = Path(src).expanduser()
    base = f"{p.stem}-{fingerprint(p)}"
    return base if label in ("float32", "bfloat16") else f"{base}-{label}"


def converted_gguf_dir(src: str | os.PathLike, show_progress: bool | None = None, dtype: str = "float32") -> Path:
    """The converted checkpoint of the GGUF file ``src`` for weight format ``dtype`` (float32 and bfloat16
    share the de-quantized float32 one; int8 / int4 have their own, :func:`convert_gguf_quantized`),
    converting it on first use (and when the file changed); other conversions of the same path and dtype are
    deleted.

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, InsufficientSpaceError.
    """
    from filelock import FileLock

    src = Path(src).expanduser()
    if not src.is_file():
        raise CheckpointNotFoundError(f"GGUF file {src} does not exist")
    fp = fingerprint(src)
    label = "float32" if dtype in ("float32", "bfloat16") else dtype
    root = cache_root()
    dst = root / cache_key(src, label)
    if _converted_ok(dst, fp, label):
        return dst
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{src.stem}.lock")):
        if _converted_ok(dst, fp, label):  # another process converted it while we waited
            return dst
        _remove_stale(root, src.resolve(), keep=dst, label=label)
        if label == "float32":
            convert_gguf(src, dst, show_progress)
        else:
            convert_gguf_quantized(src, dst, label, show_progress)
    return dst


def _remove_stale(root: Path, source: Path, keep: Path, label: str = "float32") -> None:
    """Delete earlier conversions of ``source`` (another size or mtime) and partial ones left by a killed run."""
    for folder in root.iterdir():
        if folder == keep or not folder.is_dir():
            continue
        if folder.name.startswith(".") and ".partial-" in folder.name:
            converting = folder.name[1:].rsplit(".partial-", 1)[0]  # "<stem>-<fingerprint>"
            if converting.rsplit("-", 1)[0] == source.stem:
                shutil.rmtree(folder, ignore_errors=True)  # the lock is ours: no conversion of this stem is running
            continue
        marker = folder / "CONVERTED_FROM"
        try:
            info = json.loads(marker.read_text())
            if info.get("source") == str(source) and info.get("dtype", "float32") == label:
                shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            continue
