"""The C++ row-invariant attention (kernels/row_attention.py): values against PyTorch's SDPA, the key order taken
from the cache's positions (a tree's node columns in any order), cache views read in place, the error paths, and
the target's forwards using it (greedy speculative output equal to plain decoding at bf16 activations).

The bit-for-bit invariance over batches, trees, key lengths and threads runs in tests/test_tree_attention.py
(``impl="cpp"``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specstream.kernels import decoder_layer, int4_vnni
from specstream.kernels import row_attention as ra

needs_kernel = pytest.mark.skipif(ra.unavailable_reason() is not None, reason=f"{ra.unavailable_reason()}")


def _sdpa(q, k, v, mask, scale):
    bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, float("-inf"))[:, None]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 128), (4, 4, 64), (6, 1, 16), (2, 1, 256)])
def test_values_equal_sdpa_within_float32_rounding(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq * d)
    b, t, s = 3, 5, 150
    q = (3 * torch.randn(b, hq, t, d, generator=g)).to(dtype)  # large scores: the max subtraction matters
    k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(b, t, s, generator=g) < 0.7
    mask[:, :, 0] = True
    pos = torch.arange(s).repeat(b, 1)
    out = ra.row_attention(q, k, v, mask, pos, d**-0.5)
    assert out.shape == (b, t, hq, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.transpose(1, 2), _sdpa(q, k, v, mask, d**-0.5), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_node_columns_in_any_order_give_the_same_bits_ordered_by_their_positions():
    """A tree's nodes at columns 40..51 hold positions in shuffled order: the kernel reduces each row's keys by
    position, so permuting the node columns (keys, values, mask and positions together) changes no bit, and the
    result equals the same keys committed in position order."""
    g = torch.Generator().manual_seed(3)
    d, hq, hkv, prefix, nodes = 128, 12, 2, 40, 12
    s = prefix + nodes
    q = torch.randn(1, hq, 1, d, generator=g).bfloat16()
    k, v = (torch.randn(1, hkv, s, d, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(1, 1, s, dtype=torch.bool)
    pos = torch.arange(s)[None].clone()
    in_place = ra.row_attention(q, k, v, mask, pos, d**-0.5)
    for seed in range(5):
        perm = torch.arange(s)
        perm[prefix:] = prefix + torch.randperm(nodes, generator=torch.Generator().manual_seed(seed))
        out = ra.row_attention(q, k[:, :, perm], v[:, :, perm], mask[:, :, perm], pos[:, perm], d**-0.5)
        assert torch.equal(out, in_place), seed
    # a reversed order of the same keys, each at its own column's position, is another sum: other bits
    rev = torch.arange(s - 1, -1, -1)
    other = ra.row_attention(q, k[:, :, rev], v[:, :, rev], mask, pos, d**-0.5)
    torch.testing.assert_close(other, in_place, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_cache_views_are_read_in_place_and_a_row_without_keys_gives_zeros():
    """Keys and values as slot slices of a ``[slots, Hkv, max_len, D]`` cache (strided views, as the decoder reads
    them); a row whose mask is empty comes out as zeros; a batch of rows equals each row alone."""
    g = torch.Generator().manual_seed(5)
    cache_k, cache_v = (torch.randn(6, 2, 300, 64, generator=g).bfloat16() for _ in range(2))
    k, v = cache_k[1:4, :, :90], cache_v[1:4, :, :90]
    assert not k.is_contiguous()
    q = torch.randn(3, 8, 2, 64, generator=g).bfloat16()
    mask = torch.rand(3, 2, 90, generator=g) < 0.5
    mask[2, 1] = False
    pos = torch.arange(90).repeat(3, 1)
    out = ra.row_attention(q, k, v, mask, pos, 0.125)
    assert torch.equal(out, ra.row_attention(q, k.contiguous(), v.contiguous(), mask, pos, 0.125))
    assert torch.equal(out[2, 1], torch.zeros(8, 64))
    for b in range(3):
        for t in range(2):
            alone = ra.row_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1, t:t + 1],
                                     pos[b:b + 1], 0.125)
            assert torch.equal(alone[0, 0], out[b, t]), (b, t)


@needs_kernel
def test_bad_shapes_and_dtypes_are_refused_with_the_kernels_name():
    q = torch.randn(1, 4, 1, 64)
    k = v = torch.randn(1, 2, 10, 64)
    mask = torch.ones(1, 1, 10, dtype=torch.bool)
    pos = torch.arange(10)[None]
    with pytest.raises(RuntimeError, match="row_attention: head size must be a multiple of 16"):
        ra.row_attention(q[..., :40], k[..., :40], v[..., :40], mask, pos, 1.0)
    with pytest.raises(RuntimeError, match="row_attention: mask must be bool"):
        ra.row_attention(q, k, v, mask.float(), pos, 1.0)
    with pytest.raises(RuntimeError, match="row_attention: pos must be int64"):
        ra.row_attention(q, k, v, mask, pos.int(), 1.0)
    with pytest.raises(RuntimeError, match="row_attention: query heads are not a multiple"):
        ra.row_attention(torch.randn(1, 3, 1, 64), k, v, mask, pos, 1.0)
    with pytest.raises(RuntimeError, match="row_attention: k and v differ"):
        ra.row_attention(q, k, v.bfloat16(), mask, pos, 1.0)


def test_the_choice_and_missing_cpu_flags(monkeypatch):
    monkeypatch.setenv("SPECSTREAM_ROW_ATTENTION", "torch")
    assert ra.unavailable_reason() == "SPECSTREAM_ROW_ATTENTION=torch" and not ra.available()
    monkeypatch.setenv("SPECSTREAM_ROW_ATTENTION", "fast")
    with pytest.raises(ValueError, match="expected auto, cpp or torch"):
        ra.available()
    monkeypatch.setattr(int4_vnni, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "fma"}))
    ra._load.cache_clear()
    try:
        monkeypatch.setenv("SPECSTREAM_ROW_ATTENTION", "auto")
        assert ra.unavailable_reason().endswith("; avx2 for avx2")
        assert not ra.available()
        monkeypatch.setenv("SPECSTREAM_ROW_ATTENTION", "cpp")
        with pytest.raises(ra.RowAttentionUnavailable, match="SPECSTREAM_ROW_ATTENTION=cpp, but the CPU lacks"):
            ra.available()
        with pytest.raises(ra.RowAttentionUnavailable, match="lacks"):
            ra.row_attention(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16),
                             torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long), 1.0)
    finally:
        ra._load.cache_clear()


@pytest.fixture(scope="module")
def gqa_pair(tmp_path_factory):
    """A tiny target with Qwen2.5-1.5B's head layout (6 query heads per key/value head) and its noisy draft."""
    from specstream.stages.speculative.models.tiny import (
        TinyDecoderSpec,
        build_tiny_decoder,
        random_decoder_state,
        save_checkpoint,
    )

    root = tmp_path_factory.mktemp("gqa")
    spec = TinyDecoderSpec(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=1, max_position_embeddings=512, head_scale=1.0)
    state = random_decoder_state(spec, seed=1)
    return (save_checkpoint(root / "target", spec.config_dict(), state),
            build_tiny_decoder(root / "draft", spec, seed=11, noise_from=state, noise=0.3))


