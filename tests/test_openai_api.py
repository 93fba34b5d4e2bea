"""The OpenAI-compatible routes of ``specstream serve``, driven by the official ``openai`` client against a live
server on loopback (uvicorn in a thread). Oracles: Hugging Face ``generate`` of the same checkpoint, ``specstream
caption`` on the same image, and the speech path called directly on the same file."""

from __future__ import annotations

import base64
import inspect
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from live_fixtures import ServerThread, free_port
from openai_fixtures import KEY, openai_client, tiny_llava_hf
from qa_fixtures import SENTENCE, silent_clip, talk_clip

VLM = "specstream-tiny-llava"


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("openai-media")
    return {"talk": talk_clip(d), "silent": silent_clip(d), "wav": d / "sentence.wav", "dir": d}


@pytest.fixture(scope="module")
def server(media):
    from specstream.pipeline.server import ServerSettings

    srv = ServerThread(ServerSettings(port=free_port(), api_keys=[KEY], allowed_roots=[media["dir"]])).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def hf():
    return tiny_llava_hf()


def hf_generate(hf, images, text: str | None, n: int, raw: str | None = None) -> tuple[list[int], int]:
    """(greedy tokens cut after EOS, prompt length) of HF generate: one user turn (images, text), or raw text."""
    from PIL import Image

    model, proc = hf
    if raw is None:
        conv = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
        raw = proc.apply_chat_template(conv, add_generation_prompt=True)
    kw = {"images": [[Image.fromarray(im) for im in images]]} if images else {}
    inputs = proc(text=[raw], return_tensors="pt", **kw)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    n_prompt = inputs["input_ids"].shape[1]
    toks = out[0, n_prompt:].tolist()
    eos = model.config.text_config.eos_token_id
    return (toks[: toks.index(eos) + 1] if eos in toks else toks), n_prompt


def data_url(path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def image_message(url: str, text: str = "Describe this image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def hub_of(server):
    return server.app.state.specstream.openai.hub()


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [VLM, "whisper-tiny.en"]


def test_text_chat_equals_hf_generate(client, hf):
    r = client.chat.completions.create(model=VLM, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    want, n_prompt = hf_generate(hf, [], "Hello there", 8)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(want)
    assert choice.finish_reason == ("stop" if len(want) < 8 else "length")
    assert r.object == "chat.completion" and r.model == VLM and r.id.startswith("chatcmpl-")


def test_image_chat_equals_specstream_caption_token_for_token(client, src, tmp_path):
    from specstream.pipeline.caption_job import run_caption_job

    out = tmp_path / "c.jsonl"
    run_caption_job([src["astronaut"]], str(out), prompt="Describe this image.", max_new_tokens=12,
                    show_progress=False)
    (cap,) = [json.loads(x) for x in out.read_text().splitlines()]
    r = client.chat.completions.create(model=VLM, messages=image_message(data_url(src["astronaut"], "image/png")),
                                       max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == cap["tokens"]
    assert r.choices[0].message.content.strip() == cap["caption"]
    assert r.usage.prompt_tokens == 80  # 64 visual tokens + the template and prompt


def test_streamed_deltas_concatenate_to_the_answer(client, src):
    msgs = image_message(data_url(src["rocket"], "image/jpeg"), "What is this?")
    whole = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=VLM, messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 0
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_logprobs_top_logprobs_stop_and_sampling_seed(client):
    msgs = [{"role": "user", "content": "Count with me"}]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one, with the same log-probability
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    full = r.choices[0].message.content
    cut = content[3].token
    s = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=10, temperature=0, stop=[cut])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == full[: full.index(cut)]
    # sampling: the default temperature is 1.0; a seed repeats the same draw
    a, b = (client.chat.completions.create(model=VLM, messages=msgs, max_tokens=10, seed=7) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_max_completion_tokens_and_top_p(client):
    """``max_completion_tokens`` bounds the answer like ``max_tokens``; ``top_p`` is the nucleus of the sampler:
    a nucleus of one token makes sampling at temperature 1 give the greedy answer, and ``top_p`` 1 keeps every
    token (a seeded draw that differs from greedy)."""
    msgs = [{"role": "user", "content": "Count with me"}]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    greedy = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=8, temperature=0)
    nucleus = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=8, temperature=1.0, top_p=1e-6,
                                             seed=3)
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content
    assert greedy.usage.completion_tokens == nucleus.usage.completion_tokens == 8
    wide = [client.chat.completions.create(model=VLM, messages=msgs, max_tokens=8, temperature=1.0, top_p=1.0,
                                           seed=s).choices[0].message.content for s in (3, 4, 5)]
    assert any(w != greedy.choices[0].message.content for w in wide)  # untrained weights: a flat distribution
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=VLM, messages=msgs, max_tokens=2, top_p=0)


@pytest.mark.parametrize("name", ["/", ".", "..", "../../escape.wav", "a" * 300 + ".wav", "no-extension",
                                  "line\nbreak.wav"])
def test_transcription_upload_names_are_never_paths(client, media, name, tmp_path):
    """A transcription upload is stored under a name of the server's own: any client file name (a path, ``..``,
    over 255 bytes, control characters, none at all) transcribes the same audio, and errors show the safe name."""
    from specstream.stages.speech import transcribe

    if name == "../../escape.wav":  # one real transcription under a hostile name; the others go the error path
        data = Path(media["wav"]).read_bytes()
        got = client.audio.transcriptions.create(model="whisper-1", file=(name, data, "audio/wav")).text
        assert got == transcribe(str(media["wav"])).text
        assert not (Path(media["dir"]).parent.parent / "escape.wav").exists()
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="whisper-1", file=(name, b"not audio at all", "audio/wav"))
    message = e.value.body["message"]
    assert e.value.code == "unsupported_media" and "/" not in message.split(":")[0] and "\n" not in message
    assert len(message.split(":")[0].encode()) <= 255


