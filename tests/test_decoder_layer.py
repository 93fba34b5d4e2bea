"""The C++ decoder layer (``kernels/decoder_layer.cpp``) against the PyTorch layer, on tiny random int4 decoders:
the same logits to bfloat16 rounding, row invariance bit for bit (what greedy speculative = plain decoding rests
on), packed batches, the drafts' cache sanitizing, exported attention, and the switch."""

from __future__ import annotations

import pytest
import torch

from specstream.kernels import decoder_layer
from specstream.kernels.tree_attention import build_tree_mask
from specstream.stages.speculative.models.llama import ForwardBatch
from specstream.stages.speculative.models.loader import load_decoder

# the CPU check only: the first test compiles the layer (about 70 s), not the collection of every worker
pytestmark = pytest.mark.skipif(not decoder_layer.cpu_supported(), reason="no x86-64 CPU with AVX2 + FMA or AVX-512 VNNI here")


def _model(path, fused: bool):
    model = load_decoder(path, "int4")
    if not fused:
        model._fused_args = False  # the PyTorch layers
    return model


def _causal(prefix: int, t: int) -> torch.Tensor:
    return build_tree_mask(torch.tensor([prefix]), [torch.ones(t, t, dtype=torch.bool).tril()], prefix + t, t)


def _forward(model, cache, slot, tokens, start, row_invariant=True, attention_layers=()):
    t = len(tokens)
    pos = torch.arange(start, start + t)[None]
    batch = ForwardBatch(torch.tensor([slot]), torch.tensor([tokens]), pos, pos.clone(), _causal(start, t),
                         slot_list=[slot], row_invariant=row_invariant, attention_layers=attention_layers)
    return model.forward_batch(cache, batch)


PROMPT = [5, 17, 200, 31, 4, 77, 9, 120, 3, 64, 250, 8]


@pytest.mark.parametrize("which", ["target", "qwen"])  # llama without biases; qwen2 with q/k/v biases, tied head
def test_cpp_layer_gives_the_pytorch_layers_logits(tiny, which):
    path = getattr(tiny, which)
    fused, plain = _model(path, True), _model(path, False)
    assert fused.fused_layer_args() is not None and plain.fused_layer_args() is None
    out = {}
    for name, model in (("cpp", fused), ("torch", plain)):
        cache = model.new_cache(1, 64)
        prefill = _forward(model, cache, 0, PROMPT, 0)[0]
        step = _forward(model, cache, 0, [42], len(PROMPT))[0]
        out[name] = torch.cat([prefill[0], step[0]])
    # the same computation, rounded to bfloat16 at the same places; only the float32 sums of the norms and the exp
    # of SiLU are the C++ file's own, so a few values move by a bfloat16 step
    same = (out["cpp"] == out["torch"]).float().mean().item()
    assert same > 0.9, same
    torch.testing.assert_close(out["cpp"], out["torch"], rtol=0.02, atol=0.05)
    assert torch.equal(out["cpp"].argmax(-1), out["torch"].argmax(-1))


def test_cpp_layer_gives_the_pytorch_layers_logits_for_a_packed_batch_read_by_gather(tiny):
    """Two slots in reverse order (the cache is read by an index tensor, not a slice) with ragged rows (packed):
    the C++ layers' logits against the PyTorch layers' of the same batch."""
    out = {}
    for name, fused in (("cpp", True), ("torch", False)):
        model = _model(tiny.qwen, fused)
        cache = model.new_cache(2, 64)
        _forward(model, cache, 0, PROMPT[:5], 0)
        _forward(model, cache, 1, PROMPT[:8], 0)
        t = 3
        ids = torch.tensor([[PROMPT[8], PROMPT[9], 0], PROMPT[5:8]])
        pos = torch.tensor([[8, 9, 10], [5, 6, 7]])
        cols = torch.tensor([[8, 9, cache.scratch], [5, 6, 7]])
        mask = build_tree_mask(torch.tensor([8, 5]), [torch.ones(t, t, dtype=torch.bool).tril()] * 2, 11, t)
        batch = ForwardBatch(torch.tensor([1, 0]), ids, pos, cols, mask, slot_list=[1, 0], row_invariant=True,
                             row_lengths=[2, 3])
        logits = model.forward_batch(cache, batch)[0]
        out[name] = torch.cat([logits[0, :2], logits[1]])
    assert (out["cpp"] == out["torch"]).float().mean().item() > 0.9
    torch.testing.assert_close(out["cpp"], out["torch"], rtol=0.02, atol=0.05)
    assert torch.equal(out["cpp"].argmax(-1), out["torch"].argmax(-1))


