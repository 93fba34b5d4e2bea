"""Optional near-duplicate keyframe filtering with open_clip image embeddings.

Used only when ``open_clip_torch`` is installed *and* a CLIP model is configured with local weights (no
download ever happens at run time). Otherwise `ClipDeduplicator.create` raises `DeduplicatorUnavailable` whose
message says what is missing, and callers skip deduplication.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np


class DeduplicatorUnavailable(RuntimeError):
    """open_clip is not installed, or no local CLIP weights are configured."""


class ClipDeduplicator:
    """Drops a keyframe whose CLIP embedding has cosine similarity >= ``threshold`` with the last kept one.

    ``model_name``: an open_clip architecture (e.g. "ViT-B-32"); ``pretrained``: a *local* checkpoint file.
    """

    def __init__(self, model, preprocess, threshold: float = 0.95, device: str = "cpu"):
        self.model = model
        self.preprocess = preprocess
        self.threshold = threshold
        self.device = device

    @classmethod
    def create(cls, model_name: str | None, pretrained: str | None, threshold: float = 0.95,
               device: str = "cpu") -> ClipDeduplicator:
        """Load open_clip ``model_name`` from the local file ``pretrained``. Raises `DeduplicatorUnavailable`."""
        try:
            import open_clip
        except ImportError as exc:
            raise DeduplicatorUnavailable(
                "near-duplicate filtering skipped: open_clip_torch is not installed (pip install 'specstream[clip]')"
            ) from exc
        if not model_name or not pretrained or not os.path.isfile(pretrained):
            raise DeduplicatorUnavailable(
                "near-duplicate filtering skipped: no CLIP model configured (give a model name and a local "
                f"checkpoint file; got model={model_name!r}, pretrained={pretrained!r}); nothing is downloaded"
            )
        model, _, preprocess = open_clip.create_model_and_transforms(model_name, pretrained=pretrained, device=device)
        model.eval()
        return cls(model, preprocess, threshold=threshold, device=device)

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """[N, D] L2-normalised float32 embeddings of ``images`` (each [H, W, 3] uint8 RGB)."""
        import torch
        from PIL import Image

        batch = torch.stack([self.preprocess(Image.fromarray(im)) for im in images]).to(self.device)
        with torch.no_grad():
            emb = self.model.encode_image(batch).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        return emb.cpu().numpy()

    def filter(self, keyframes: list) -> list:
        """Keep keyframes (with images) that are not near-duplicates of the previous kept one; order preserved."""
        with_images = [k for k in keyframes if k.image is not None]
        if len(with_images) < 2:
            return list(keyframes)
        emb = self.embed([k.image for k in with_images])
        kept, last = [], None
        for k, e in zip(with_images, emb):
            if last is None or float(e @ last) < self.threshold:
                kept.append(k)
                last = e
        return kept
