"""The main job end to end: keyframes -> vision encoding -> speculative decoding with a visual verifier.

The oracle is the target VLM's own greedy ``generate`` (Hugging Face) on the same frame and prompt; the serving
path never calls it.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from specstream.pipeline.caption_job import run_caption_job
from specstream.pipeline.defaults import default_caption_models

PROMPT = "Describe this image."
N = 12


@pytest.fixture(scope="module")
def models():
    return default_caption_models(quiet=True)


@pytest.fixture(scope="module")
def oracle(models):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    from PIL import Image

    target, _ = models
    hf = LlavaForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(target)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True)

    def generate(image: np.ndarray, n: int = N) -> list[int]:
        inputs = proc(images=[Image.fromarray(image)], text=[text], return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=n, do_sample=False)
        toks = out[0, inputs["input_ids"].shape[1]:].tolist()
        eos = hf.config.text_config.eos_token_id
        return toks[: toks.index(eos) + 1] if eos in toks else toks

    generate.hf = hf
    generate.proc = proc
    generate.text = text
    return generate


def test_main_job_on_registry_media(tmp_path, src, oracle):
    from specstream.modalities.image import load_image
    from specstream.modalities.video import decode_frames, probe_video
    from specstream.stages.keyframes import select_keyframes

    inputs = [src["bigbuckbunny"], src["bikes"], src["astronaut"], src["rocket"]]
    out = tmp_path / "captions.jsonl"
    summary = run_caption_job(inputs, str(out), max_new_tokens=N, show_progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.failed_inputs == 0 and summary.captions == len(records)
    for path in inputs[:2]:
        recs = [r for r in records if r["source"] == path]
        expected = [(k.frame_index, round(float(k.timestamp_s), 6))
                    for k in select_keyframes(path, decode_images=False)]
        assert [(r["frame_index"], r["timestamp_s"]) for r in recs] == expected  # one record per keyframe
        duration = probe_video(path).duration_s
        times = [r["timestamp_s"] for r in recs]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert all(0 <= t <= duration for t in times)
        frames = decode_frames(path, times)
        for rec, frame in zip(recs, frames):
            assert rec["kind"] == "video"
            assert rec["tokens"] == oracle(frame), (path, rec["frame_index"])
    assert len([r for r in records if r["source"] == src["bikes"]]) >= 4  # bikes has several shots
    for path in inputs[2:]:
        (rec,) = [r for r in records if r["source"] == path]
        assert rec["kind"] == "image" and rec["frame_index"] == 0 and rec["timestamp_s"] == 0.0
        assert rec["tokens"] == oracle(load_image(path))
        assert rec["stats"]["target_steps"] >= 1 and isinstance(rec["caption"], str)
    assert list(records[0]) == ["source", "kind", "frame_index", "timestamp_s", "caption", "tokens", "scene_score",
                                "stats"]


@pytest.mark.timeout(300)
def test_bad_files_fail_alone(tmp_path, clips, src):
    bad = {"truncated.mp4": "corrupt_media", "corrupt.mp4": "corrupt_media", "empty.mp4": "unreadable_source",
           "audio.m4a": None, "notavideo.mp4": "unsupported_media"}
    inputs = [str(clips[name]) for name in bad] + [src["astronaut"], str(tmp_path / "missing.png")]
    out = tmp_path / "out.jsonl"
    summary = run_caption_job(inputs, str(out), max_new_tokens=4, show_progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_source: dict[str, list] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r)
    for name, code in bad.items():
        recs = by_source[str(clips[name])]
        assert "error" in recs[-1], name
        if code is not None:
            assert recs[-1]["error"]["code"] == code, (name, recs[-1])
        assert all("caption" in r for r in recs[:-1])  # a partly decodable file: its good part first
    assert by_source[str(clips["audio.m4a"])][-1]["error"]["code"] in ("no_video_stream", "unsupported_media")
    assert by_source[str(tmp_path / "missing.png")][0]["error"]["code"] == "unreadable_source"
    assert by_source[src["astronaut"]][0]["caption"]
    assert summary.failed_inputs == 6


def test_same_frame_twice_second_caption_is_drafted_by_the_first(models, src):
    from specstream.modalities.image import load_image
    from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_RESULTS, InProcessBroker
    from specstream.pipeline.messages import CaptionParams
    from specstream.stages.caption import Captioner
    from specstream.pipeline.caption_stages import CaptionStage, FrameTask
    from specstream.stages.speculative.drafters.model import TreeSpec

    target, _ = models
    depth = 8
    captioner = Captioner(target, [], TreeSpec.parse(",".join(["1"] * depth)), visual_aware=False)
    image = load_image(src["astronaut"])
    n = 40
    params = CaptionParams(prompt=PROMPT, max_new_tokens=n)

    async def go():
        broker = InProcessBroker()
        stage = CaptionStage(broker, captioner)
        task = asyncio.create_task(stage.run())
        for i in range(2):
            await broker.publish(TOPIC_FRAMES, "r", FrameTask("r", "a.png", "video", params, frame_index=i,
                                                               timestamp_s=i * 0.04, image=image, last=i == 1,
                                                               seq=i))
        await broker.close_topic(TOPIC_FRAMES)
        results = []
        async for msg in broker.subscribe(TOPIC_RESULTS):
            results.append(msg.value)
            if msg.value.final:
                break
        await task
        return results

    first, second = asyncio.run(go())
    assert first.output["tokens"] == second.output["tokens"] and len(first.output["tokens"]) == n
    assert first.output["stats"]["target_steps"] == n  # no draft for the first: one token per step
    assert second.output["stats"]["target_steps"] <= math.ceil(n / (depth + 1)) + 1
    assert [r.seq for r in (first, second)] == [0, 1] and second.final and not first.final


def test_attention_export_equals_hf_eager_attention(models, src, oracle):
    from specstream.modalities.image import load_image
    from specstream.stages.caption import Captioner

    target, _ = models
    captioner = Captioner(target, [], temporal=False, visual_aware=False, attention_maps=True)
    loop = captioner.loop
    captioner.executor.attention_layers = (0, 1)
    prep = captioner.vlm.prepare(load_image(src["astronaut"]), PROMPT)
    rows: list = []
    req = loop.add_request(captioner.make_request(prep, 3), visual_attention=rows)
    loop.run()
    vis = np.stack(rows)  # [3, n_visual]
    assert vis.shape == (3, len(prep.visual_positions))
    # HF eager attention for the same sequence: row of the token that predicted each committed token
    hf = oracle.hf
    ids = torch.tensor([prep.input_ids + req.output_ids[:2]])
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf(input_ids=ids, pixel_values=prep.pixel_values, output_attentions=True)
    span = slice(prep.visual_positions[0], prep.visual_positions[-1] + 1)
    n = len(prep.input_ids)
    want = torch.stack([out.attentions[layer][0, :, n - 1:n + 2, span].mean(0) for layer in (0, 1)]).mean(0)
    assert np.allclose(vis, want.numpy(), atol=1e-5)


def test_attention_map_maximum_on_planted_patch(tmp_path):
    from PIL import Image

    from specstream.stages.attention_maps import patch_map, save_attention_map

    grid = (8, 8)
    attention = np.full((5, 64), 0.001, dtype=np.float32)
    attention[:, 8 * 3 + 5] = 0.5  # planted: row 3, column 5
    heat = patch_map(attention, grid)
    assert np.unravel_index(heat.argmax(), heat.shape) == (3, 5)
    image = np.full((80, 80, 3), 100, dtype=np.uint8)
    path = save_attention_map(tmp_path, "/x/clip.mp4", 12, image, attention, grid)
    assert path.name == "clip_f000012.png"
    png = np.asarray(Image.open(path))
    assert png.shape == (80, 80, 3)
    redness = png[..., 0].astype(int) - png[..., 1].astype(int)
    y, x = np.unravel_index(redness.argmax(), redness.shape)
    assert (y // 10, x // 10) == (3, 5)  # the reddest pixel lies on the planted patch


def test_cli_caption_writes_jsonl_attention_maps_and_exit_code(tmp_path, src, clips):
    out = tmp_path / "c.jsonl"
    maps = tmp_path / "maps"
    proc = subprocess.run([sys.executable, "-m", "specstream", "caption", src["astronaut"], str(clips["empty.mp4"]),
                           "--out", str(out), "--max-new-tokens", "5", "--attention-maps", str(maps)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # one input failed
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["source"] == src["astronaut"] and len(lines[0]["tokens"]) == 5
    assert lines[1]["error"]["code"] == "unreadable_source"
    empty = clips["empty.mp4"]
    assert f"failed {empty} [unreadable_source]: file is empty (0 bytes): {empty}\n" in proc.stderr
    assert (maps / "astronaut_f000000.png").exists()
    assert "captions" in proc.stderr and "tau" in proc.stderr


def test_vlm_as_draft_runs_its_language_model_only(models, src, oracle):
    from specstream.modalities.image import load_image
    from specstream.stages.caption import Captioner

    target, _ = models
    captioner = Captioner(target, [target], temporal=False)  # the VLM drafts for itself, text only
    image = load_image(src["rocket"])
    req = captioner.loop.add_request(captioner.make_request(captioner.vlm.prepare(image, PROMPT), N))
    captioner.loop.run()
    assert req.output_ids == oracle(image)


def test_llava_onevision_target_equals_its_own_generate(tmp_path, src):
    """OneVision: anyres tiles and newline tokens; the visual-token count depends on the image size."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaOnevisionForConditionalGeneration

    from specstream.modalities.image import load_image
    from specstream.pipeline.defaults import build_tiny_onevision
    from specstream.stages.caption import Captioner

    path = build_tiny_onevision(tmp_path / "ov")
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    captioner = Captioner(path, [], temporal=False)
    counts = set()
    for image in (load_image(src["astronaut"]), load_image(src["astronaut"])[:300, :180], load_image(src["rocket"])):
        prep = captioner.vlm.prepare(image, PROMPT)
        counts.add(len(prep.visual_positions))
        inputs = proc(images=[Image.fromarray(image)], text=[captioner.vlm.chat_prompt(PROMPT)], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prep.input_ids
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=10, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1]:].tolist()
        req = captioner.loop.add_request(captioner.make_request(prep, 10))
        captioner.loop.run()
        assert req.output_ids == want
    assert len(counts) >= 2  # different image sizes, different numbers of visual tokens