def test_errors_raise_the_matching_exception_classes(client, server, media, src):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VLM, messages=msgs, n=17)  # n > 1 works (tests/test_openai_n.py)
    assert e.value.code == "invalid_request" and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VLM, messages=msgs, functions=[{"name": "f", "parameters": {}}])
    assert e.value.code == "unsupported_parameter" and e.value.param == "functions"  # tools are supported
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.code == "model_not_loaded"
    with pytest.raises(openai.BadRequestError) as e:  # 512 tokens of context
        client.chat.completions.create(model=VLM, messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.code == "context_length_exceeded" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VLM, messages=[{"role": "user", "content": "hi"}], max_tokens=510)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VLM, messages=image_message("https://example.com/cat.png"))
    assert e.value.code == "unsupported_parameter" and "does not fetch https URLs" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a text file sent as an image: told by its content
        client.chat.completions.create(model=VLM, messages=image_message(
            "data:image/png;base64," + base64.b64encode(b"not an image at all" * 10).decode()))
    assert e.value.code == "unsupported_media"
    with pytest.raises(openai.BadRequestError) as e:  # a video where an image was announced
        client.chat.completions.create(model=VLM, messages=image_message(data_url(media["silent"], "image/png")))
    assert e.value.code == "unsupported_media"
    with pytest.raises(openai.PermissionDeniedError):  # file:// outside the allowed roots
        client.chat.completions.create(model=VLM, messages=image_message("file://" + src["astronaut"]))
    # inside the roots a file URL is read like the same bytes sent inline
    local = media["dir"] / "astronaut.png"
    local.write_bytes(Path(src["astronaut"]).read_bytes())
    by_file, by_data = (client.chat.completions.create(model=VLM, messages=image_message(url), max_tokens=6,
                                                       temperature=0)
                        for url in ("file://" + str(local), data_url(local, "image/png")))
    assert by_file.choices[0].message.content == by_data.choices[0].message.content


def test_dropped_stream_is_cancelled_and_frees_its_slot(server):
    hub = hub_of(server)
    before = hub.cancelled
    body = {"model": VLM, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 480,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events >= 3:
                    break  # the client goes away after two content chunks
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = hub.load()["vlm"]
        if hub.cancelled > before and load["running"] == 0 and load["free_slots"] == load["slots"]:
            break
        time.sleep(0.05)
    load = hub.load()["vlm"]
    assert hub.cancelled == before + 1 and load == {**load, "running": 0, "queued": 0, "free_slots": load["slots"]}
    last = hub.finished[-1]
    assert last["finish_reason"] == "cancelled" and last["qos"] == "interactive" and last["tokens"] < 240


def test_video_url_frames_are_chosen_as_in_qa(client, media, hf):
    from specstream.stages.keyframes import select_keyframes

    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(media["talk"],
                                                                                             "video/mp4")}},
                                         {"type": "text", "text": "What happens?"}]}]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    frames = [k.image for k in select_keyframes(str(media["talk"]))]  # 2 scenes: both keyframes (at most 4)
    want, n_prompt = hf_generate(hf, frames, "What happens?", 8)
    assert r.choices[0].model_extra["token_ids"] == want and r.usage.prompt_tokens == n_prompt


