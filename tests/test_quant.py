"""Weight-only quantization (kernels/quant.py): kernels against their float reference, the loader's dtypes, and
exactness at each dtype (greedy speculative == the same engine at that dtype without speculation)."""

from __future__ import annotations

import sys

import pytest
import torch

from specstream.errors import UnsupportedDtypeError
from specstream.kernels.quant import (
    KERNEL_TOLERANCE,
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
)
from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.models.dtypes import weight_format
from specstream.stages.speculative.models.loader import load_decoder

# (out_features, in_features) of the real Qwen2.5 0.5B / 1.5B linears (q/o, k/v, gate/up, down)
PROBE_SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864), (1536, 1536), (256, 1536), (8960, 1536),
                (1536, 8960)]
#: quantization error vs the float weights (relative to max |y| on a random probe), measured on these shapes
#: with N(0, 0.02) weights: int8 ~0.5%, int4-g32 ~8%, int4-g64 ~10%
QUANT_TOLERANCE = {"int8": 0.02, "int4": 0.15}


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02, torch.randn(3, k, generator=g).bfloat16()


PROBE_CASES = [(s, k) for k in ("int8", "int4-g32") for s in PROBE_SHAPES] + [(s, "int4-g64") for s in PROBE_SHAPES[:4]]


@pytest.mark.parametrize("shape,kind", PROBE_CASES, ids=[f"{k}-{n}x{m}" for (n, m), k in PROBE_CASES])
def test_quantized_linear_against_float_reference(shape, kind):
    n, k = shape
    w, x = _weights(n, k, seed=n + k)
    if kind == "int8":
        layer = Int8Linear.from_float(w, None)
        q, s = quantize_int8(w)
        ref_w = q.float() * s.float()[:, None]
    else:
        group = int(kind.split("-g")[1])
        layer = Int4Linear.from_float(w, None, group)
        q, sz = quantize_int4(w, group)
        ref_w = dequantize_int4(q, sz)
        assert q.max() <= 15 and sz.shape == (k // group, n, 2)
    y = layer(x).float()
    assert y.dtype == torch.float32 and y.shape == (3, n)
    scale = (x.float() @ w.t()).abs().max()
    # the kernel equals the float32 product with the same quantized weights ...
    assert (y - x.float() @ ref_w.t()).abs().max() <= KERNEL_TOLERANCE * scale
    # ... and the quantized weights approximate the float ones within the format's stated tolerance
    assert (y - x.float() @ w.t()).abs().max() <= QUANT_TOLERANCE[kind[:4]] * scale


def test_int4_groups_are_exact_on_representable_weights():
    """Weights that are exactly (q - 8) * s + z with bf16 s, z come back bit for bit."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 64), generator=g)
    q[:, ::32] = 0
    q[:, 1::32] = 15  # every group uses the full range, so min/max recover s and z
    s = (torch.rand(2, 64, generator=g) * 0.01 + 0.001).bfloat16()
    z = (torch.randn(2, 64, generator=g) * 0.01).bfloat16()
    w = dequantize_int4(q, torch.stack([s, z], -1))
    q2, sz2 = quantize_int4(w, 32)
    assert torch.equal(dequantize_int4(q2, sz2), w)


@pytest.mark.parametrize("n", [256, 320])
def test_int4_embedding_rows_from_the_packed_table(n):
    """The tied lm_head's packed int4 table serves embedding lookups directly (no second copy for N % 64 == 0)."""
    w, _ = _weights(n, 64, seed=n)
    table = Int4Linear.from_float(w, None, 32, rows=True)
    assert table.row_codes is None  # gathered from the packed layout itself
    q, sz = quantize_int4(w, 32)
    ids = torch.tensor([[0, 5, n - 1], [63, 64, 130]])
    got = QuantEmbedding(table)(ids)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_int4(q, sz)[ids].bfloat16())
    w8 = Int8Linear.from_float(w, None)
    q8, s8 = quantize_int8(w)
    assert torch.equal(QuantEmbedding(w8)(ids), (q8.float() * s8.float()[:, None])[ids].bfloat16())


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_loader_quantizes_every_linear_and_ties_one_table(tiny, dtype):
    model = load_decoder(tiny.qwen, dtype)
    cls = Int8Linear if dtype == "int8" else Int4Linear
    layer = model.model.layers[0]
    # q/k/v and gate/up are fused into one product each where the layout allows (LlamaDecoder.fuse_projections:
    # int8 always, int4 when every output size is a multiple of 64)
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    for lin in (*qkv, *gate_up, attn.o_proj, mlp.down_proj, model.lm_head):
        assert isinstance(lin, cls)
    if dtype == "int8":
        assert attn.qkv_proj is not None and not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    assert model.model.embed_tokens.table is model.lm_head  # tied: one copy
    assert model.dtype == torch.bfloat16
    assert model.new_cache(1, 8).k.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32


