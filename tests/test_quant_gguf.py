"""GGUF files at int8 / int4: the file's own blocks become int4 groups where exact (Q4_0, Q4_K), other types are
de-quantized one tensor at a time and re-quantized, and each dtype has its own cached conversion."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from gguf_fixtures import random_state, write_gguf
from specstream.errors import UnsupportedDtypeError
from specstream.kernels.quant import Int4Linear, Int8Linear, dequantize_int4
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.models import gguf as G
from specstream.stages.speculative.models.checkpoint import Checkpoint, resolve_checkpoint
from specstream.stages.speculative.models.loader import load_decoder


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _q4k_blocks(n_blocks: int, seed: int) -> np.ndarray:
    """Random but valid Q4_K super-blocks (144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes)."""
    rng = np.random.default_rng(seed)
    d = (rng.random(n_blocks) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    dmin = (rng.random(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    rest = rng.integers(0, 256, (n_blocks, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_int4_from_the_files_own_blocks_equals_gguf_dequantize(qtype):
    import gguf
    from gguf.quants import dequantize

    n, k = 32, 512
    if qtype == "Q4_0":
        w = np.random.default_rng(0).normal(0, 0.05, (n, k)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    else:
        raw = _q4k_blocks(n * k // 256, seed=1).reshape(n, -1)
    want = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[qtype]), dtype=np.float32).reshape(n, k)
    codes, sz = G.int4_from_blocks(raw, qtype, (n, k))
    assert codes.shape == (n, k) and codes.max() <= 15 and sz.shape == (k // 32, n, 2)
    got = dequantize_int4(torch.from_numpy(codes), torch.from_numpy(sz)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())  # the same codes, float32
    # stored as bf16 scales/zeros, the packed kernel is within bf16 rounding of the file's values
    layer = Int4Linear.from_codes(torch.from_numpy(codes), torch.from_numpy(sz).bfloat16(), None, 32)
    x = torch.randn(2, k).bfloat16()
    ref = x.float() @ torch.from_numpy(want).t()
    assert (layer(x).float() - ref).abs().max() <= 0.02 * ref.abs().max()


def _gguf(tmp_path, quantize, arch="qwen2"):
    state = random_state(arch, tied=True, seed=7)
    return write_gguf(tmp_path / f"tiny-{quantize}.gguf", arch, state, quantize=quantize)


def test_q4_0_file_converts_to_int4_from_blocks_and_q8_0_requantizes_with_a_log_line(tmp_path, cache, caplog):
    q4 = _gguf(tmp_path, "Q4_0")
    ck = resolve_checkpoint(q4, dtype="int4")
    how = json.loads((ck.path / "QUANTIZED.json").read_text())["tensors"]
    assert how["model.layers.0.mlp.down_proj.weight"] == "Q4_0 blocks -> int4 g32"
    assert how["model.norm.weight"] == "F32 -> float32"
    model = load_decoder(ck, "int4")
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate_up_proj if mlp.gate_up_proj is not None else mlp.up_proj, Int4Linear)
    # the layer multiplies with exactly the file's Q4_0 codes
    import gguf
    from gguf.quants import dequantize
    from gguf import GGUFReader

    raw = next(t for t in GGUFReader(q4).tensors if t.name == "blk.1.ffn_up.weight")
    want = np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32)
    if mlp.gate_up_proj is not None:  # fused at load: [gate; up] rows
        got = mlp.gate_up_proj.dequantized()[mlp.down_proj.in_features:].numpy()
    else:
        got = mlp.up_proj.dequantized().numpy()
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()  # bf16 rounding of the scales only

    q8 = _gguf(tmp_path, "Q8_0")
    with caplog.at_level(logging.INFO, logger="specstream.gguf"):
        ck8 = resolve_checkpoint(q8, dtype="int8")
    assert any("Q8_0 tensors de-quantized one at a time and re-quantized to int8" in r.message for r in caplog.records)
    how8 = json.loads((ck8.path / "QUANTIZED.json").read_text())["tensors"]
    assert how8["model.layers.0.self_attn.q_proj.weight"] == "Q8_0 de-quantized -> int8"
    attn = load_decoder(ck8, "int8").model.layers[0].self_attn
    assert isinstance(attn.qkv_proj if attn.qkv_proj is not None else attn.q_proj, Int8Linear)


def test_each_dtype_has_its_own_cached_conversion_never_another_ones(tmp_path, cache):
    src = _gguf(tmp_path, "Q4_0")
    keys = {d: G.cache_key(src, d) for d in ("float32", "bfloat16", "int8", "int4", "int4-g64")}
    assert keys["float32"] == keys["bfloat16"]  # bfloat16 loads the de-quantized float32 conversion
    assert len({keys["float32"], keys["int8"], keys["int4"], keys["int4-g64"]}) == 4
    c8 = resolve_checkpoint(src, dtype="int8").path
    c4 = resolve_checkpoint(src, dtype="int4").path
    assert c8 != c4 and c8.exists() and c4.exists()  # converting int4 left the int8 conversion alone
    assert Checkpoint(c8).quantized_dtype() == "int8" and Checkpoint(c4).quantized_dtype() == "int4"
    # a cache folder of another dtype at this dtype's key is converted again, not used
    fake = cache / "converted" / G.cache_key(src, "int4-g64")
    import shutil

    shutil.copytree(c8, fake)
    c64 = resolve_checkpoint(src, dtype="int4-g64").path
    assert c64 == fake and Checkpoint(c64).quantized_dtype() == "int4-g64"
    # a quantized conversion never loads at another dtype
    with pytest.raises(UnsupportedDtypeError, match="holds int8 weights; it cannot load as int4"):
        load_decoder(Checkpoint(c8), "int4")


def test_gguf_int4_engine_greedy_speculative_equals_no_speculation(tmp_path, cache):
    src = _gguf(tmp_path, "Q4_0")
    cfg = EngineConfig(num_slots=4, max_len=128, tree=TreeSpec.parse("1,1,2"), adaptive=False)
    plain = SpeculativeEngine.from_checkpoints(src, [], config=cfg, dtype="int4")
    spec = SpeculativeEngine.from_checkpoints(src, [src], ngram=True, config=cfg, dtype="int4", draft_dtype="int8")
    prompts = [[3, 4, 5, 3, 4, 5], [10, 11]]
    a, b = plain.generate(prompts, 12), spec.generate(prompts, 12)
    assert [r.output_ids for r in b] == [r.output_ids for r in a]


def test_a_second_dtype_of_the_same_file_copies_the_tokenizer_instead_of_rebuilding_it(tmp_path, cache,
                                                                                     monkeypatch):
    """The tokenizer does not depend on the weights' format: the int8 and int4 conversions of a file whose float32
    conversion exists copy its tokenizer files (rebuilding them through transformers parses the vocabulary and
    merges again: 11 s of the real 1.5B Qwen2.5 file's int4 conversion). A changed file converts its tokenizer
    again (another fingerprint), and so does a file with no earlier conversion."""
    import transformers

    built: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        built.append(kwargs.get("gguf_file"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    src = _gguf(tmp_path, "Q4_0")
    f32 = resolve_checkpoint(src).path
    c8 = resolve_checkpoint(src, dtype="int8").path
    c4 = resolve_checkpoint(src, dtype="int4").path
    assert built == [src.name]  # one tokenizer conversion for the three formats
    names = sorted(p.name for p in f32.iterdir() if p.name in G.TOKENIZER_FILES)
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    for folder in (c8, c4):
        assert sorted(p.name for p in folder.iterdir() if p.name in G.TOKENIZER_FILES) == names
        for name in names:
            assert (folder / name).read_bytes() == (f32 / name).read_bytes(), (folder.name, name)
    text = "the cat sat in the hat"
    assert Checkpoint(c4).tokenizer.encode(text).ids == Checkpoint(f32).tokenizer.encode(text).ids
    # another file (its own fingerprint) builds its own tokenizer, even beside these conversions
    other = _gguf(tmp_path, "Q8_0")
    resolve_checkpoint(other, dtype="int8")
    assert built == [src.name, other.name]
