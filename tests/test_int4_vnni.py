"""The AVX-512 VNNI int4 kernel (kernels/int4_vnni.py, int4_vnni.cpp): its layout round trip, its product
against the float32 reference, row invariance bit for bit (what speculative verification relies on), the
choice between it and PyTorch's kernel, and greedy exactness of an int4 engine on it."""

from __future__ import annotations

import pytest
import torch

from specstream.kernels import int4_vnni
from specstream.kernels.quant import KERNEL_TOLERANCE, Int4Linear, dequantize_int4, fuse_linears, quantize_int4

needs_vnni = pytest.mark.skipif(int4_vnni.unavailable_reason() is not None,
                                reason=f"int4 VNNI kernel unavailable here: {int4_vnni.unavailable_reason()}")


def _codes(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    q, sz = quantize_int4(w, 32)
    return q, sz.to(torch.bfloat16)


def _activations(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :: max(1, k // 7)] *= 30.0  # outlier channels, as in LLM hidden states
    return x.bfloat16()


def test_layout_round_trip_gives_back_codes_scales_and_zeros():
    q, sz = _codes(48, 96)
    packed = int4_vnni.pack(q, sz)
    assert packed.shape == (3, 3, 320) and packed.dtype == torch.uint8
    ids = torch.tensor([[0, 17, 47], [31, 16, 15]])
    assert torch.equal(int4_vnni.codes(packed, ids), q[ids].to(torch.uint8))
    s, z = int4_vnni.scales_zeros(packed, ids)
    assert torch.equal(s, sz[..., 0].t()[ids]) and torch.equal(z, sz[..., 1].t()[ids])
    # the documented byte order: channel 16b + c, column 32g + 8j + i (low) and + 4 (high) at byte 4c + i
    b, c, g, j, i = 1, 5, 2, 3, 1
    byte = packed[b, g, 64 * j + 4 * c + i].item()
    assert byte & 15 == q[16 * b + c, 32 * g + 8 * j + i] and byte >> 4 == q[16 * b + c, 32 * g + 8 * j + 4 + i]


@needs_vnni
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (2048, 1536), (1536, 8960), (896, 4864)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 21])
def test_product_equals_the_float_reference(n, k, m):
    q, sz = _codes(n, k, seed=n + k)
    x = _activations(m, k)
    y = int4_vnni.mm(x, int4_vnni.pack(q, sz))
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    want = x.float() @ dequantize_int4(q, sz).t()
    # int8 activations in groups of 32 (amax / 127) cost about 1% of max |y| with outlier channels
    assert (y.float() - want).abs().max() <= KERNEL_TOLERANCE * want.abs().max()


@needs_vnni
def test_rows_get_the_same_bits_alone_in_a_tree_and_in_any_order():
    q, sz = _codes(1536, 1536, seed=3)
    packed = int4_vnni.pack(q, sz)
    x = _activations(21, 1536, seed=4)
    full = int4_vnni.mm(x, packed)
    for i in range(21):  # alone: a 1-row tile
        assert torch.equal(int4_vnni.mm(x[i:i + 1].contiguous(), packed)[0], full[i])
    perm = torch.randperm(21, generator=torch.Generator().manual_seed(5))  # other tile neighbours
    assert torch.equal(int4_vnni.mm(x[perm].contiguous(), packed), full[perm])
    assert torch.equal(int4_vnni.mm(x[:13].contiguous(), packed), full[:13])  # a tile of 8 and one of 5


@needs_vnni
@pytest.mark.parametrize("n,k,m", [(384, 384, 1500), (1536, 384, 300), (384, 1536, 131)])
def test_many_rows_through_a_small_weight_take_chunks_with_the_same_bits(n, k, m):
    """A small weight times many rows (Whisper's encoder: 1500 frames through 384 x 384) runs the rows in chunks
    that stay in cache (``kChunkBytes`` of int8 activations, at most ``kChunkWeightBytes`` of weights); every row
    keeps its bits (alone, or as one of the first 8), float32 activations included, and the product equals the
    float reference. The shapes put chunk boundaries inside the rows (256, 256 and 64 rows a chunk)."""
    q, sz = _codes(n, k, seed=n * k + m)
    packed = int4_vnni.pack(q, sz)
    x = _activations(m, k, seed=m)
    full = int4_vnni.mm(x, packed)
    want = x.float() @ dequantize_int4(q, sz).t()
    assert (full.float() - want).abs().max() <= KERNEL_TOLERANCE * want.abs().max()
    picks = sorted({0, 7, 8, 55, 56, 63, 64, 255, 256, m // 2, m - 1} & set(range(m)))
    for i in picks:
        assert torch.equal(int4_vnni.mm(x[i:i + 1].contiguous(), packed)[0], full[i])
    assert torch.equal(int4_vnni.mm(x[:8].contiguous(), packed), full[:8])
    x32 = x.float()
    full32 = int4_vnni.mm(x32, packed)
    assert full32.dtype == torch.float32
    for i in picks:
        assert torch.equal(int4_vnni.mm(x32[i:i + 1].contiguous(), packed)[0], full32[i])


@needs_vnni
def test_empty_batch_and_shape_errors():
    q, sz = _codes(32, 64)
    packed = int4_vnni.pack(q, sz)
    assert int4_vnni.mm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        int4_vnni.mm(torch.zeros(2, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="contiguous bf16 or float32"):
        int4_vnni.mm(torch.zeros(2, 64, dtype=torch.float16), packed)
    with pytest.raises(RuntimeError, match="float32 product only"):
        int4_vnni.mm(torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(32))
    with pytest.raises(RuntimeError, match="bias must be"):
        int4_vnni.mm(torch.zeros(2, 64), packed, torch.zeros(31))
    # no input columns: a zero product (the row chunks divide by K only when there are columns)
    empty_k = int4_vnni.pack(torch.zeros(16, 0, dtype=torch.uint8), torch.zeros(0, 16, 2, dtype=torch.bfloat16))
    assert torch.equal(int4_vnni.mm(torch.zeros(3, 0), empty_k), torch.zeros(3, 16))


@needs_vnni
def test_float32_activations_read_as_their_bf16_rounding_and_give_the_accumulator():
    """A float32 ``x`` gives the same activation codes as ``x.to(bfloat16)`` (so the product rounded to bf16
    equals the bf16 call's bit for bit), a float32 result, the bias added in float32, and rows that do not depend
    on their neighbours."""
    q, sz = _codes(256, 1536, seed=6)
    packed = int4_vnni.pack(q, sz)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(7))  # not bf16-representable
    x[3, 40] = float("nan")
    y = int4_vnni.mm(x, packed)
    assert y.dtype == torch.float32 and y.shape == (13, 256)
    finite = [i for i in range(13) if i != 3]
    assert torch.equal(y[finite].bfloat16(), int4_vnni.mm(x.bfloat16(), packed)[finite])
    assert torch.isnan(y[3]).all()
    bias = torch.randn(256, generator=torch.Generator().manual_seed(8))
    assert torch.equal(int4_vnni.mm(x, packed, bias)[finite], (y + bias)[finite])
    for i in (0, 5, 12):
        assert torch.equal(int4_vnni.mm(x[i:i + 1].contiguous(), packed, bias)[0], (y + bias)[i])


@needs_vnni
def test_int4_linear_uses_the_kernel_and_its_embedding_rows_and_fusion():
    q, sz = _codes(64, 96, seed=9)
    layer = Int4Linear.from_codes(q, sz, None, 32, rows=True)
    assert layer.layout == "vnni" and layer.scales_and_zeros is None and layer.row_codes is None
    ids = torch.tensor([3, 63, 0])
    want = dequantize_int4(q, sz)
    assert torch.equal(layer.rows(ids).float(), want[ids].bfloat16().float())
    assert torch.equal(layer.dequantized(), want)
    other = Int4Linear.from_codes(*_codes(32, 96, seed=10), None, 32)
    fused = fuse_linears([layer, other])
    assert fused is not None and fused.layout == "vnni" and fused.out_features == 96
    x = _activations(5, 96)
    assert torch.equal(fused(x), torch.cat([layer(x), other(x)], -1))


def test_torch_choice_and_missing_cpu_flags_fall_back_to_pytorchs_kernel(monkeypatch):
    q, sz = _codes(64, 96, seed=11)
    monkeypatch.setenv("SPECSTREAM_INT4_KERNEL", "torch")
    layer = Int4Linear.from_codes(q, sz, None, 32)
    assert layer.layout == "torch" and layer.scales_and_zeros is not None
    assert int4_vnni.unavailable_reason() == "SPECSTREAM_INT4_KERNEL=torch"

    monkeypatch.setenv("SPECSTREAM_INT4_KERNEL", "auto")
    monkeypatch.setattr(int4_vnni, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    int4_vnni._load.cache_clear()
    try:
        reason = int4_vnni.unavailable_reason()
        assert reason is not None and "avx512_vnni" in reason and "avx2, fma for avx2" in reason
        assert Int4Linear.from_codes(q, sz, None, 32).layout == "torch"
        monkeypatch.setenv("SPECSTREAM_INT4_KERNEL", "vnni")
        with pytest.raises(int4_vnni.Int4KernelUnavailable, match="lacks .*avx2, fma for avx2"):
            Int4Linear.from_codes(q, sz, None, 32)
        monkeypatch.setenv("SPECSTREAM_INT4_KERNEL", "fast")
        with pytest.raises(ValueError, match="expected auto, vnni or torch"):
            int4_vnni.available()
    finally:
        int4_vnni._load.cache_clear()


@needs_vnni
def test_every_kernel_module_runs_on_torchs_threads_and_the_cpus_instruction_set():
    """ATen's ``at::parallel_for`` is OpenMP pragmas in its headers: a module built without ``-fopenmp`` ran each
    product, attention and layer on one core, half of what a 2-core CPU gives."""
    from specstream.kernels import decoder_layer, row_attention

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for module in (int4_vnni, row_attention, decoder_layer):
            ext = module._load()
            assert not isinstance(ext, str), ext
            assert ext.parallel_threads(64) == 2
            assert ext.isa == {"avx512-vnni": "avx512", "avx2": "avx2"}[int4_vnni.cpu_isa()]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(int4_vnni.cpu_isa() != "avx512-vnni", reason="only an AVX-512 VNNI CPU runs both builds")
def test_the_avx2_build_gives_the_avx512_builds_bits(monkeypatch):
    q, sz = _codes(2048, 1536, seed=5)
    packed = int4_vnni.pack(q, sz)
    x = _activations(13, 1536)
    x[3, 40] = float("nan")  # a NaN group stays NaN in both
    monkeypatch.setenv("SPECSTREAM_KERNEL_ISA", "avx2")
    # the AVX2 build of the module the engine loads (the one test_quant's AVX2-only CPU loads too: one build of
    # 30-40 s for both, where a module of the int4 product alone was a second)
    avx2 = int4_vnni.compile_extension("specstream_kernels", int4_vnni.MODULE_SOURCES, "C++ kernels")
    assert avx2.isa == "avx2"
    for rows in (1, 5, 13):
        assert torch.equal(avx2.int4_mm(x[:rows].contiguous(), packed, 0).view(torch.int16),
                           int4_vnni.mm(x[:rows].contiguous(), packed).view(torch.int16))


AVX512_VNNI = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma"})


@pytest.mark.parametrize("flags,env,isa", [
    (AVX512_VNNI, "auto", "avx512-vnni"),
    (AVX512_VNNI, "avx2", "avx2"),  # the AVX2 build on an AVX-512 CPU, when asked for
    (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}), "auto", "avx2"),  # no VNNI
    (frozenset({"avx2", "fma"}), "auto", "avx2"),  # AMD EPYC before Zen 4, Intel before Ice Lake: AVX2 only
    (frozenset({"avx2", "fma"}), "avx512-vnni", None),
    (frozenset({"avx", "sse4_2"}), "auto", None),
])
def test_the_kernels_instruction_set_is_the_best_the_cpu_has(monkeypatch, flags, env, isa):
    monkeypatch.setattr(int4_vnni.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(int4_vnni, "cpu_flags", lambda: flags)
    monkeypatch.setenv("SPECSTREAM_KERNEL_ISA", env)
    assert int4_vnni.cpu_isa() == isa
    assert (int4_vnni.cpu_reason() is None) == (isa is not None)
    if isa is None:
        assert int4_vnni.cpu_reason().startswith("the CPU lacks ")
    monkeypatch.setenv("SPECSTREAM_KERNEL_ISA", "sse")
    with pytest.raises(ValueError, match="SPECSTREAM_KERNEL_ISA='sse': expected auto, avx512-vnni, avx2"):
        int4_vnni.cpu_isa()
    monkeypatch.setattr(int4_vnni.platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("SPECSTREAM_KERNEL_ISA", "auto")
    assert int4_vnni.cpu_isa() is None and int4_vnni.cpu_reason() == "not an x86-64 CPU (aarch64)"


@needs_vnni
def test_both_kernels_agree_within_the_kernel_tolerance():
    q, sz = _codes(896, 4864, seed=12)
    x = _activations(4, 4864)
    vnni = int4_vnni.mm(x, int4_vnni.pack(q, sz)).float()
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32), 1), 32, sz).float()
    assert (vnni - ref).abs().max() <= KERNEL_TOLERANCE * ref.abs().max()
    assert not torch.equal(vnni, ref)  # two kernels, two sets of bits: a layer keeps one for every row count


@needs_vnni
def test_an_int4_target_runs_every_linear_on_the_kernel(tiny):
    """So the int4 exactness tests of test_quant.py (greedy speculative == plain, batched, 120 tokens) run
    through this kernel on this machine."""
    from specstream.stages.speculative.models.loader import load_decoder

    model = load_decoder(tiny.target, "int4")
    layouts = {m.layout for m in model.modules() if isinstance(m, Int4Linear)}
    assert layouts == {"vnni"}


def test_no_ids_give_empty_codes_and_scales():
    q, sz = _codes(32, 64)
    packed = int4_vnni.pack(q, sz)
    none = torch.zeros(0, dtype=torch.long)
    assert int4_vnni.codes(packed, none).shape == (0, 64)
    assert int4_vnni.scales_zeros(packed, none)[0].shape == (0, 2)


@needs_vnni
def test_a_nan_reaches_the_output_and_tiny_groups_count_as_zero():
    q, sz = _codes(32, 64, seed=13)
    packed = int4_vnni.pack(q, sz)
    x = _activations(3, 64)
    x[1, 5] = float("nan")
    x[2, 32:] = 1e-38  # amax far below 127 / FLT_MAX: the group's inverse scale would overflow
    y = int4_vnni.mm(x, packed).float()
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()
    want = x[2:, :32].float() @ dequantize_int4(q, sz)[:, :32].t()
    assert (y[2] - want[0]).abs().max() <= KERNEL_TOLERANCE * want.abs().max()


def test_a_killed_builds_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch, caplog):
    import fcntl
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - int4_vnni.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    # torch 2.14 locks with an OS advisory lock: a file left behind by a finished (or killed) build blocks nothing,
    # and deleting it could let two builds run at once; it stays, with no warning
    assert not int4_vnni.lock_file_blocks()
    with caplog.at_level("WARNING"):
        assert not int4_vnni.clear_stale_lock(tmp_path) and lock.exists()
    assert "stale" not in caplog.text
    # a PyTorch whose lock is the file's existence: a young file is a build running now, an old one a killed build's
    monkeypatch.setattr(int4_vnni, "lock_file_blocks", lambda: True)
    os.utime(lock, None)
    assert not int4_vnni.clear_stale_lock(tmp_path) and lock.exists()
    os.utime(lock, (old, old))
    with open(lock) as held:  # ... unless a live process holds a lock on it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert not int4_vnni.clear_stale_lock(tmp_path) and lock.exists()
    assert int4_vnni.clear_stale_lock(tmp_path) and not lock.exists()
    assert not int4_vnni.clear_stale_lock(tmp_path)  # nothing there