def _engine(path, draft, dtype, speculate, draft_dtype=None):
    cfg = EngineConfig(num_slots=8, max_len=256, tree=TreeSpec.parse("1,1,3,1,1"), adaptive=False)
    return SpeculativeEngine.from_checkpoints(path, [draft] if speculate else [], ngram=speculate, config=cfg,
                                              dtype=dtype, draft_dtype=draft_dtype)


PROMPTS = [[5, 6, 7, 8] * 3, [1, 2, 3], [200, 17, 9, 9, 41, 3, 250], [9] * 6 + [10, 11] * 3]


@pytest.mark.parametrize("dtype,draft_dtype", [("bfloat16", None), ("int8", None), ("int4", None),
                                                ("int4-g64", None), ("int8", "int4"), ("float32", "int4")])
def test_greedy_speculative_equals_same_dtype_without_speculation(tiny, dtype, draft_dtype):
    plain = _engine(tiny.target, None, dtype, False).generate(PROMPTS, 20)
    spec_engine = _engine(tiny.target, tiny.noisy, dtype, True, draft_dtype)
    spec = spec_engine.generate(PROMPTS, 20)
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids
        assert len(b.output_ids) == 20
    assert sum(r.stats.target_steps for r in spec) < sum(r.stats.target_steps for r in plain)


def test_unknown_and_unavailable_dtypes_are_typed_errors(monkeypatch):
    with pytest.raises(UnsupportedDtypeError, match="available on cpu: float32, bfloat16, int8, int4"):
        weight_format("int3")
    monkeypatch.setenv("SPECSTREAM_DISABLE_DTYPES", "int4,int4-g64")
    with pytest.raises(UnsupportedDtypeError, match=r"int4 cannot run on cpu .*available: float32, bfloat16, "
                                                    r"int8$"):
        weight_format("int4")
    assert weight_format("int8").name == "int8"


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "int3"], "unknown dtype 'int3'"),
    (["--draft-dtype", "fp8"], "unknown dtype 'fp8'"),
])
def test_cli_dtype_errors_exit_2_with_one_line(argv, needle, capsys):
    from specstream.cli import main

    assert main(["generate", "--prompt-ids", "1,2", *argv]) == 2  # before any model loads
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error [unsupported_dtype]: ") and needle in lines[0]
    assert "float32, bfloat16, int8, int4" in lines[0]


@pytest.mark.parametrize("dtype", ["int8", "int4", "int4-g64"])
def test_fused_projections_equal_the_separate_ones_bit_for_bit(dtype):
    """fuse_linears: one product whose output is exactly the concatenation of the separate layers' outputs, for
    one row and for tree-sized row counts; layers of different kinds (or bias and no bias) are not fused."""
    from specstream.kernels.quant import fuse_linears, parse_weight_format, quantize_weight

    fmt = parse_weight_format(dtype)
    gen = torch.Generator().manual_seed(3)
    layers = [quantize_weight(torch.randn(n, 128, generator=gen), torch.randn(n, generator=gen), fmt)
              for n in (128, 64, 64)]
    fused = fuse_linears(layers)
    assert fused is not None and fused.out_features == 256
    for rows in (1, 5, 21):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1))
    # a layer without a bias beside ones with it (Whisper's key projection) fuses with zeros, bit for bit
    unbiased = quantize_weight(torch.randn(64, 128, generator=gen), None, fmt)
    fused = fuse_linears([layers[0], unbiased, layers[2]])
    assert fused is not None
    for rows in (1, 5):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        assert torch.equal(fused(x), torch.cat([layers[0](x), unbiased(x), layers[2](x)], -1))
        assert torch.equal(fused(x.float()), torch.cat([layers[0](x.float()), unbiased(x.float()),
                                                         layers[2](x.float())], -1))
    other = (Int4Linear if dtype == "int8" else Int8Linear).from_float(torch.randn(64, 128, generator=gen), None)
    assert fuse_linears([layers[0], other]) is None  # int4 beside int8


