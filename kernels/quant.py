"""Weight-only quantized linear layers and embeddings on PyTorch's own packed kernels.

Decoding one token reads every weight once, so on a CPU its time is the weight bytes over the memory bandwidth.
These layers keep weights in 8 or 4 bits and compute with bfloat16 activations (a float32 input is rounded to
bfloat16 for the product and the output given back in float32, for models that keep float32 activations on a CPU
without bfloat16 arithmetic):

- **int8**: symmetric, one scale per output channel (``w = q * s``, ``q`` in [-127, 127]), multiplied by
  ``torch._weight_int8pack_mm`` (weights stay in the plain ``[N, K]`` int8 layout).
- **int4**: asymmetric groups of ``group_size`` (32 or 64) input columns per output channel. The convention is
  the one of PyTorch's int4 kernels (as used by gpt-fast and torchao): ``w = (q - 8) * scale + zero`` with
  ``q`` in [0, 15] and ``scales_and_zeros`` a bfloat16 ``[K / group_size, N, 2]`` tensor. On the CPU the weights
  are packed by ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and multiplied by
  ``_weight_int4pack_mm_for_cpu``; on CUDA by ``_convert_weight_to_int4pack`` / ``_weight_int4pack_mm``.

An embedding table quantized this way is also the tied ``lm_head``: :class:`QuantEmbedding` gathers and
de-quantizes only the looked-up rows from the same buffers the linear layer multiplies with (one copy of the
table). For int4 the packed layout is opaque, so the position of every nibble is found once by packing probe
matrices (:func:`int4_nibble_map`) and checked against the original codes when the layer is built.

Every quantized layer checks itself when it is built: its product on a probe input must equal the float
reference (:func:`dequantize`'s weights, float32 product) within :data:`KERNEL_TOLERANCE` of the output's
magnitude, else :class:`QuantKernelError` is raised (never a silent wrong result).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: relative tolerance (of the largest |output|) between a quantized kernel and its float32 reference on the
#: same quantized weights: bfloat16 activations and output round at 2^-8
KERNEL_TOLERANCE = 1.5e-2
#: rows of one int4 CPU packing block (the CPU packed layout interleaves the rows of 64-row blocks)
_INT4_BLOCK_ROWS = 64


class QuantKernelError(RuntimeError):
    """A packed kernel disagrees with its float reference, or a layout assumption does not hold."""


@dataclass(frozen=True)
class WeightFormat:
    """A weight precision: ``name`` (float32, bfloat16, int8, int4), ``group_size`` (int4 only)."""

    name: str
    group_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "int4")

    @property
    def activation_dtype(self) -> torch.dtype:
        """Dtype of activations and the KV cache: float32 for float32 weights, bfloat16 otherwise."""
        return torch.float32 if self.name == "float32" else torch.bfloat16

    @property
    def label(self) -> str:
        return self.name if self.name != "int4" or self.group_size == 32 else f"int4-g{self.group_size}"

    def bits_per_weight(self) -> float:
        """Bytes read per weight x 8, scales included (int4: bf16 scale and zero per group)."""
        return {"float32": 32.0, "bfloat16": 16.0, "int8": 8.0 + 16.0 / 4096}.get(
            self.name, 4.0 + 32.0 / max(self.group_size, 1))


#: the precision names accepted by ``--dtype`` (int4 is int4-g32)
WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "int4", "int4-g64")


def parse_weight_format(name: str) -> WeightFormat:
    """``float32``, ``bfloat16``, ``int8``, ``int4`` (groups of 32) or ``int4-gN`` (N in 32, 64, 128).

    Raises:
        ValueError: any other name (the message lists :data:`WEIGHT_DTYPES`).
    """
    text = str(name).strip().lower()
    if text in ("float32", "bfloat16", "int8"):
        return WeightFormat(text)
    if text == "int4":
        return WeightFormat("int4", 32)
    if text.startswith("int4-g") and text[6:] in ("32", "64", "128"):
        return WeightFormat("int4", int(text[6:]))
    raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(WEIGHT_DTYPES)}")


def _probe(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


_AVAILABLE: dict[tuple[str, str], bool] = {}


def kernel_available(fmt: WeightFormat, device: torch.device | str) -> bool:
    """True when ``device`` can run weights of ``fmt``: bfloat16 a working bf16 product (CUDA:
    ``is_bf16_supported``), int8/int4 a working packed kernel (probed once on a tiny matrix).

    On a CPU without native bf16 instructions (AVX2 only: no avx512_bf16 or AMX) PyTorch's bf16 and packed
    int8/int4 kernels still run, converting in software: they are available, only slower per row than on a CPU
    with them (:func:`native_bf16` tells which)."""
    dev = torch.device(device)
    key = (fmt.label, str(dev))
    if key in _AVAILABLE:
        return _AVAILABLE[key]
    if fmt.name == "float32":
        ok = True
    elif dev.type == "cpu":
        ok = _probe(lambda: torch.zeros(2, 8, dtype=torch.bfloat16) @ torch.zeros(8, 4, dtype=torch.bfloat16))
    elif dev.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        ok = False
    if ok and fmt.quantized:
        w = torch.zeros(64, 128, device=dev)
        x = torch.zeros(1, 128, dtype=torch.bfloat16, device=dev)
        if fmt.name == "int8":
            ok = _probe(lambda: Int8Linear.from_float(w, None, check=False)(x))
        else:
            ok = _probe(lambda: Int4Linear.from_float(w, None, fmt.group_size, check=False)(x))
    _AVAILABLE[key] = ok
    return ok


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True when ``device`` has bfloat16 arithmetic in hardware (CPU: oneDNN's check for avx512_bf16/AMX)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def available_weight_dtypes(device: torch.device | str) -> list[str]:
    """The names of :data:`WEIGHT_DTYPES` that ``device`` can run."""
    return [n for n in WEIGHT_DTYPES if kernel_available(parse_weight_format(n), device)]


# --- quantization (torch reference) ---------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``weight`` ``[N, K]`` -> ``(q [N, K] int8, scales [N] bfloat16)`` with
    ``weight ~= q * scales[:, None]`` (scales rounded to bfloat16 before rounding the codes)."""
    w = weight.float()
    scales = (w.abs().amax(1) / 127.0).clamp_min(1e-10).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` columns: ``weight`` ``[N, K]`` -> ``(q [N, K] uint8 in
    [0, 15], scales_and_zeros [K / group_size, N, 2] bfloat16)`` with ``weight ~= (q - 8) * scale + zero`` (the
    convention of PyTorch's int4 kernels; scale = (max - min) / 15 and zero = min + 8 * scale per group).

    Raises:
        ValueError: ``K`` is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4: {k} input columns are not a multiple of the group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-10).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    return _codes_int4(w, scale, zero), torch.stack([scale.t(), zero.t()], -1).contiguous()


def _codes_int4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes of ``w`` ``[N, G, g]`` for bf16 ``scale``/``zero`` ``[N, G]``, rounded to the nearest level."""
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = torch.round((w - z) / s + 8.0).clamp_(0, 15)
    return q.to(torch.uint8).reshape(w.shape[0], -1)


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of int4 codes ``q`` ``[N, K]`` (0..15) and ``scales_and_zeros``
    ``[K / g, N, 2]``: the reference the int4 kernel is checked against."""
    n, k = q.shape
    groups = scales_and_zeros.shape[0]
    s = scales_and_zeros[..., 0].float().t().repeat_interleave(k // groups, 1)
    z = scales_and_zeros[..., 1].float().t().repeat_interleave(k // groups, 1)
    return (q.float() - 8.0) * s + z


#: output rows of the float reference made at a time by :func:`check_kernel` (4096 x 1536 float32: 25 MB)
CHECK_ROWS = 4096


def check_kernel(layer: nn.Module, reference: torch.Tensor | Callable[[int, int], torch.Tensor],
                 bias: torch.Tensor | None) -> None:
    """Raise :class:`QuantKernelError` unless ``layer`` on a bf16 probe ``[3, K]`` equals the float32 product
    with ``reference`` ``[N, K]`` within :data:`KERNEL_TOLERANCE` of the output's magnitude. ``reference`` may be
    a function ``(start, stop) -> rows [stop - start, K]`` of the float weights: the product is then made
    :data:`CHECK_ROWS` output rows at a time, so checking the 151,936 x 1,536 embedding of a Qwen2.5 model never
    holds its 0.93 GB float copy (and the temporaries of making it, about 5 GB, were the load's peak memory)."""
    rows = reference if callable(reference) else (lambda a, b: reference[a:b])
    n, k = layer.out_features, layer.in_features
    gen = torch.Generator().manual_seed(0)
    device = next(layer.buffers(), torch.empty(0)).device  # the packed layers hold their weights as buffers
    probe = torch.randn(3, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    want = torch.cat([F.linear(probe.float(), rows(a, min(a + CHECK_ROWS, n)),
                               None if bias is None else bias[a:a + CHECK_ROWS].float())
                      for a in range(0, n, CHECK_ROWS)], dim=-1)
    # bf16 activations, and float32 ones where they take their own path (this project's int4 kernel)
    probes = (probe, probe.float()) if getattr(layer, "layout", None) == "vnni" else (probe,)
    for got in (layer(p).float() for p in probes):
        err = (got - want).abs().max().item()
        if not err <= KERNEL_TOLERANCE * want.abs().max().clamp_min(1e-6).item():
            raise QuantKernelError(f"{type(layer).__name__} {(n, k)}: packed kernel differs from the "
                                   f"float reference by {err:.3g} (tolerance {KERNEL_TOLERANCE} of max |y|)")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a quantized layer returns for input ``x``: float32 for float32 activations (a model that keeps
    its activations in float32 around quantized weights, on a CPU without bfloat16 arithmetic), else bfloat16."""
    return torch.float32 if x.dtype == torch.float32 else torch.bfloat16


class Int8Linear(nn.Module):
    """``y = x (q * s)^T + b`` with int8 per-channel weights (inference only).

    Shapes: ``x`` ``[..., in_features]`` (cast to bfloat16) -> ``[..., out_features]`` bfloat16 (float32 for a
    float32 ``x``).
    Buffers: ``qweight`` ``[N, K]`` int8, ``scales`` ``[N]`` bfloat16, ``bias`` ``[N]`` bfloat16 or None.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, check: bool = True) -> "Int8Linear":
        """Quantize a float ``weight`` ``[N, K]`` (and ``bias`` ``[N]``); ``check``: compare with the float
        reference on a probe (:class:`QuantKernelError` when it differs)."""
        q, s = quantize_int8(weight)
        layer = cls(q, s, bias)
        if check:
            check_kernel(layer, lambda a, b: q[a:b].float() * s[a:b].float()[:, None], bias)
        return layer

    def dequantized(self) -> torch.Tensor:
        """The float32 weights ``[N, K]`` this layer multiplies with."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous(),
                                      self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(_out_dtype(x))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the de-quantized weight, bfloat16 ``[*ids.shape, K]``."""
        return (self.qweight[ids].float() * self.scales[ids].float()[..., None]).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack codes ``q`` ``[N, K]`` (0..15) in the device's int4 kernel layout."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # CUDA: [N, K/2] uint8, even column in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(pairs, 8)


_NIBBLE_MAPS: dict[tuple[int, str], torch.Tensor] = {}


def int4_nibble_map(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Where each code of a 64-row block lands in the CPU packed layout: ``[64, K]`` int64 nibble index into
    the block's packed bytes (byte = index // 2, high nibble when odd). Found by packing probe matrices whose
    codes spell each position in base 16 (5 packings for K <= 16384); the layout is PyTorch's, not ours."""
    key = (k, str(device))
    if key not in _NIBBLE_MAPS:
        n = _INT4_BLOCK_ROWS
        index = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
        where = torch.zeros(n * k, dtype=torch.int64)
        digits = max(1, math.ceil(math.log(n * k, 16)))
        for d in range(digits):
            codes = (index >> (4 * d)) & 15
            packed = _pack_int4(codes.to(torch.uint8)).reshape(-1).cpu()
            nibbles = torch.stack([packed & 15, packed >> 4], -1).reshape(-1).to(torch.int64)
            where |= nibbles << (4 * d)
        # where[nibble position] = original index -> invert
        inverse = torch.empty_like(where)
        inverse[where] = torch.arange(n * k)
        _NIBBLE_MAPS[key] = inverse.reshape(n, k).to(device)
    return _NIBBLE_MAPS[key]


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with int4 weights in asymmetric groups (inference only).

    Shapes: ``x`` ``[..., in_features]`` (cast to bfloat16) -> ``[..., out_features]`` bfloat16 (float32 for a
    float32 ``x``).
    Buffers: ``packed`` (the kernel's layout), ``scales_and_zeros`` ``[K / g, N', 2]`` bfloat16 (None in the
    ``vnni`` layout, which holds them itself), ``bias`` ``[N]``; ``N'`` (:attr:`packed_out_features`) is ``N``
    rounded up to 16 with zero channels, cut from every product.
    ``layout`` is ``"vnni"`` (this project's int4 kernel, AVX-512 VNNI or AVX2, :mod:`specstream.kernels.int4_vnni`,
    chosen when it is available and the shape fits) or ``"torch"`` (PyTorch's packed kernel).
    ``rows`` (embedding lookups) works on the ``vnni`` layout and on the CPU ``torch`` layout with ``N`` a
    multiple of 64; other layers keep a separate row-major nibble copy only when used as an embedding
    (:meth:`enable_rows`).
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor | None, bias: torch.Tensor | None,
                 in_features: int, out_features: int, group_size: int, layout: str = "torch",
                 packed_out_features: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        #: output channels the packed weight holds: ``out_features`` rounded up to the kernels' 16 (the extra
        #: channels are zero and cut from every product)
        self.packed_out_features = packed_out_features or out_features
        self.layout = layout
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))
        self.register_buffer("row_codes", None)  # [N, K/2] uint8, only where the packed layout cannot be gathered
        self._bias32: tuple[tuple, torch.Tensor] | None = None  # (the bias it was made from, float32 padded copy)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                   group_size: int, check: bool = True, rows: bool = False) -> "Int4Linear":
        """Pack codes ``q`` ``[N, K]`` (0..15) with their ``scales_and_zeros``; ``rows``: prepare embedding
        lookups (checked against ``q``). Both kernels take output channels in blocks of 16: an ``N`` that is
        not a multiple of 16 (Whisper's 51,864-token vocabulary) is packed with zero channels up to the next one,
        which every product cuts off again."""
        from specstream.kernels import int4_vnni

        n, k = q.shape
        pad = -n % INT4_OUT_BLOCK
        if pad:  # zero scale and zero: the extra channels are exactly 0
            q = torch.cat([q, q.new_zeros(pad, k)])
            scales_and_zeros = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(
                scales_and_zeros.shape[0], pad, 2)], 1)
        if int4_vnni.supports(n + pad, k, group_size, q.device):
            layer = cls(int4_vnni.pack(q, scales_and_zeros), None, bias, k, n, group_size, layout="vnni",
                        packed_out_features=n + pad)
        else:
            layer = cls(_pack_int4(q), scales_and_zeros.contiguous(), bias, k, n, group_size,
                        packed_out_features=n + pad)
        q, scales_and_zeros = q[:n], scales_and_zeros[:, :n]
        if check:
            check_kernel(layer, lambda a, b: dequantize_int4(q[a:b], scales_and_zeros[:, a:b]), bias)
        if rows:
            layer.enable_rows(q)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = 32,
                   check: bool = True, rows: bool = False) -> "Int4Linear":
        """Quantize a float ``weight`` ``[N, K]`` (:func:`quantize_int4`) and pack it."""
        q, sz = quantize_int4(weight, group_size)
        return cls.from_codes(q, sz, bias, group_size, check, rows)

    def enable_rows(self, q: torch.Tensor) -> None:
        """Make :meth:`rows` work: gather from the packed bytes when the layout allows (checked on three
        blocks against the codes ``q``), else keep a row-major nibble copy."""
        n, k = q.shape
        if self.layout == "vnni":
            picks = torch.tensor(sorted({0, n // 2, n - 1}))
            if not torch.equal(self._codes(picks), q[picks].to(torch.uint8)):
                raise QuantKernelError(f"Int4Linear {tuple(q.shape)}: the vnni layout does not give back its codes")
            return
        if self.packed.device.type == "cpu" and n % _INT4_BLOCK_ROWS == 0:
            self.row_codes = None
            picks = sorted({0, n // 2, n - 1})
            ids = torch.tensor(picks, device=q.device)
            if torch.equal(self._codes(ids).to(q.device), q[ids]):
                return
        self.row_codes = (q[:, ::2] | q[:, 1::2] << 4).to(torch.uint8).contiguous()

    def _codes(self, ids: torch.Tensor) -> torch.Tensor:
        """Codes ``[*ids.shape, K]`` uint8 of rows ``ids``."""
        k = self.in_features
        if self.layout == "vnni":
            from specstream.kernels import int4_vnni

            return int4_vnni.codes(self.packed, ids)
        if self.row_codes is not None:
            b = self.row_codes[ids]
            return torch.stack([b & 15, b >> 4], -1).reshape(*ids.shape, k)
        where = int4_nibble_map(k, self.packed.device)[ids % _INT4_BLOCK_ROWS]  # [..., K]
        where = where + (ids // _INT4_BLOCK_ROWS)[..., None] * (_INT4_BLOCK_ROWS * k)
        flat = self.packed.reshape(-1)
        b = flat[where >> 1]
        return torch.where((where & 1).bool(), b >> 4, b & 15)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights ``[N, K]`` this layer multiplies with: exact from the codes when rows can be
        gathered (:meth:`enable_rows`, or N % 64 == 0 on the CPU), else the kernel's product with the identity
        (each weight rounded to bfloat16)."""
        if self.layout == "vnni":
            ids = torch.arange(self.out_features)
            s, z = self._scales_zeros(ids)
            g = self.group_size
            return (self._codes(ids).float() - 8.0) * s.float().repeat_interleave(g, -1) + \
                z.float().repeat_interleave(g, -1)
        if self.row_codes is None and (self.out_features % _INT4_BLOCK_ROWS or self.packed.device.type != "cpu"):
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            bias = self.bias
            self.bias = None
            try:
                return self(eye).float().t().contiguous()
            finally:
                self.bias = bias
        q = self._codes(torch.arange(self.out_features, device=self.packed.device))
        return dequantize_int4(q, self.scales_and_zeros[:, :self.out_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        from specstream.kernels import int4_vnni

        x2 = x.reshape(-1, self.in_features).contiguous()
        bias = self.bias
        if self.layout == "vnni" and x.dtype == torch.float32:
            # float32 activations: the kernel reads them (rounded to bf16 as it goes), adds the bias and gives
            # float32 back in one call, instead of a conversion, a bias add and a conversion around it
            y, bias = int4_vnni.mm(x2, self.packed, self._bias_f32()), None
        elif self.layout == "vnni":
            y = int4_vnni.mm(x2.to(torch.bfloat16), self.packed)
        elif self.packed.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, self.group_size,
                                                           self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), self.packed, self.group_size,
                                                   self.scales_and_zeros)
        if self.packed_out_features != self.out_features:
            y = y[:, :self.out_features]
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features).to(_out_dtype(x))

    def _bias_f32(self) -> torch.Tensor | None:
        """The bias as the kernel adds it to a float32 product: float32, padded to the packed channels. Made
        from :attr:`bias` again whenever that tensor was replaced, written to or moved (a new bias registered
        after construction, ``load_state_dict``), so it never goes stale; not a buffer, so a dtype cast of the
        module leaves it float32."""
        b = self.bias
        if b is None:
            return None
        key = (b.data_ptr(), b._version, b.device, b.dtype)
        if self._bias32 is None or self._bias32[0] != key:
            padded = torch.zeros(self.packed_out_features, dtype=torch.float32, device=b.device)
            padded[:self.out_features] = b.float()
            self._bias32 = (key, padded)
        return self._bias32[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the de-quantized weight, bfloat16 ``[*ids.shape, K]``."""
        q = self._codes(ids).float()
        g = self.group_size
        s, z = self._scales_zeros(ids)
        return ((q - 8.0) * s.float().repeat_interleave(g, -1) + z.float().repeat_interleave(g, -1)).to(
            torch.bfloat16)

    def _scales_zeros(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and zeros ``[*ids.shape, K / g]`` bfloat16 of output channels ``ids``."""
        if self.layout == "vnni":
            from specstream.kernels import int4_vnni

            return int4_vnni.scales_zeros(self.packed, ids)
        sz = self.scales_and_zeros[:, ids]  # [G, *ids, 2]
        return sz[..., 0].movedim(0, -1), sz[..., 1].movedim(0, -1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of "
                f"{self.group_size}, layout={self.layout}")


class Int4ResidualLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int4 codes plus int4 codes of their rounding error: two-term
    residual quantization, ``W ~ W1 + R`` where ``W1`` is ``W``'s int4 quantization (:func:`quantize_int4`)
    and ``R`` that of ``W - W1``, each in asymmetric groups of ``group_size``. The error left is about 1/16 of
    int4's (about 8 bits of precision per weight), at twice int4's bytes: 10 bits a weight with the bfloat16
    scale and zero of every group of 32, against int8's 8.

    For the output projection of a small model quantized to int4, where the logits decide every token: llama.cpp's
    Q4_K_M keeps its output tensor at 6 bits for the same reason. Measured on Whisper tiny.en (``docs/models.md``):
    an int4 output projection raised the word error rate of the espeak-ng script from 0.095 (float32) to 0.155;
    with this layer it is 0.083. One row of its 51,864 x 384 product took 1.5 ms against int4's 0.66 ms and
    PyTorch's int8 kernel's 3.1 ms (microbenchmark, one core of the AVX2-only AMD EPYC Zen 3 of
    ``docs/benchmarks.md``, 2026-12-07; read bandwidth not measured in it, 21.8 GB/s in the offline run beside it).

    Both terms are one :class:`Int4Linear` over the stacked ``[W; R]`` (one pass over the activations, one
    kernel call), and the halves of its output are added in float32. On this project's int4 kernel (the ``vnni``
    layout) the halves are float32 accumulators; on PyTorch's kernels (CUDA, groups of 64, CPUs without AVX2)
    each half is rounded to bfloat16 first, which leaves about 2^-9 of each half's magnitude (measured there: 0.29
    largest logit error against 4.3 for plain int4, on random weights with logits up to 51). A bias is split the
    same way: its bfloat16 rounding in the first half, the rest in the second.

    Shapes: ``x`` ``[..., in_features]`` (any float dtype; the product reads it as float32, rounded to bfloat16
    inside the kernel) -> ``[..., out_features]`` float32, whatever the input dtype: a bfloat16 output would
    round away the residual's precision.
    """

    def __init__(self, stacked: Int4Linear, out_features: int):
        """Raises ValueError unless ``stacked`` has ``2 * out_features`` outputs."""
        super().__init__()
        if stacked.out_features != 2 * out_features:
            raise ValueError(f"the stacked layer has {stacked.out_features} outputs, not 2 x {out_features}")
        self.stacked = stacked
        self.in_features, self.out_features, self.group_size = stacked.in_features, out_features, stacked.group_size

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = 32,
                   check: bool = True) -> "Int4ResidualLinear":
        """Quantize ``weight`` ``[N, K]`` (float) and its int4 rounding error; ``bias`` ``[N]`` or None.

        Raises:
            ValueError: ``K`` is not a multiple of ``group_size``.
            QuantKernelError: the packed kernel disagrees with its float reference (``check``).
        """
        w = weight.detach().float()
        q1, sz1 = quantize_int4(w, group_size)
        q2, sz2 = quantize_int4(w - dequantize_int4(q1, sz1), group_size)
        b = None
        if bias is not None:  # the stacked layer keeps a bfloat16 bias: the rounding's remainder goes in the 2nd half
            hi = bias.detach().float().bfloat16().float()
            b = torch.cat([hi, bias.detach().float() - hi])
        stacked = Int4Linear.from_codes(torch.cat([q1, q2]), torch.cat([sz1, sz2], 1), b, group_size, check)
        return cls(stacked, w.shape[0])

    def dequantized(self) -> torch.Tensor:
        """The float32 weights ``[N, K]`` the layer multiplies with (``W1 + R``)."""
        both = self.stacked.dequantized()
        return both[: self.out_features] + both[self.out_features:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stacked(x.float())
        return y[..., : self.out_features] + y[..., self.out_features:]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 + int4 residual, "
                f"groups of {self.group_size}")


class QuantEmbedding(nn.Module):
    """Embedding lookup from a quantized weight table: only the gathered rows are de-quantized.

    ``table`` is an :class:`Int8Linear` or :class:`Int4Linear` of shape ``[vocab, hidden]``: the tied
    ``lm_head`` itself when the model ties them (one copy of the table).
    Shapes: ``ids`` ``[...]`` -> ``[..., hidden]`` bfloat16.
    """

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


def quantize_linear(linear: nn.Linear, fmt: WeightFormat, rows: bool = False) -> nn.Module:
    """The quantized replacement of ``linear`` (its weight read once, float32 or bfloat16)."""
    w = linear.weight.detach()
    b = None if linear.bias is None else linear.bias.detach()
    return quantize_weight(w, b, fmt, rows)


#: output channels the int4 kernels (this project's and PyTorch's) pack at a time
INT4_OUT_BLOCK = 16


def int4_packable(out_features: int, in_features: int, group_size: int) -> bool:
    """True when a ``[out_features, in_features]`` weight packs as int4 in groups of ``group_size``: ``K`` a
    multiple of the group (any ``N``: :meth:`Int4Linear.from_codes` pads the output channels)."""
    return in_features % group_size == 0


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None, fmt: WeightFormat,
                    rows: bool = False) -> nn.Module:
    """A quantized linear layer of ``weight`` ``[N, K]`` (float) in ``fmt`` (int8 or int4), checked.
    An int4 weight the kernel cannot pack (:func:`int4_packable`: ``K`` not a multiple of the group) becomes int8
    (the caller logs it)."""
    if fmt.name == "int4" and not int4_packable(*weight.shape, fmt.group_size):
        return Int8Linear.from_float(weight, bias)
    if fmt.name == "int8":
        return Int8Linear.from_float(weight, bias)
    if fmt.name == "int4":
        return Int4Linear.from_float(weight, bias, fmt.group_size, rows=rows)
    raise ValueError(f"{fmt.label} is not a quantized format")


def quantize_linears(module: nn.Module, fmt: WeightFormat | str, skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by its quantized layer (int8 or int4), in place.

    Generic over decoders (Llama family, Whisper's decoder and encoder): bfloat16 activations give bfloat16
    outputs, float32 ones float32 (the product reads them rounded to bfloat16), so the caller keeps the module's
    other parameters in its activation dtype.
    Layers the int4 kernel cannot pack (``in_features`` not a multiple of the group size) stay unquantized
    (counted out).
    ``skip``: attribute names left alone (e.g. ``("lm_head",)`` when handled with the embedding).
    Returns the number of layers quantized.

    Raises:
        QuantKernelError: a packed kernel disagrees with its float reference.
    """
    fmt = parse_weight_format(fmt) if isinstance(fmt, str) else fmt
    count = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            if fmt.name == "int4" and not int4_packable(child.out_features, child.in_features, fmt.group_size):
                continue
            setattr(module, name, quantize_linear(child, fmt))
            count += 1
        else:
            count += quantize_linears(child, fmt, skip)
    return count


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One quantized layer whose output is the concatenation of ``layers``' outputs (``q``/``k``/``v`` or
    ``gate``/``up`` projections of one input): one packed product, one pass over the activations, one bias add.

    Int8: the ``[N, K]`` weights and scales are concatenated. Int4 in the ``vnni`` layout: its blocks of 16
    channels concatenate. Int4 in PyTorch's CPU layout: the packed layout holds 64-row
    blocks one after another (:func:`int4_nibble_map`), so for output sizes that are multiples of 64 the packed
    bytes concatenate along the rows, and ``scales_and_zeros`` along its ``N`` dimension. The fused layer must
    reproduce the separate layers bit for bit on a probe input, else None is returned (the caller keeps them).
    None also when the layers are not all of one kind (an int4 fallback to int8, different group sizes, a
    layout that does not concatenate) or one is padded (:attr:`Int4Linear.packed_out_features`). A layer without a
    bias beside layers with one gets zeros (Whisper's key projection), which add nothing.
    """
    if len(layers) < 2 or len({type(l) for l in layers}) != 1 or len({l.in_features for l in layers}) != 1:
        return None
    if any(getattr(l, "packed_out_features", l.out_features) != l.out_features for l in layers):
        return None  # padded channels would land between the layers' outputs
    # a layer without a bias beside ones with it (Whisper's key projection) adds zeros: the same bits
    biases = [l.bias for l in layers if l.bias is not None]
    bias = torch.cat([l.bias if l.bias is not None else biases[0].new_zeros(l.out_features)
                      for l in layers]) if biases else None
    first = layers[0]
    if isinstance(first, Int8Linear):
        fused = Int8Linear(torch.cat([l.qweight for l in layers]), torch.cat([l.scales for l in layers]), bias)
    elif isinstance(first, Int4Linear) and all(l.layout == "vnni" for l in layers):
        if len({l.group_size for l in layers}) != 1:
            return None
        fused = Int4Linear(torch.cat([l.packed for l in layers]), None, bias, first.in_features,
                           sum(l.out_features for l in layers), first.group_size, layout="vnni")
    elif isinstance(first, Int4Linear) and all(l.layout == "torch" for l in layers):
        if (first.packed.device.type != "cpu" or len({l.group_size for l in layers}) != 1
                or any(l.out_features % _INT4_BLOCK_ROWS or l.packed.shape[0] != l.out_features
                       or l.row_codes is not None for l in layers)):
            return None
        fused = Int4Linear(torch.cat([l.packed for l in layers]),
                           torch.cat([l.scales_and_zeros for l in layers], 1).contiguous(), bias,
                           first.in_features, sum(l.out_features for l in layers), first.group_size)
    else:
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(3, first.in_features, generator=gen).to(device=first.qweight.device if isinstance(
        first, Int8Linear) else first.packed.device, dtype=torch.bfloat16)
    if not torch.equal(fused(probe), torch.cat([l(probe) for l in layers], -1)):
        return None
    return fused


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (each shared tensor counted once): what one forward
    reads at most."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