@needs_vnni
def test_prefetch_distances_give_the_same_bits_and_the_choice_is_timed_or_set(monkeypatch):
    """Both software prefetch distances the kernel is built with give the same result, bit for bit, at 1 and 21
    rows; the process's distance is the environment's when set (a bad value is refused by name), and otherwise
    the faster of the two by :func:`time_prefetch`, which times each."""
    q, sz = _codes(1024, 1536, seed=7)
    packed = int4_vnni.pack(q, sz)
    ext = int4_vnni._load()
    for m in (1, 21):
        x = _activations(m, 1536, seed=8)
        assert torch.equal(ext.int4_mm(x, packed, 0), ext.int4_mm(x, packed, 8))
    with pytest.raises(RuntimeError, match="prefetch must be 0 or 8"):
        ext.int4_mm(_activations(1, 1536), packed, 3)
    times = int4_vnni.time_prefetch(channels=1024, copies=2, rounds=2)
    assert set(times) == set(int4_vnni.PREFETCH_DISTANCES) and all(0 < t < 10 for t in times.values())
    assert set(int4_vnni.time_prefetch(channels=1024, copies=2, rounds=1, rows=5)) == set(times)
    for env, want in (("0", 0), ("8", 8)):
        monkeypatch.setenv("SPECSTREAM_INT4_PREFETCH", env)
        int4_vnni.reset_prefetch_choice()
        assert int4_vnni.prefetch_distance(1) == want and int4_vnni.prefetch_distance(21) == want
    monkeypatch.setenv("SPECSTREAM_INT4_PREFETCH", "4")
    int4_vnni.reset_prefetch_choice()
    with pytest.raises(ValueError, match="SPECSTREAM_INT4_PREFETCH='4'"):
        int4_vnni.prefetch_distance()
    # auto: one row and many rows each take the faster distance at their own row count
    monkeypatch.setenv("SPECSTREAM_INT4_PREFETCH", "auto")
    timed = []

    def fake(rows=1, **_):
        timed.append(rows)
        return {0: 0.5, 8: 0.7} if rows == 1 else {0: 0.9, 8: 0.6}

    monkeypatch.setattr(int4_vnni, "time_prefetch", fake)
    int4_vnni.reset_prefetch_choice()
    assert [int4_vnni.prefetch_distance(m) for m in (1, 2, 3, 5, 21, 1)] == [0, 0, 8, 8, 8, 0]
    assert timed == [1, 5]  # each class timed once
    int4_vnni.reset_prefetch_choice()