@pytest.mark.parametrize("n", [40, 200, 51864])
def test_int4_packs_an_output_size_that_is_not_a_multiple_of_16(n):
    """Whisper's output projection has 51,864 rows, not a multiple of the kernels' 16 output channels. It packs as
    int4 with zero channels up to the next multiple, cut from every product (it fell back to int8 before, and
    stayed float32 where a whole model was quantized with ``quantize_linears``, a 5.7 ms product against
    0.6 ms)."""
    from specstream.kernels.quant import fuse_linears, parse_weight_format, quantize_linears, quantize_weight

    k = 64
    w, x = _weights(n, k, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    layer = quantize_weight(w, bias, parse_weight_format("int4"), rows=True)
    assert isinstance(layer, Int4Linear)
    assert layer.out_features == n and layer.packed_out_features == n + (-n % 16)
    q, sz = quantize_int4(w, 32)
    ref = dequantize_int4(q, sz)
    y = layer(x)
    assert y.shape == (3, n)
    scale = (x.float() @ ref.t()).abs().max()
    assert (y.float() - (x.float() @ ref.t() + bias)).abs().max() <= 2 * KERNEL_TOLERANCE * scale
    assert torch.equal(layer.dequantized(), ref)
    ids = torch.tensor([0, n // 2, n - 1])
    assert torch.equal(QuantEmbedding(layer)(ids), ref[ids].bfloat16())
    # a padded layer is never fused: its zero channels would sit between the outputs
    other = quantize_weight(w[:16], bias[:16], parse_weight_format("int4"))
    assert fuse_linears([layer, other]) is None
    model = torch.nn.Sequential(torch.nn.Linear(k, n))
    assert quantize_linears(model, "int4") == 1 and isinstance(model[0], Int4Linear)


def test_a_padded_int4_layer_in_pytorchs_layout_gives_back_its_weights(monkeypatch):
    """Without this project's kernel (PyTorch's packed layout), a padded layer's products, rows and de-quantized
    weights have its own ``N`` rows (de-quantizing took the padded scales and failed on shapes)."""
    from specstream.kernels import int4_vnni

    monkeypatch.setattr(int4_vnni, "supports", lambda *a, **k: False)
    w, x = _weights(40, 64, seed=9)
    layer = Int4Linear.from_float(w, None, 32, rows=True)
    assert layer.layout == "torch" and layer.packed_out_features == 48
    q, sz = quantize_int4(w, 32)
    ref = dequantize_int4(q, sz)
    assert torch.equal(layer.dequantized(), ref)
    assert layer(x).shape == (3, 40)
    assert torch.equal(QuantEmbedding(layer)(torch.tensor([0, 39])), ref[[0, 39]].bfloat16())


def test_the_float32_product_adds_the_bias_the_layer_has_now():
    """The float32 path's padded float32 bias follows the layer's bias: one registered after construction (as
    fusing Whisper's q/k/v gives the key projection a zero one), or loaded in place, is the one added."""
    w, xb = _weights(64, 64, seed=10)
    layer = Int4Linear.from_float(w, None, 32)
    x = xb.float()
    plain = layer(x)
    layer.register_buffer("bias", torch.ones(64, dtype=torch.bfloat16))
    assert torch.allclose(layer(x), plain + 1)
    layer.bias.copy_(torch.full((64,), 2.0))
    assert torch.allclose(layer(x), plain + 2)
    layer.bias = None
    assert torch.equal(layer(x), plain)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_layers_give_float32_activations_back_in_float32(dtype):
    """A model that keeps float32 activations around quantized weights (Whisper on a CPU without bfloat16
    arithmetic) gets float32 back: the product reads the input rounded to bfloat16; this project's int4 kernel
    gives its float32 accumulator plus the bias, without rounding it to bfloat16 first."""
    from specstream.kernels.quant import parse_weight_format, quantize_weight

    w, xb = _weights(64, 64, seed=5)
    bias = torch.linspace(-1, 1, 64)
    layer = quantize_weight(w, bias, parse_weight_format(dtype))
    x = xb.float()
    y32, y16 = layer(x), layer(xb)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y32.shape == (3, 64)
    ref = x @ layer.dequantized().t() + bias.bfloat16().float()
    assert (y32 - ref).abs().max() <= KERNEL_TOLERANCE * ref.abs().max()
    assert torch.equal(y32.bfloat16(), y16) if isinstance(layer, Int8Linear) else \
        (y32 - y16.float()).abs().max() <= 2**-8 * y32.abs().max()


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
    spec = TinyDecoderSpec(hidden_size=192, intermediate_size=384, num_hidden_layers=3, num_attention_heads=6,
                           num_key_value_heads=1, max_position_embeddings=512, head_scale=1.0)
    state = random_decoder_state(spec, seed=1)
    return (save_checkpoint(root / "target", spec.config_dict(), state),
            build_tiny_decoder(root / "draft", spec, seed=11, noise_from=state, noise=0.3))


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "int4"])
def test_long_greedy_speculative_equals_plain_decoding_at_bf16_activations(gqa_pair, dtype):
    """120 tokens from 8 prompts of 3-100 tokens, batched, SpecInfer tree: at bf16 activations the outputs equal
    plain decoding token for token. With PyTorch's SDPA as the attention, int8 differed on 5 of the 8 prompts
    (first at tokens 11-100) and bfloat16 on 3 (kernels/tree_attention.py, canonical_attention)."""
    target, draft = gqa_pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 70, 5, 9, 100, 33)]

    def run(speculate):
        cfg = EngineConfig(num_slots=8, max_len=400, tree=TreeSpec.parse("1,1,3,1,1"), adaptive=False)
        engine = SpeculativeEngine.from_checkpoints(target, [draft] if speculate else [], ngram=speculate,
                                                    config=cfg, dtype=dtype)
        return engine.generate(prompts, 120)

    plain, spec = run(False), run(True)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b.output_ids == a.output_ids, i
        assert len(a.output_ids) == 120
    assert sum(r.stats.target_steps for r in spec) < sum(r.stats.target_steps for r in plain)