def test_out_into_a_missing_directory_is_created(tmp_path, clips):
    out = tmp_path / "not" / "yet" / "there.jsonl"
    summary = run_caption_job([str(clips["empty.mp4"])], str(out), max_new_tokens=2, show_progress=False)
    assert summary.failed_inputs == 1
    assert json.loads(out.read_text())["error"]["code"] == "unreadable_source"


def test_cli_caption_bad_tree_is_a_clear_error_before_models_load(tmp_path, capsys):
    from specstream.cli import main

    image = tmp_path / "x.png"
    image.write_bytes(b"\x89PNG")
    assert main(["caption", str(image), "--out", str(tmp_path / "o.jsonl"), "--tree", "foo"]) == 2
    assert "bad tree 'foo'" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_attention_maps_of_sources_with_the_same_stem_do_not_overwrite(tmp_path, src):
    import shutil

    inputs = []
    for sub, name in (("a", "astronaut.png"), ("b", "astronaut.png"), ("b", "astronaut.webp")):
        (tmp_path / sub).mkdir(exist_ok=True)
        dst = tmp_path / sub / name
        if name.endswith(".webp"):
            from PIL import Image

            Image.open(src["astronaut"]).save(dst)
        else:
            shutil.copy(src["astronaut"], dst)
        inputs.append(str(dst))
    out, maps = tmp_path / "c.jsonl", tmp_path / "maps"
    run_caption_job(inputs, str(out), max_new_tokens=2, attention_maps=str(maps), show_progress=False)
    paths = [json.loads(line)["attention_map"] for line in out.read_text().splitlines()]
    assert len(set(paths)) == 3 and all((maps / p.split("/")[-1]).exists() for p in paths)
    assert len(list(maps.iterdir())) == 3


