"""LLaVA-family vision-language models: Hugging Face computes the image features, the engine decodes.

Supported checkpoints: ``LlavaForConditionalGeneration`` (LLaVA 1.5 and alike) and
``LlavaOnevisionForConditionalGeneration``. The vision tower, the multimodal projector (and OneVision's
``image_newline``) run as Hugging Face modules built on the meta device and given only their own weights, so
the language model's weights are loaded once, into the engine's :class:`LlamaDecoder`. The Hugging Face
processor formats the chat prompt and expands ``<image>`` into as many image tokens as the tower yields
(for OneVision the count depends on the image size).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstream.errors import UnsupportedArchitectureError
from specstream.stages.speculative.models.checkpoint import Checkpoint, load_state_dict, resolve_checkpoint
from specstream.stages.speculative.models.loader import load_decoder

VLM_TYPES = {"llava": "LlavaForConditionalGeneration",
             "llava_onevision": "LlavaOnevisionForConditionalGeneration"}
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "image_newline")


def _vision_key(key: str) -> str | None:
    """Map an on-disk tensor name to the name under the HF model's ``.model`` (vision parts only)."""
    if key.startswith("model."):
        key = key[len("model."):]
    return key if key.startswith(_VISION_PARTS) else None


@dataclass
class PreparedImage:
    """A prompt with its images (one or several, or none), preprocessed by the checkpoint's processor.

    Attributes:
        input_ids: prompt ids with the image tokens expanded, ``[n]``.
        pixel_values: processor output for the vision tower, one entry per image (``[k, C, H, W]``, or
            ``[k, patches, C, H, W]`` for OneVision); None for a prompt without images.
        image_sizes: ``[k, 2]`` original (height, width) per image for OneVision, else None.
        visual_positions: indices of the image tokens in ``input_ids`` (sorted; the images' tokens in image order).
        grid: (rows, cols) of the first image's patch grid, for attention maps (None when unknown).
        draft_ids: the same prompt without the image tokens (what a text-only draft sees).
        num_images: ``k``, the images in the prompt.
        batch_num_images: ``[1]`` tensor holding ``k`` (OneVision: a prompt with several images shows each image
            without its high-resolution tiles, as the Hugging Face processor expands it), else None.
    """

    input_ids: list[int]
    pixel_values: torch.Tensor | None
    image_sizes: torch.Tensor | None
    visual_positions: list[int]
    grid: tuple[int, int] | None
    draft_ids: list[int]
    num_images: int = 1
    batch_num_images: torch.Tensor | None = None