def test_cpp_layer_is_row_invariant_bit_for_bit(tiny):
    """A prompt in one forward, one token at a time, and as a ragged packed batch beside other rows: every token's
    logits are the same bits (the target's tree rows equal plain decoding's)."""
    model = _model(tiny.qwen, True)
    cache = model.new_cache(3, 64)
    whole = _forward(model, cache, 0, PROMPT, 0)[0][0]
    for j, tok in enumerate(PROMPT):
        one = _forward(model, cache, 1, [tok], j)[0][0, 0]
        assert torch.equal(one, whole[j]), j
    # a ragged batch: slot 2 holds the prompt's first 4 tokens, slot 1 its first 9; rows of 3 and 1 new tokens
    fresh = model.new_cache(3, 64)
    _forward(model, fresh, 2, PROMPT[:4], 0)
    _forward(model, fresh, 1, PROMPT[:9], 0)
    t, lengths, starts = 3, [3, 1], [4, 9]
    ids = torch.tensor([PROMPT[4:7], [PROMPT[9], 0, 0]])
    pos = torch.tensor([[4, 5, 6], [9, 10, 11]])
    cols = torch.tensor([[4, 5, 6], [9, fresh.scratch, fresh.scratch]])
    mask = build_tree_mask(torch.tensor(starts), [torch.ones(t, t, dtype=torch.bool).tril()] * 2, 12, t)
    fresh.k[:, 1, :, fresh.scratch] = 1.0  # so that the padding rows' zero writes show
    fresh.v[:, 1, :, fresh.scratch] = 1.0
    batch = ForwardBatch(torch.tensor([2, 1]), ids, pos, cols, mask, slot_list=[2, 1], row_invariant=True,
                         row_lengths=lengths)
    logits = model.forward_batch(fresh, batch)[0]
    assert torch.equal(logits[0], whole[4:7])
    assert torch.equal(logits[1, 0], whole[9])
    # the packed forward wrote zeros to the scratch column for the padding, as the padded layout does
    assert not fresh.k[:, 1, :, fresh.scratch].any() and not fresh.v[:, 1, :, fresh.scratch].any()


def test_cpp_layer_sanitizes_a_draft_cache_as_nan_to_num(tiny):
    """A drafter's cache replaces non-finite keys/values on write (``KVCache.sanitize``): a NaN bias entry of
    the key projection becomes 0 in the cache, as ``torch.nan_to_num`` makes it in the PyTorch layer."""
    caches = {}
    for name, fused in (("cpp", True), ("torch", False)):
        model = _model(tiny.qwen, fused)
        qkv = model.model.layers[0].self_attn.qkv_proj
        hq = model.config.num_attention_heads * model.config.head_dim
        qkv.bias.data[hq + 3] = float("nan")  # key head 0, channel 3
        qkv.bias.data[hq + 4] = float("inf")  # channel 4 (RoPE keeps it infinite or makes it NaN)
        hv = hq + model.config.num_key_value_heads * model.config.head_dim
        qkv.bias.data[hv + 5] = float("-inf")  # value head 0, channel 5
        model._fused_args = None if fused else False
        cache = model.new_cache(1, 32)
        cache.sanitize = True
        _forward(model, cache, 0, PROMPT, 0, row_invariant=False)
        caches[name] = (cache.k[0, 0, 0, : len(PROMPT)].clone(), cache.v[0, 0, 0, : len(PROMPT)].clone())
    (k, v), (k_ref, v_ref) = caches["cpp"], caches["torch"]
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert not k[:, 3].any()
    lowest = torch.finfo(torch.bfloat16).min
    assert (v[:, 5] == lowest).all()  # -inf -> the lowest finite bfloat16, as nan_to_num
    assert torch.equal(k[:, 3:5], k_ref[:, 3:5]) and torch.equal(v[:, 5], v_ref[:, 5])


def test_cpp_layer_exports_attention_probabilities(tiny):
    out = {}
    for name, fused in (("cpp", True), ("torch", False)):
        model = _model(tiny.target, fused)
        cache = model.new_cache(1, 32)
        out[name] = _forward(model, cache, 0, PROMPT, 0, attention_layers=(1,))[1]
    assert set(out["cpp"]) == {1}
    probs = out["cpp"][1]
    assert probs.shape == (1, 4, len(PROMPT), len(PROMPT))
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, len(PROMPT)), rtol=1e-5, atol=1e-5)
    assert not probs[0, :, 0, 1:].any()  # causal
    torch.testing.assert_close(probs, out["torch"][1], rtol=0.02, atol=0.02)


def test_the_switch_and_its_errors(tiny, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_DECODER_LAYER", "torch")
    assert not decoder_layer.available() and not decoder_layer.cpu_supported()
    assert load_decoder(tiny.target, "int4").fused_layer_args() is None
    monkeypatch.setenv("SPECSTREAM_DECODER_LAYER", "fast")
    with pytest.raises(ValueError, match="SPECSTREAM_DECODER_LAYER='fast'"):
        decoder_layer.available()
    monkeypatch.setenv("SPECSTREAM_DECODER_LAYER", "cpp")
    assert decoder_layer.available()
    # asked for, but one of its kernels is switched off: an error naming why, not a silent PyTorch layer
    monkeypatch.setenv("SPECSTREAM_INT4_KERNEL", "torch")
    with pytest.raises(decoder_layer.DecoderLayerUnavailable, match="SPECSTREAM_INT4_KERNEL=torch"):
        decoder_layer.available()
    monkeypatch.delenv("SPECSTREAM_INT4_KERNEL")
    # float weights never take the C++ layer
    assert load_decoder(tiny.target, "bfloat16").fused_layer_args() is None