def test_attention_map_of_a_huge_image_is_drawn_downscaled(tmp_path):
    from PIL import Image

    from specstream.stages.attention_maps import save_attention_map

    attention = np.full((2, 64), 0.001, dtype=np.float32)
    attention[:, 8 * 3 + 5] = 0.5
    image = np.full((1600, 4000, 3), 100, dtype=np.uint8)
    png = np.asarray(Image.open(save_attention_map(tmp_path, "big.png", 0, image, attention, (8, 8))))
    assert png.shape == (410, 1024, 3)
    redness = png[..., 0].astype(int) - png[..., 1].astype(int)
    y, x = np.unravel_index(redness.argmax(), redness.shape)
    assert (y * 8 // 410, x * 8 // 1024) == (3, 5)


def test_a_frame_failing_mid_video_does_not_end_the_input(models, src):
    """An error on a video's non-last frame is that frame's record: the later frames are still captioned and
    the input ends (``final``) only with its last frame."""
    from specstream.modalities.image import load_image
    from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_RESULTS, InProcessBroker
    from specstream.pipeline.messages import CaptionParams
    from specstream.stages.caption import Captioner
    from specstream.pipeline.caption_stages import CaptionStage, FrameTask

    target, _ = models
    captioner = Captioner(target, [], temporal=False, visual_aware=False)
    good = load_image(src["astronaut"])
    params = CaptionParams(max_new_tokens=2)

    async def scenario():
        broker = InProcessBroker()
        stage = CaptionStage(broker, captioner)
        run = asyncio.create_task(stage.run())
        frames = [good, np.zeros((0, 0, 3), dtype=np.uint8), good]  # the middle frame cannot be preprocessed
        for i, image in enumerate(frames):
            await broker.publish(TOPIC_FRAMES, "r", FrameTask("r", "v.mp4", "video", params, "batch", i, i * 1.0,
                                                              1.0, image, last=i == len(frames) - 1, seq=i))
        results = []
        async for msg in broker.subscribe(TOPIC_RESULTS):
            results.append(msg.value)
            if msg.value.final:
                break
        await broker.close_topic(TOPIC_FRAMES)
        await run
        return results

    results = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert [(r.seq, r.status, r.final) for r in sorted(results, key=lambda r: r.seq)] == [
        (0, "ok", False), (1, "error", False), (2, "ok", True)]


def test_planted_dominant_visual_key_puts_the_attention_map_maximum_on_its_patch(models, src, tmp_path):
    """Layer 0 of a copy of the tiny target is rewired so that a key's score is proportional to hidden dimension
    0 of its token (query = a constant bias along the slowest RoPE pair, key reads dimension 0 only). Planting
    a large dimension 0 in the visual token of patch (2, 5) makes it the dominant key: the exported attention
    and the written map must peak on that patch."""
    import shutil

    from PIL import Image
    from safetensors.numpy import load_file, save_file

    from specstream.modalities.image import load_image
    from specstream.stages.attention_maps import save_attention_map
    from specstream.stages.caption import Captioner

    target, _ = models
    path = tmp_path / "planted"
    shutil.copytree(target, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    (wfile,) = list(path.glob("*.safetensors"))
    state = load_file(str(wfile))
    text = cfg["text_config"]
    hidden, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    hd = hidden // heads
    prefix = next(k for k in state if k.endswith("layers.0.self_attn.q_proj.weight")).rsplit("layers.0.", 1)[0]
    for layer in range(text["num_hidden_layers"]):
        for proj, n_out in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd), ("o", hidden)):
            state[f"{prefix}layers.{layer}.self_attn.{proj}_proj.bias"] = np.zeros(n_out, np.float32)
    u = hd // 2 - 1  # the slowest-rotating RoPE pair: rotation is negligible over the prompt
    q_bias = np.zeros((heads, hd), np.float32)
    q_bias[:, u] = 10.0
    state[f"{prefix}layers.0.self_attn.q_proj.weight"] = np.zeros((heads * hd, hidden), np.float32)
    state[f"{prefix}layers.0.self_attn.q_proj.bias"] = q_bias.reshape(-1)
    k_w = np.zeros((kv, hd, hidden), np.float32)
    k_w[:, u, 0] = 1.0
    state[f"{prefix}layers.0.self_attn.k_proj.weight"] = k_w.reshape(kv * hd, hidden)
    save_file(state, str(wfile), metadata={"format": "pt"})

    captioner = Captioner(path, [], temporal=False, visual_aware=False, attention_maps=True)
    loop = captioner.loop
    captioner.executor.attention_layers = (0,)
    image = load_image(src["rocket"])
    prep = captioner.vlm.prepare(image, PROMPT)
    planted = 2 * 8 + 5
    req = captioner.make_request(prep, 4)
    req.encodes, req.mm_inputs = (), ()  # the embeddings are given below
    feats = captioner.vlm.encode([prep])[0]
    emb = captioner.vlm.prompt_embeds(prep, feats).clone()
    vis = torch.tensor(prep.visual_positions)
    emb[vis, 0] = 0.0
    emb[vis[planted]] = 0.0
    emb[vis[planted], 0] = 1.0
    rows: list = []
    loop.add_request(req, visual_attention=rows)
    captioner.executor.prefix_embeds[req.request_id] = emb
    loop.run()
    attention = np.stack(rows)
    assert attention.shape == (4, 64)
    assert (attention.argmax(1) == planted).all()
    assert attention[:, planted].min() > 0.5  # dominant: most of the mass of every committed token's row
    png = np.asarray(Image.open(save_attention_map(tmp_path / "maps", "cat.png", 0, image, attention, prep.grid)))
    redness = png[..., 0].astype(int) - png[..., 1].astype(int)
    y, x = np.unravel_index(redness.argmax(), redness.shape)
    assert (y * 8 // png.shape[0], x * 8 // png.shape[1]) == (2, 5)


def test_long_video_is_backpressured_not_held_in_memory(models, src, tmp_path):
    """Keyframes are decoded at full resolution one at a time and wait in a bounded frames topic: with a topic
    of 1 and a caption window of 1, at most a handful of full-resolution frames are alive at any moment while
    bikes' 6 scenes are captioned, and the records equal those of the default bounds."""
    import io
    import weakref

    from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_RESULTS, InProcessBroker
    from specstream.pipeline.caption_job import run_caption_graph
    from specstream.stages.caption import Captioner

    target, _ = models
    captioner = Captioner(target, [], temporal=True, visual_aware=False)

    class Tracking(InProcessBroker):
        alive = 0
        peak = 0

        async def publish(self, topic, key, value, headers=None):
            if topic == TOPIC_FRAMES and getattr(value, "image", None) is not None:
                cls = type(self)
                cls.alive += 1
                cls.peak = max(cls.peak, cls.alive)
                weakref.finalize(value.image, lambda: setattr(cls, "alive", cls.alive - 1))
            await super().publish(topic, key, value, headers)

    def run(broker, window):
        out = io.StringIO()
        summary = asyncio.run(run_caption_graph([src["bikes"]], captioner, out, PROMPT, 3, None, None,
                                                broker=broker, max_in_flight=window))
        return summary, [json.loads(line) for line in out.getvalue().splitlines()]

    tight = Tracking(topic_maxsize={TOPIC_FRAMES: 1})

    class Out(io.StringIO):  # when each line is written: results published so far
        at: list = []

        def write(self, text):
            Out.at.append(tight.published.get(TOPIC_RESULTS, 0))
            return super().write(text)

    out = Out()
    summary = asyncio.run(run_caption_graph([src["bikes"]], captioner, out, PROMPT, 3, None, None,
                                            broker=tight, max_in_flight=1))
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert summary.keyframes == 6 and len(records) == 6, records
    assert Out.at[0] < 6  # records are written in order as they complete, not when the whole video is done
    # one in the topic, one being captioned, one pending in the keyframe stage, one in flight from the decoder
    assert Tracking.peak <= 4, Tracking.peak
    _, default = run(None, 8)
    assert records == default