class VisionLanguageModel:
    """A LLaVA-family target: the engine's decoder plus Hugging Face's vision tower and processor.

    Args:
        checkpoint: dir or hub id of a LLaVA / LLaVA-OneVision checkpoint with its processor files.
        dtype, device: of the decoder and the vision tower.

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError.
    """

    def __init__(self, checkpoint: str | os.PathLike | Checkpoint, dtype: str = "float32", device: str = "cpu"):
        import transformers
        from transformers import AutoConfig, AutoProcessor

        self.checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint)
        model_type = self.checkpoint.config.get("model_type")
        if model_type not in VLM_TYPES:
            raise UnsupportedArchitectureError(
                f"{self.checkpoint.path} is not a LLaVA-family VLM (model_type={model_type!r}; "
                f"supported: {', '.join(VLM_TYPES)})")
        self.model_type = model_type
        self.decoder = load_decoder(self.checkpoint, dtype, device)
        self.config = AutoConfig.from_pretrained(self.checkpoint.path)
        self.processor = AutoProcessor.from_pretrained(self.checkpoint.path)
        cls = getattr(transformers, VLM_TYPES[model_type])
        with torch.device("meta"):
            hf = cls._from_config(self.config)
        # the vision parts are rebuilt for real (their non-persistent buffers need values); the language model
        # stays on the meta device: the engine's decoder holds its weights
        hf.model.vision_tower = transformers.AutoModel.from_config(self.config.vision_config)
        hf.model.multi_modal_projector = type(hf.model.multi_modal_projector)(self.config)
        vision = load_state_dict(self.checkpoint.weight_files(), _vision_key)
        hf.model.load_state_dict(vision, strict=False, assign=True)
        for name, p in list(hf.model.named_parameters()):
            if name.startswith(_VISION_PARTS) and p.is_meta:
                raise UnsupportedArchitectureError(f"{self.checkpoint.path}: vision weight {name} missing")
        self.vision = hf.model
        self.vision.language_model = None  # meta tensors only; the engine's decoder replaces it
        torch_dtype = self.decoder.dtype
        for mod in (self.vision.vision_tower, self.vision.multi_modal_projector):
            mod.to(device=device, dtype=torch_dtype).eval()
        if getattr(self.vision, "image_newline", None) is not None:
            self.vision.image_newline = torch.nn.Parameter(self.vision.image_newline.to(device, torch_dtype))
        self.image_token_id = int(getattr(self.config, "image_token_id", None)
                                  or getattr(self.config, "image_token_index"))
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = self.checkpoint.eos_token_ids() or tuple(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])

    # -- prompts --------------------------------------------------------------------------------------------
    def chat_prompt(self, text: str, num_images: int = 1) -> str:
        """The checkpoint's chat template applied to one user turn: ``num_images`` images, then ``text``."""
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
        return self.render_chat([{"role": "user", "content": content}])

    def render_chat(self, conversation: list[dict]) -> str:
        """The checkpoint's chat template applied to ``conversation`` (Hugging Face's format: ``{"role", "content":
        [{"type": "image"} | {"type": "text", "text": ...}, ...]}`` per turn), with the generation prompt. Without a
        template: ``<image>`` lines, then the text parts, per turn."""
        if getattr(self.processor, "chat_template", None):
            return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
        out = []
        for turn in conversation:
            for part in turn["content"]:
                out.append("<image>" if part["type"] == "image" else part["text"])
        return "\n".join(out)

    def prepare(self, image: np.ndarray | Sequence[np.ndarray], text: str) -> PreparedImage:
        """Run the processor on one RGB ``[H, W, 3]`` uint8 image (or a sequence of them) and a user prompt."""
        images = [image] if isinstance(image, np.ndarray) else list(image)
        return self.prepare_prompt(self.chat_prompt(text, len(images)), images)

    def prepare_prompt(self, prompt: str, images: Sequence[np.ndarray] = ()) -> PreparedImage:
        """Run the processor on a rendered prompt holding one image placeholder per image, in order, and the
        images (RGB ``[H, W, 3]`` uint8). Several images are given to the processor as one sample (a nested list),
        so each is expanded as the Hugging Face processor expands a multi-image prompt.

        Raises:
            ValueError: the number of placeholders and images differ (raised by the processor).
        """
        from PIL import Image

        pils = [Image.fromarray(np.ascontiguousarray(im)) for im in images]
        if pils:
            inputs = self.processor(images=[pils], text=[prompt], return_tensors="pt")
        else:
            inputs = self.processor(text=[prompt], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        draft_ids = [t for t in ids if t != self.image_token_id]
        grid = None
        vc = self.config.vision_config
        side = vc.image_size // vc.patch_size
        if self.model_type == "llava":
            if pils and side * side * len(pils) == len(positions):
                grid = (side, side)
        elif pils:
            grid = (side, side)  # the base image's grid (the first side*side features before the tiles)
        return PreparedImage(ids, inputs.get("pixel_values") if pils else None, inputs.get("image_sizes"), positions,
                             grid, draft_ids, len(pils), inputs.get("batch_num_images"))

    # -- vision ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, prepared: list[PreparedImage]) -> list[torch.Tensor]:
        """Visual tokens ``[n_image_tokens, hidden]`` per prepared prompt: its images' features concatenated in
        image order (one vision-tower batch for LLaVA; one call per prompt for OneVision).

        Raises:
            UnsupportedArchitectureError: the tower's token count differs from the prompt's image tokens.
        """
        if not prepared:
            return []
        dtype, device = self.decoder.dtype, self.decoder.device
        feats: list[torch.Tensor] = []
        if self.model_type == "llava":
            with_images = [p for p in prepared if p.pixel_values is not None]
            per_image: list[torch.Tensor] = []
            if with_images:
                pixels = torch.cat([p.pixel_values for p in with_images]).to(device, dtype)
                out = self.vision.get_image_features(pixel_values=pixels)
                per_image = list(out.pooler_output if hasattr(out, "pooler_output") else out)
            k = 0
            for p in prepared:
                n = 0 if p.pixel_values is None else p.pixel_values.shape[0]
                parts = [f.reshape(-1, f.shape[-1]) for f in per_image[k:k + n]]
                k += n
                feats.append(torch.cat(parts) if parts else self._no_features())
        else:
            for p in prepared:  # OneVision: each image has its own number of tiles
                if p.pixel_values is None:
                    feats.append(self._no_features())
                    continue
                num = p.batch_num_images if p.batch_num_images is not None else torch.tensor([p.num_images])
                out = self.vision.get_image_features(pixel_values=p.pixel_values.to(device, dtype),
                                                     image_sizes=p.image_sizes, batch_num_images=num)
                parts = out.pooler_output if hasattr(out, "pooler_output") else out
                feats.append(torch.cat([f.reshape(-1, f.shape[-1]) for f in parts], dim=0))
        for p, f in zip(prepared, feats):
            if f.shape[0] != len(p.visual_positions):
                raise UnsupportedArchitectureError(
                    f"the vision tower gave {f.shape[0]} visual tokens but the prompt holds "
                    f"{len(p.visual_positions)} image tokens (check image_seq_length / the processor config)")
        return feats

    def _no_features(self) -> torch.Tensor:
        return torch.zeros((0, self.decoder.config.hidden_size), dtype=self.decoder.dtype, device=self.decoder.device)

    @torch.inference_mode()
    def prompt_embeds(self, prepared: PreparedImage, features: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings ``[n, hidden]``: token embeddings with the visual tokens spliced in."""
        ids = torch.tensor(prepared.input_ids, device=self.decoder.device)
        emb = self.decoder.embed(ids[None])[0].clone()
        emb[torch.tensor(prepared.visual_positions, device=emb.device)] = features.to(emb.dtype)
        return emb

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