def test_quantized_dtypes_run_on_a_cpu_without_native_bf16(monkeypatch):
    """An AVX2-only CPU (no avx512_bf16, no AMX) still runs PyTorch's bf16 and packed int8/int4 kernels; the
    precisions must be offered there (they were refused as 'cannot run on cpu' when oneDNN's native-bf16 check
    said no)."""
    from specstream.kernels import quant

    monkeypatch.setattr(quant, "_AVAILABLE", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert quant.native_bf16("cpu") is False
    for name in ("bfloat16", "int8", "int4", "int4-g64"):
        assert weight_format(name).label == name
    assert quant.available_weight_dtypes("cpu") == ["float32", "bfloat16", "int8", "int4", "int4-g64"]


@pytest.mark.parametrize("native,flags,expected", [
    (True, frozenset(), "int4"),
    (False, frozenset({"avx2", "fma"}), "int4"),
    (False, frozenset({"avx", "sse4_2"}), "int8"),
], ids=["native-bf16", "avx2-own-int4-kernel", "no-int4-kernel"])
def test_auto_dtype_loads_the_fastest_precision_of_this_cpu(tiny, monkeypatch, request, native, flags,
                                                             expected):
    """``--dtype auto``: int4 where bf16 is native or this project's int4 kernel runs (AVX2 + FMA: it decodes
    faster than int8 there), int8 on a CPU with neither (where PyTorch's int4 decoded at half int8's speed), the
    next available when one is disabled; the loaded model holds the resolved precision's packed layers."""
    from specstream.kernels import int4_vnni, quant
    from specstream.stages.speculative.models.dtypes import auto_weight_dtype

    monkeypatch.setattr(quant, "_AVAILABLE", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    monkeypatch.setattr(int4_vnni.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(int4_vnni, "cpu_flags", lambda: flags)
    int4_vnni._load.cache_clear()  # the kernel's availability under these flags, forgotten again at the end
    request.addfinalizer(int4_vnni._load.cache_clear)
    assert auto_weight_dtype("cpu") == expected
    assert weight_format("auto").label == expected and weight_format("AUTO").label == expected
    model = load_decoder(tiny.qwen, "auto")
    kind = quant.Int4Linear if expected == "int4" else quant.Int8Linear
    assert any(isinstance(m, kind) for m in model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    monkeypatch.setenv("SPECSTREAM_DISABLE_DTYPES", "int4,int8")
    assert auto_weight_dtype("cpu") == "bfloat16"
    monkeypatch.setenv("SPECSTREAM_DISABLE_DTYPES", "int4,int8,bfloat16")
    assert weight_format("auto").label == "float32"


def test_auto_dtype_is_accepted_where_precisions_are_validated():
    """The server's settings and the Kafka worker's keep ``auto`` (resolved where the model loads)."""
    from specstream.pipeline.kafka import KafkaSettings
    from specstream.pipeline.server import ServerSettings

    s = ServerSettings(caption_dtype="auto", speech_dtype="auto")
    assert (s.caption_dtype, s.speech_dtype) == ("auto", "auto")
    assert KafkaSettings(dtype="auto").dtype == "auto"
    with pytest.raises(ValueError):
        ServerSettings(caption_dtype="int3")


def test_loading_checks_each_packed_layer_a_block_of_rows_at_a_time(monkeypatch):
    """The load-time kernel check makes its float reference ``CHECK_ROWS`` output rows at a time: on a Qwen2.5
    embedding (151,936 x 1,536) the whole float copy and its temporaries took about 5 GB, the load's peak (7.0 GB
    for the int4 pair, 2.3 GB resident after). Here a 10,000-row layer: no reference block above 4,096 rows, and a
    corrupted code is still caught."""
    from specstream.kernels import quant

    sizes = []
    real = quant.dequantize_int4

    def recording(q, sz):
        sizes.append(q.shape[0])
        return real(q, sz)

    monkeypatch.setattr(quant, "dequantize_int4", recording)
    torch.manual_seed(0)
    w = torch.randn(10_000, 64)
    q, sz = quant.quantize_int4(w, 32)
    layer = quant.Int4Linear.from_codes(q, sz, None, 32)
    assert sizes and max(sizes) <= quant.CHECK_ROWS and sum(sizes) == 10_000
    bad = sz.clone()
    bad[0, 9_999, 0] *= 40  # one channel's scale far off: the check must still see the last block
    with pytest.raises(quant.QuantKernelError):
        quant.check_kernel(layer, lambda a, b: real(q[a:b], bad[:, a:b]), None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc/self/status")
def test_loading_returns_the_heap_pages_it_freed_to_the_operating_system():
    """``return_freed_heap`` (called at the end of every ``load_decoder``): pages freed in the middle of the heap
    (as loading frees one float tensor after another while later allocations stay) leave the resident set."""
    import ctypes
    import ctypes.util

    from specstream.pipeline.bench.spec_real import rss_bytes as rss
    from specstream.stages.speculative.models.loader import return_freed_heap

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(64 << 10) for _ in range(3200)]  # 200 MiB of heap (below the mmap threshold)
    for c in chunks:
        ctypes.memset(c, 1, 64 << 10)
    keep = libc.malloc(64 << 10)  # a later allocation above them: free() alone cannot shrink the heap's top
    ctypes.memset(keep, 1, 64 << 10)
    for c in chunks:
        libc.free(c)
    before = rss()
    assert return_freed_heap() is True
    after = rss()
    libc.free(keep)
    assert before - after > 150 << 20, (before, after)


@pytest.mark.parametrize("n", [200, 51864])
def test_int4_with_an_int4_residual_keeps_about_eight_bits(n):
    """``Int4ResidualLinear`` (Whisper's output projection at int4) holds a weight as its int4 codes plus int4
    codes of the rounding error: its weights are ``W1 + R`` exactly as quantized (one stacked product), the
    weight error left is under 1/8 of plain int4's and the output error (against the float weights and bias)
    under 1/4 of plain int4's, and a bfloat16 input still gives float32 logits (a bfloat16 output would round the
    residual away)."""
    from specstream.kernels.quant import Int4ResidualLinear

    k = 384
    w, x = _weights(n, k, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    layer = Int4ResidualLinear.from_float(w, bias)
    q1, sz1 = quantize_int4(w, 32)
    w1 = dequantize_int4(q1, sz1)
    q2, sz2 = quantize_int4(w - w1, 32)
    ref = w1 + dequantize_int4(q2, sz2)
    vnni = layer.stacked.layout == "vnni"  # PyTorch's layout gives its weights back through a bf16 product
    got_w = layer.dequantized()
    assert torch.equal(got_w, ref) if vnni else torch.allclose(got_w, ref, atol=2e-3)
    e_plain, e_res = (w1 - w).abs().mean().item(), (ref - w).abs().mean().item()
    assert e_res < e_plain / 8
    plain = Int4Linear.from_float(w, bias)
    for xin in (x.float(), x.bfloat16()):
        y = layer(xin)
        assert y.dtype == torch.float32 and y.shape == (3, n)
        # one stacked product, its halves added in float32 (the bias split in two: bf16 part, then the rest)
        both = layer.stacked(xin.float())
        assert torch.equal(y, both[:, :n] + both[:, n:])
        want = xin.bfloat16().float() @ w.t() + bias
        assert (y - want).abs().max() < (plain(xin).float() - want).abs().max() / 4
    # the rows the product reads are those of the stacked layer: one call, both halves
    assert layer.stacked.out_features == 2 * n