def test_completions_raw_prompt_and_legacy_logprobs(client, hf):
    r = client.completions.create(model=VLM, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True})
    want, n_prompt = hf_generate(hf, [], None, 6, raw="Once upon a time")
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want and r.usage.prompt_tokens == n_prompt
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(max(top.values()) == pytest.approx(v, abs=1e-4) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    ids = hf[1].tokenizer("Once upon a time")["input_ids"]  # the same prompt as token ids: the same answer
    r2 = client.completions.create(model=VLM, prompt=ids, max_tokens=6, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r2.choices[0].model_extra["token_ids"] == want and r2.usage.prompt_tokens == len(ids) == n_prompt


def test_transcriptions_in_each_format(client, media):
    from specstream.stages.speech import format_timestamp, transcribe

    direct = transcribe(str(media["talk"]))  # the audio track of a video (AAC in MP4)
    (seg,) = direct.segments
    assert seg.text == SENTENCE

    def create(fmt, **kw):
        with open(media["talk"], "rb") as fh:
            return client.audio.transcriptions.create(model="whisper-1", file=fh, response_format=fmt, **kw)

    assert create("json").text == SENTENCE
    assert create("text") == SENTENCE + "\n"
    srt_end, vtt_end = format_timestamp(seg.end_s), format_timestamp(seg.end_s, ".")
    assert srt_end.startswith("00:00:0") and vtt_end == srt_end.replace(",", ".")
    assert create("srt") == f"1\n{format_timestamp(seg.start_s)} --> {srt_end}\n{SENTENCE}\n\n"
    assert create("vtt") == f"WEBVTT\n\n{format_timestamp(seg.start_s, '.')} --> {vtt_end}\n{SENTENCE}\n\n"
    v = create("verbose_json", timestamp_granularities=["segment"])
    assert v.text == SENTENCE and v.duration == pytest.approx(direct.info.duration_s, abs=1e-3)
    assert [(s.start, s.end, s.text) for s in v.segments] == [(seg.start_s, seg.end_s, SENTENCE)]
    # a WAV upload, and the model's own id; a file without audio is refused by its content
    with open(media["wav"], "rb") as fh:
        got = client.audio.transcriptions.create(model="whisper-tiny.en", file=fh).text
    assert got == transcribe(str(media["wav"])).text
    with pytest.raises(openai.BadRequestError) as e, open(media["silent"], "rb") as fh:
        client.audio.transcriptions.create(model="whisper-1", file=fh)
    assert e.value.code == "unsupported_media"
    with pytest.raises(openai.NotFoundError), open(media["wav"], "rb") as fh:
        client.audio.transcriptions.create(model="whisper-large", file=fh)
    words_supported = "word_timestamps" in inspect.signature(transcribe).parameters
    if words_supported:
        w = create("verbose_json", timestamp_granularities=["word"])
        assert " ".join(x.word.strip() for x in w.words).rstrip(".") == SENTENCE.rstrip(".")
    else:
        with pytest.raises(openai.BadRequestError) as e:
            create("verbose_json", timestamp_granularities=["word"])
        assert e.value.code == "unsupported_parameter"


def test_data_urls_use_the_upload_limit(src):
    """Media in data: URLs decode to at most max_upload_bytes per request (as one upload to /v1/captions); the JSON
    body may be that much base64 plus the form overhead, and a larger body is refused before it is read."""
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    size = Path(src["astronaut"]).stat().st_size
    c = TestClient(create_app(ServerSettings(max_upload_bytes=size - 1000)))  # no lifespan: no models load
    body = {"model": VLM, "messages": image_message(data_url(src["astronaut"], "image/png")), "max_tokens": 2}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and f"over {size - 1000} bytes" in err["message"]
    assert err["param"] == "messages.0.content.0" and err["type"] == "invalid_request_error"
    small = TestClient(create_app(ServerSettings(max_upload_bytes=1000)))
    assert small.post("/v1/chat/completions", json=body).status_code == 413