@needs_kernel
@pytest.mark.parametrize("layers", ["torch", pytest.param("cpp", marks=pytest.mark.skipif(
    not decoder_layer.cpu_supported(), reason="no AVX-512 VNNI x86-64 CPU here"))])
def test_the_targets_forwards_use_the_kernel_and_greedy_speculation_stays_exact(gqa_pair, monkeypatch, layers):
    """At int4 (bf16 activations) every target forward of a speculative run, prefill chunks and 21-node tree
    verifications, goes through the kernel, and the outputs equal plain decoding token for token: with the
    PyTorch layers (the kernel called from Python) and with the C++ decoder layer (which calls it itself)."""
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.stages.speculative.models import llama

    calls = []
    if layers == "torch":
        monkeypatch.setenv("SPECSTREAM_DECODER_LAYER", "torch")

        def spy(q, k, v, mask, key_pos, scale):
            calls.append(q.shape[2])
            return ra.row_attention(q, k, v, mask, key_pos, scale)

        monkeypatch.setattr(llama, "row_attention", spy)
    else:
        ext = decoder_layer.extension()

        class Spy:
            def decoder_layer(self, *args):
                calls.append((args[4].data_ptr(), args[3]))  # (layer norm weight: whose layer, T)
                return ext.decoder_layer(*args)

        monkeypatch.setattr(decoder_layer, "extension", Spy)
    target, draft = gqa_pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 40, 9, 70)]

    def run(speculate):
        cfg = EngineConfig(num_slots=4, max_len=200, tree=TreeSpec.parse("1,1,3,1,1"), adaptive=False)
        engine = SpeculativeEngine.from_checkpoints(target, [draft] if speculate else [], ngram=speculate,
                                                    config=cfg, dtype="int4")
        return engine.generate(prompts, 40), engine

    (plain, _), n_plain = run(False), len(calls)
    spec, engine = run(True)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    if layers == "cpp":  # the speculative run's target calls only (the drafts take the C++ layer too)
        mine = {a[0].data_ptr() for a in engine.executor.target.fused_layer_args()}
        calls = [t for _, t in calls[:n_plain]] + [t for ptr, t in calls[n_plain:] if ptr in mine]
    # the speculative run's target forwards went through it, with row counts plain decoding never had: the
    # token-tree verifications
    assert n_plain > 0 and len(calls) > n_plain and set(calls[n_plain:]) - set(calls[:n_plain])
