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
from dataclasses import dataclass

import numpy as np
import torch

from specstream.errors import UnsupportedArchitectureError
from specstream.stages.speculative.models.loader import Checkpoint, load_decoder, load_state_dict, resolve_checkpoint

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
    """One image + prompt, preprocessed by the checkpoint's processor.

    Attributes:
        input_ids: prompt ids with the image tokens expanded, ``[n]``.
        pixel_values: processor output for the vision tower (``[1, C, H, W]``, or ``[1, patches, C, H, W]``).
        image_sizes: ``[1, 2]`` original (height, width) for OneVision, else None.
        visual_positions: indices of the image tokens in ``input_ids`` (sorted).
        grid: (rows, cols) of the base image's patch grid, for attention maps (None when unknown).
        draft_ids: the same prompt without the image tokens (what a text-only draft sees).
    """

    input_ids: list[int]
    pixel_values: torch.Tensor
    image_sizes: torch.Tensor | None
    visual_positions: list[int]
    grid: tuple[int, int] | None
    draft_ids: list[int]


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
    def chat_prompt(self, text: str) -> str:
        """The checkpoint's chat template applied to one user turn: an image, then ``text``."""
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        if getattr(self.processor, "chat_template", None):
            return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
        return f"<image>\n{text}"

    def prepare(self, image: np.ndarray, text: str) -> PreparedImage:
        """Run the processor on one RGB ``[H, W, 3]`` uint8 image and a user prompt."""
        from PIL import Image

        pil = Image.fromarray(np.ascontiguousarray(image))
        inputs = self.processor(images=[pil], text=[self.chat_prompt(text)], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        draft_ids = [t for t in ids if t != self.image_token_id]
        grid = None
        vc = self.config.vision_config
        if self.model_type == "llava":
            side = vc.image_size // vc.patch_size
            if side * side == len(positions):
                grid = (side, side)
        else:
            side = vc.image_size // vc.patch_size
            grid = (side, side)  # the base image's grid (the first side*side features before the tiles)
        return PreparedImage(ids, inputs["pixel_values"], inputs.get("image_sizes"), positions, grid, draft_ids)

    # -- vision ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, prepared: list[PreparedImage]) -> list[torch.Tensor]:
        """Visual tokens ``[n_image_tokens, hidden]`` per image (one vision-tower batch for LLaVA)."""
        if not prepared:
            return []
        dtype, device = self.decoder.dtype, self.decoder.device
        if self.model_type == "llava":
            pixels = torch.cat([p.pixel_values for p in prepared]).to(device, dtype)
            out = self.vision.get_image_features(pixel_values=pixels)
            feats = list(out.pooler_output if hasattr(out, "pooler_output") else out)
        else:
            feats = []
            for p in prepared:  # OneVision: each image has its own number of tiles
                out = self.vision.get_image_features(pixel_values=p.pixel_values.to(device, dtype),
                                                     image_sizes=p.image_sizes,
                                                     batch_num_images=torch.tensor([1]))
                parts = out.pooler_output if hasattr(out, "pooler_output") else out
                feats.append(torch.cat(list(parts), dim=0))
        feats = [f.reshape(-1, f.shape[-1]) for f in feats]
        for p, f in zip(prepared, feats):
            if f.shape[0] != len(p.visual_positions):
                raise UnsupportedArchitectureError(
                    f"the vision tower gave {f.shape[0]} visual tokens but the prompt holds "
                    f"{len(p.visual_positions)} image tokens (check image_seq_length / the processor config)")
        return feats

    @torch.inference_mode()
    def prompt_embeds(self, prepared: PreparedImage, features: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings ``[n, hidden]``: token embeddings with the visual tokens spliced in."""
        ids = torch.tensor(prepared.input_ids, device=self.decoder.device)
        emb = self.decoder.embed(ids[None])[0].clone()
        emb[torch.tensor(prepared.visual_positions, device=emb.device)] = features.to(emb.dtype)
        return emb

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
