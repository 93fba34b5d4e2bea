"""Build decoder runtimes from checkpoints: Llama-family decoders (float, int8, int4) and, by dispatch, Whisper.

Checkpoints are found by :mod:`~specstream.stages.speculative.models.checkpoint` (directories, hub ids, GGUF files,
registered models). Tensor names are mapped from the layouts found on disk: ``model.layers.N...`` (causal LMs),
``language_model.model.*`` (older LLaVA files) and ``model.language_model.*`` (transformers 5.x LLaVA).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specstream.errors import UnsupportedArchitectureError
from specstream.stages.speculative.models.checkpoint import Checkpoint, resolve_checkpoint
from specstream.stages.speculative.models.config import DecoderConfig
from specstream.stages.speculative.models.dtypes import weight_format


_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def _decoder_key(key: str) -> str | None:
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    if key.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
        return key
    return None  # vision tower, projector, ...


def _tensor_names(files: list[Path], key_map) -> dict[str, tuple[Path, str]]:
    """Mapped tensor name -> (file, name on disk), for the tensors ``key_map`` keeps."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                new = key_map(key)
                if new is not None:
                    out[new] = (f, key)
    return out


def _copy_tensors(files: list[Path], names: dict[str, tuple[Path, str]], own: dict[str, torch.Tensor],
                  device: str | torch.device) -> None:
    """Copy each mapped tensor into the model's own tensor ``own[name]`` (shapes checked), one at a time."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for new, (f, key) in names.items():
        by_file.setdefault(f, []).append((new, key))
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for new, key in by_file.get(f, ()):
                    value = fh.get_tensor(key)
                    if value.shape != own[new].shape:
                        raise UnsupportedArchitectureError(
                            f"{f.name}: {key} has shape {tuple(value.shape)}, the decoder expects "
                            f"{tuple(own[new].shape)}")
                    own[new].copy_(value)
                    del value


def load_decoder(
    checkpoint: Checkpoint | str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu"
):
    """Build the decoder runtime of a checkpoint and load its weights (strict: every tensor must exist):
    a :class:`LlamaDecoder` for Llama-family models, a ``WhisperDecoder`` for Whisper.

    ``dtype`` is the weight precision (:func:`weight_format`): float32 or bfloat16 weights (on the CPU the
    linear layers are pre-packed for oneDNN, :mod:`specstream.kernels.linear`), or int8 / int4 weight-only
    quantization (:mod:`specstream.kernels.quant`) with bfloat16 activations and KV cache. Quantized weights are
    made one tensor at a time while reading the files (peak memory: the quantized model plus one float tensor);
    the token embedding is quantized the same way and, when tied, is the ``lm_head`` (one copy).

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, UnsupportedDtypeError.
    """
    from specstream.stages.speculative.models.llama import LlamaDecoder

    fmt = weight_format(dtype, device)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint, dtype=fmt.label)
    stored = ckpt.quantized_dtype()
    if stored is not None and stored != fmt.label:
        from specstream.errors import UnsupportedDtypeError

        raise UnsupportedDtypeError(f"{ckpt.path} holds {stored} weights; it cannot load as {fmt.label} (pass the "
                                    f"original checkpoint or .gguf file)")
    if ckpt.config.get("model_type") == "whisper":
        from specstream.stages.speculative.models.whisper import load_whisper_decoder

        return load_whisper_decoder(ckpt, fmt.label, device)
    cfg = ckpt.decoder_config()
    files = ckpt.weight_files()
    names = _tensor_names(files, _decoder_key)
    stored_codes = {}
    if stored is not None:  # a quantized conversion: NAME.int8 + NAME.scales / NAME.int4 + NAME.scales_and_zeros
        for key in list(names):
            base, _, part = key.rpartition(".")
            if part in ("int8", "int4", "scales", "scales_and_zeros"):
                stored_codes.setdefault(base, {})[part] = names.pop(key)
                names.setdefault(base, names.get(base) or stored_codes[base][part])
    if cfg.tie_word_embeddings or "lm_head.weight" not in names:
        if "lm_head.weight" not in names and not cfg.tie_word_embeddings:
            raise UnsupportedArchitectureError(f"{ckpt.path}: lm_head.weight missing and embeddings not tied")
        names.pop("lm_head.weight", None)
        cfg = DecoderConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = LlamaDecoder(cfg)
    own = model.state_dict()
    unexpected = [k for k in names if k not in own]
    missing = [k for k in own if k not in names and k != "inv_freq"
               and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise UnsupportedArchitectureError(
            f"{ckpt.path}: weights do not match a {cfg.model_type} decoder (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    if fmt.quantized:
        _load_quantized(model, files, names, fmt, device, stored_codes)
        model.fuse_projections()  # q/k/v and gate/up in one product each (bit-identical outputs)
    else:
        model.to_empty(device=device)
        # copy tensor by tensor into the allocated model: peak memory is the model plus one tensor, not twice it
        _copy_tensors(files, names, model.state_dict(), device)
        model.tie_weights()
        model.to(fmt.activation_dtype)
    inv_freq, _ = cfg.rope.inv_freq(cfg.head_dim)
    model.inv_freq = inv_freq.float().to(device)  # RoPE frequencies stay float32 at every precision
    model.activation_dtype = fmt.activation_dtype
    model.weight_format = fmt
    model.eval()
    if not fmt.quantized:
        from specstream.kernels.linear import pack_linears

        pack_linears(model)  # CPU: oneDNN pre-packed weights (small-batch products without repacking)
    else:
        model.fused_layer_args()  # decide (and build, the first time on a machine) the C++ layers at load
    return_freed_heap()
    return model


def return_freed_heap() -> bool:
    """Give the heap pages that loading freed back to the operating system (glibc's ``malloc_trim(0)``).

    Loading reads and frees one float tensor (or block of codes) at a time; glibc keeps the freed pages mapped,
    so without this the resident set after loading stays about 0.3 GiB (the int4 Qwen2.5-Coder pair) above what
    the model holds. Returns whether it ran (False where the C library has no ``malloc_trim``: musl, macOS).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def _load_quantized(model, files: list[Path], names: dict[str, tuple[Path, str]], fmt, device,
                    stored_codes: dict | None = None) -> None:
    """Fill the meta-device ``model`` with int8/int4 linear layers and embedding, quantized one tensor at a time
    from ``files`` (or built from stored codes, ``stored_codes[name] = {"int4": (file, key), ...}``); the other
    tensors (norms) in bfloat16."""
    from safetensors import safe_open
    from torch import nn

    import logging

    from specstream.kernels.quant import Int4Linear, Int8Linear, QuantEmbedding, dequantize_int4, int4_packable
    from specstream.kernels.quant import check_kernel
    from specstream.kernels.quant import quantize_weight as quantize_float

    log = logging.getLogger("specstream.loader")
    handles = {f: safe_open(str(f), framework="pt", device=str(device)) for f in files}
    stored_codes = stored_codes or {}

    def get(where: tuple[Path, str]) -> torch.Tensor:
        # a fresh allocation: tensors memory-mapped from a safetensors file may be unaligned for the packed
        # kernels (``_weight_int8pack_mm`` crashed on such a buffer)
        return handles[where[0]].get_tensor(where[1]).clone()

    def read(name: str) -> torch.Tensor:
        return get(names[name])

    def quantize_weight(weight_name: str, bias, fmt, rows: bool):  # noqa: F811  (stored codes first)
        parts = stored_codes.get(weight_name)
        if parts is None:
            w = read(weight_name)
            if fmt.name == "int4" and not int4_packable(*w.shape, fmt.group_size):
                log.info("%s %s: not packable as int4 (K %% group); int8",
                         weight_name, tuple(w.shape))
            return quantize_float(w, bias, fmt, rows)
        if "int8" in parts:  # int8 checkpoints, and int4 ones' weights the int4 kernel cannot pack
            layer = Int8Linear(get(parts["int8"]), get(parts["scales"]), bias)
            check_kernel(layer, lambda a, b: layer.qweight[a:b].float() * layer.scales[a:b].float()[:, None], bias)
            return layer
        b = get(parts["int4"])
        q = torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)
        sz = get(parts["scales_and_zeros"])
        if not int4_packable(q.shape[0], q.shape[1], fmt.group_size):
            log.info("%s %s: not packable as int4 (K %% group); int8", weight_name,
                     tuple(q.shape))
            return Int8Linear.from_float(dequantize_int4(q, sz), bias)
        return Int4Linear.from_codes(q, sz, bias, fmt.group_size, rows=rows)

    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for path, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                full = f"{path}.{child_name}" if path else child_name
                if isinstance(child, nn.Linear) and not (full == "lm_head" and tied):
                    bias = read(f"{full}.bias") if child.bias is not None else None
                    setattr(module, child_name, quantize_weight(f"{full}.weight", bias, fmt, rows=False))
        table = quantize_weight("model.embed_tokens.weight", None, fmt, rows=True)
        model.model.embed_tokens = QuantEmbedding(table)
        if tied:
            model.lm_head = table
        for module in model.modules():
            if any(t.is_meta for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))):
                module.to_empty(device=device, recurse=False)
        own = model.state_dict()
        for name in names:
            target = own.get(name)
            if target is not None and target.dtype.is_floating_point and target.numel() and _is_plain(model, name):
                target.copy_(read(name))
        for module in model.modules():
            if not hasattr(module, "qweight") and not hasattr(module, "packed"):
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(torch.bfloat16)
    del handles


def _is_plain(model, name: str) -> bool:
    """True for a tensor of an unquantized module (norm weights)."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return not hasattr(module, "qweight") and not hasattr(module, "packed") and not hasattr(module, "table")
