"""The ``specstream generate`` contract (used by checks: keep it stable)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import hf_greedy

CMD = [sys.executable, "-m", "specstream"]


def run(*args, check_rc=0):
    proc = subprocess.run([*CMD, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == check_rc, proc.stderr
    return proc


def test_generate_json_contract_and_exactness(tiny, hf_target):
    out = run("generate", "--target", tiny.target, "--draft", tiny.noisy, "--prompt-ids", "5,6,7,8,5,6",
              "--max-new-tokens", 12, "--json").stdout.splitlines()
    assert len(out) == 1
    rec = json.loads(out[0])
    assert set(rec) == {"tokens", "finish_reason", "stats"}
    assert set(rec["stats"]) == {"target_steps", "prefill_steps", "accepted_per_step", "mean_accepted", "tau",
                                 "decode_s"}
    assert 0 < rec["stats"]["decode_s"] < 300
    assert rec["tokens"] == hf_greedy(hf_target, [5, 6, 7, 8, 5, 6], 12)
    assert rec["finish_reason"] == "length"
    # one prefill forward (it commits the first token, verifies no draft), then one entry per verify step
    assert rec["stats"]["prefill_steps"] == 1
    assert len(rec["stats"]["accepted_per_step"]) == rec["stats"]["target_steps"] - rec["stats"]["prefill_steps"]
    assert rec["stats"]["tau"] == round(12 / rec["stats"]["target_steps"], 6)


def test_prompt_ids_file_runs_one_batch_in_input_order(tiny, hf_target, tmp_path):
    prompts = [[1, 2, 3], [9, 9, 9, 9], [200], [7, 8, 7, 8, 7]]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    lines = run("generate", "--target", tiny.target, "--prompt-ids-file", f, "--max-new-tokens", 6, "--json",
                "--tree", "dynamic:8").stdout.splitlines()
    assert [json.loads(x)["tokens"] for x in lines] == [hf_greedy(hf_target, p, 6) for p in prompts]


def test_no_speculation_decodes_one_token_per_step(tiny):
    rec = json.loads(run("generate", "--target", tiny.target, "--prompt-ids", "1,2,3", "--max-new-tokens", 7,
                         "--no-speculation", "--json").stdout)
    assert rec["stats"]["target_steps"] == 7 and rec["stats"]["tau"] == 1.0
    assert rec["stats"]["accepted_per_step"] == [0] * 6


def test_sampling_is_reproducible_with_a_seed(tiny):
    args = ("generate", "--target", tiny.target, "--draft", tiny.same, "--prompt-ids", "4,5,6",
            "--max-new-tokens", 10, "--mode", "sample", "--temperature", 1.5, "--top-k", 20, "--top-p", 0.9,
            "--seed", 7, "--json")
    a, b = json.loads(run(*args).stdout), json.loads(run(*args).stdout)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 10
    c = json.loads(run(*args[:-3], "--seed", 8, "--json").stdout)
    assert c["tokens"] != a["tokens"]


def test_prompt_text_needs_and_uses_a_tokenizer(tiny, tmp_path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ck = tmp_path / "withtok"
    shutil.copytree(tiny.target, ck)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["speculative decoding verifies a token tree"] * 10,
                            trainers.BpeTrainer(vocab_size=256, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(ck / "tokenizer.json"))
    rec = json.loads(run("generate", "--target", ck, "--prompt", "token tree", "--max-new-tokens", 5,
                         "--json").stdout)
    assert isinstance(rec["text"], str) and len(rec["tokens"]) == 5
    err = run("generate", "--target", tiny.target, "--prompt", "hello", "--max-new-tokens", 5, check_rc=2).stderr
    assert "tokenizer" in err


def test_clear_errors_and_exit_codes(tiny, tmp_path):
    err = run("generate", "--target", tmp_path / "nope", "--prompt-ids", "1", "--max-new-tokens", 2,
              check_rc=2).stderr
    assert "checkpoint_not_found" in err
    err = run("generate", "--target", tiny.target, "--prompt-ids", "1", "--max-new-tokens", 2, "--tree", "1,0",
              check_rc=2).stderr
    assert "bad tree widths" in err
    err = run("generate", "--target", tiny.target, "--prompt-ids", ",".join(["1"] * 300), "--max-new-tokens", 2,
              "--max-len", 256, check_rc=2).stderr
    assert "context_length_exceeded" in err


@pytest.mark.parametrize("content", ["[1, 2]\n[1, 2\n", "[1, 2]\n[true, 2]\n", "[1, 2]\n{\"ids\": [1]}\n", None])
def test_bad_prompt_ids_file_is_a_clear_error(tiny, tmp_path, capsys, content):
    """A malformed file is ``invalid_request``; a missing one ``unreadable_source`` (as on every command)."""
    from specstream.cli import main

    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["generate", "--target", str(tiny.target), "--prompt-ids-file", str(path), "--max-new-tokens",
                 "2", "--json"]) == 2
    err = capsys.readouterr().err
    if content:
        assert "invalid_request" in err and "p.jsonl:2" in err
    else:
        assert "unreadable_source" in err and "No such file" in err


def test_serve_rejects_bad_settings_with_a_clear_message(capsys, monkeypatch):
    """A bad ``specstream serve`` flag or ``SPECSTREAM_*`` value exits 2 naming the setting (no traceback, no
    server started)."""
    from specstream.cli import main

    assert main(["serve", "--agree-span-s", "-1"]) == 2
    assert "agree_span_s (--agree-span-s / SPECSTREAM_AGREE_SPAN_S)" in capsys.readouterr().err
    monkeypatch.setenv("SPECSTREAM_MIN_HOP_S", "0")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "min_hop_s (SPECSTREAM_MIN_HOP_S)" in err and "Traceback" not in err


@pytest.mark.timeout(180)
def test_caption_prompt_longer_than_the_context_ends_as_error_records(tmp_path, capsys, monkeypatch, src):
    """A 1000-word prompt overflows the context with the image tokens: each input gets its error record
    (``context_length_exceeded``) and the command exits 1 (before: it hung with an empty output). The progress
    bar counts inputs against their total; counts read "1 input", "2 inputs"."""
    from specstream.cli import main
    from specstream.pipeline.caption_job import CaptionJobSummary

    out = tmp_path / "c.jsonl"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the progress bar is drawn on a terminal only
    code = main(["caption", src["astronaut"], src["rocket"], "--prompt", " ".join(["word"] * 1000),
                 "--out", str(out), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 1, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"] for r in records] == [src["astronaut"], src["rocket"]]
    assert {r["error"]["code"] for r in records} == {"context_length_exceeded"}
    assert "captioning: 100%" in err and "| 2/2 [" in err and " input/s" in err and "failed=2" in err
    assert "2 inputs (2 failed): 2 frames decoded, 2 keyframes, no caption written in " in err
    shown = [seg.strip() for seg in err.replace("\r", "\n").splitlines()]  # the bar redraws with \r
    for source in (src["astronaut"], src["rocket"]):  # each failure named on stderr (before: only the counts)
        assert any(s.startswith(f"failed {source} [context_length_exceeded]: prompt of ") for s in shown), err
    one = CaptionJobSummary(inputs=1, frames_decoded=1, keyframes=1, captions=1, tokens=1, target_steps=1,
                            seconds=1.0).line()
    assert one.startswith("1 input (0 failed): 1 frame decoded, 1 keyframe, 1 caption, 1 token in 1.0 s")


def test_prompt_text_streams_as_it_is_committed(monkeypatch, capsys):
    """Without --json the text of --prompt reaches stdout step by step (the engine's on_tokens), whole characters
    only, and equals the text of the --json record."""
    import io

    from specstream.cli import main
    from specstream.stages.speculative.engine import SpeculativeEngine

    # the built-in tiny model (the default --target) has the GPT-2 byte-level vocabulary: random ids split characters
    args = ["generate", "--prompt", "token tree", "--max-new-tokens", "24", "--no-speculation"]
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    steps: list[int] = []
    step = SpeculativeEngine.step

    def counted(self):
        finished = step(self)
        steps.append(1)
        return finished

    writes: list[tuple[int, str]] = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append((len(steps), text))
            return super().write(text)

    monkeypatch.setattr(SpeculativeEngine, "step", counted)
    monkeypatch.setattr(sys, "stdout", Recorder())
    assert main(args) == 0
    streamed = "".join(t for _, t in writes)
    assert streamed == record["text"] + "\n" and "\ufffd" not in streamed
    # one token per step: text was written after many different steps, not once at the end
    assert len(steps) == 24 and len({n for n, t in writes if t}) >= 8
    assert "[req-0] length tokens=24" in capsys.readouterr().err


def test_default_target_is_the_built_in_tiny_model(tmp_path):
    from specstream.pipeline.defaults import default_caption_models

    default = run("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", 4, "--json")
    assert "UNTRAINED" in default.stderr
    explicit = run("generate", "--target", default_caption_models(quiet=True)[0], "--prompt-ids", "5,6,7",
                   "--max-new-tokens", 4, "--json")
    assert json.loads(default.stdout)["tokens"] == json.loads(explicit.stdout)["tokens"]
    assert len(json.loads(default.stdout)["tokens"]) == 4


def test_bad_flags_fail_before_any_model_loads(tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # resolving it would fail with checkpoint_not_found
    err = run("generate", "--target", missing, "--chat", "--prompt-ids", "1", check_rc=2).stderr
    assert "--chat applies the chat template to --prompt TEXT" in err
    err = run("generate", "--target", missing, "--max-new-tokens", 3, check_rc=2).stderr
    assert "give --prompt, --prompt-ids or --prompt-ids-file" in err
    err = run("generate", "--target", missing, "--prompt-ids", "1", "--mode", "sample", "--temperature", 0,
              check_rc=2).stderr
    assert "invalid_request" in err and "temperature must be > 0" in err
    err = run("generate", "--prompt-ids", "1", "--max-new-tokens", 0, check_rc=2).stderr
    assert "--max-new-tokens must be >= 1, got 0" in err
    err = run("generate", "--prompt-ids", "1", "--num-slots", "x", check_rc=2).stderr
    assert "--num-slots must be an integer, got 'x'" in err


def test_chat_needs_a_chat_template(tiny, tmp_path):
    import shutil

    from specstream.pipeline.defaults import whisper_tokenizer_file

    ck = tmp_path / "no-template"
    shutil.copytree(tiny.target, ck)
    shutil.copy(whisper_tokenizer_file(), ck / "tokenizer.json")
    err = run("generate", "--target", ck, "--prompt", "hi", "--chat", "--max-new-tokens", 2, check_rc=2).stderr
    assert "invalid_request" in err and "has no chat template" in err


NO_BENCH = r"""
import contextlib, io, json, sys
from specstream.cli import build_parser, main

def bench():
    return sorted(m for m in sys.modules if m.startswith("specstream.pipeline.bench"))

seen = {}
build_parser().parse_args(["caption", "clip.mp4"])
seen["parser"] = bench()
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(["caption", "--help"])
seen["caption --help"] = bench()
with contextlib.redirect_stderr(io.StringIO()):
    seen["caption rc"] = main(["caption", sys.argv[1]])  # a missing input: the caption path up to its check
seen["caption"] = bench()
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(["bench", "spec", "--help"])
seen["bench spec --help has --real"] = "--real" in out.getvalue()
seen["bench spec"] = bench()
print(json.dumps(seen))
"""


def test_non_bench_commands_import_no_benchmark_module(tmp_path):
    """Before: building the parser imported ``pipeline/bench/spec_real.py`` (the ``bench spec --real`` flags)
    for every command, ``specstream caption`` included."""
    proc = subprocess.run([sys.executable, "-c", NO_BENCH, str(tmp_path / "missing.mp4")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["parser"] == seen["caption --help"] == seen["caption"] == [], seen
    assert seen["caption rc"] == 1  # the missing input failed (its error record), before any model loaded
    # a bench command still gets its flags, from the bench module
    assert seen["bench spec --help has --real"] and "specstream.pipeline.bench.spec_real" in seen["bench spec"]
