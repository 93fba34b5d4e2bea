"""Text out of the engine: incremental detokenisation of committed ids, and stop ids from the generation config."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
from tokenizers import Tokenizer

from conftest import hf_greedy
from specstream.modalities.text import IncrementalDetokenizer
from specstream.pipeline.defaults import whisper_tokenizer_file
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

TEXT = "naïve café 🙂 日本語 — done. Ünïcödé ✓"


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_file(str(whisper_tokenizer_file()))


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_never_splits_a_character(gpt2, chunk):
    ids = gpt2.encode(TEXT, add_special_tokens=False).ids
    # the byte-level vocabulary spreads characters over several ids: decoding one alone gives U+FFFD
    assert sum("\ufffd" in gpt2.decode([i]) for i in ids) >= 4
    detok = IncrementalDetokenizer(gpt2)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == gpt2.decode(ids)
    # text came out as it was pushed, not all at the end: most pushes complete a character
    assert sum(bool(d) for d in deltas) >= (len(deltas) - 1) // 2


def test_stream_ending_mid_character_flushes_the_replacement(gpt2):
    ids = gpt2.encode("ok 🦜", add_special_tokens=False).ids
    head = ids[:-1]
    assert "\ufffd" in gpt2.decode(head)  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(gpt2)
    assert detok.push(head[:1]) == "ok"
    assert detok.push(head[1:]) == ""  # " " + two of the parrot's four bytes: held back
    assert detok.flush() == " \ufffd"


def test_special_tokens_are_left_out(gpt2):
    eot = gpt2.token_to_id("<|endoftext|>")
    detok = IncrementalDetokenizer(gpt2)
    assert detok.push(gpt2.encode("hi", add_special_tokens=False).ids + [eot]) == "hi"
    assert detok.flush() == ""
    assert IncrementalDetokenizer(gpt2, skip_special_tokens=False).push([eot]) == "<|endoftext|>"


def test_generation_config_stop_ids_join_config_eos(tiny, hf_target, tmp_path):
    """``generation_config.json`` may list more stop ids than ``config.json`` (Qwen2.5 does): the engine stops on
    each, as Hugging Face ``generate`` does."""
    prompt = [11, 12, 13, 14]
    free = hf_greedy(hf_target, prompt, 12)
    stop = free[4]
    ck = tmp_path / "two-stops"
    shutil.copytree(tiny.target, ck)
    cfg = json.loads((ck / "config.json").read_text())
    first = next(t for t in range(256) if t not in free)  # a config eos the greedy path never reaches
    cfg["eos_token_id"] = first
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, stop]}))
    eng = SpeculativeEngine.from_checkpoints(ck, [tiny.same], config=EngineConfig(num_slots=1))
    assert eng.eos_token_ids == (first, stop)
    req = eng.generate([prompt], 12)[0]
    assert req.output_ids == free[: free.index(stop) + 1] == hf_greedy(hf_target, prompt, 12, eos=stop)
    assert req.finish_reason == "eos"


@pytest.mark.parametrize("stop", [(), ("never appears",)])
def test_streamed_chat_text_decodes_each_token_a_bounded_number_of_times(gpt2, stop):
    """A 600-token stream, one token per step, through the server's stream follower (``serving._Stream``): the
    released text equals decoding all ids at once, and the ids decoded in total grow linearly. The old follower
    decoded the whole output every step (and every prefix again for stop strings): 600 x 601 / 2 = 180,300 ids
    at least; now at most a short window per push."""
    from types import SimpleNamespace

    from specstream.schedulers.plan import TokenDelta
    from specstream.stages.serving import GenerationParams, _Stream

    ids = gpt2.encode((TEXT + " ") * 40, add_special_tokens=False).ids[:600]
    decoded = [0]

    def decode(window):
        decoded[0] += len(window)
        return gpt2.decode(window)

    model = SimpleNamespace(decode=decode, eos=(50256,), info=SimpleNamespace(id="m"))
    released = []
    stream = _Stream(model, GenerationParams(stop=stop), lambda: None, lambda d: released.append(d.text),
                     collections.deque(), "interactive")
    for k, token in enumerate(ids):
        stream.on_tokens(TokenDelta("r", (token,), (), k + 1, k + 1 == len(ids), "length" if k + 1 == len(ids)
                                    else None, None))
    assert "".join(released) == gpt2.decode(ids)
    assert all("\ufffd" not in r for r in released)
    assert decoded[0] <= 12 * len(ids), decoded[0]
