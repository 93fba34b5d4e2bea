"""Linear layers with weights pre-packed once for oneDNN on the CPU.

Token-tree verification multiplies every weight matrix by a handful of rows (a tree of 5-21 nodes, a batch of a
few requests). PyTorch's default CPU path for ``F.linear`` in float32 repacks the whole weight matrix on every
call, so a 5-row product costs several times a 1-row one, which is what speculative decoding cannot afford
(measured on this project's 2-core AMD EPYC machine, one thread, a 4864x896 weight: 2.2 ms for 5 rows with
``F.linear``, 0.63 ms pre-packed; 4.4 ms vs 1.4 ms for 21 rows). oneDNN's pre-packed weights (the layout
PyTorch's own CPU compiler uses when it freezes a model, ``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``) remove the repacking. Results equal ``F.linear`` up to float rounding (a different
summation order).

:func:`pack_linears` swaps every ``nn.Linear`` of a CPU module for :class:`PackedLinear` after checking, on a
probe input, that the packed product agrees with ``F.linear``; it leaves the module unchanged on other devices,
when oneDNN is missing, or when ``SPECSTREAM_PACKED_LINEAR=0``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

#: rows the packed layout is tuned for (tree nodes x requests of a typical verification step)
BATCH_HINT = 32


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when weights of ``dtype`` on ``device`` can be pre-packed for oneDNN."""
    if os.environ.get("SPECSTREAM_PACKED_LINEAR", "1") == "0":
        return False
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype is torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` pre-packed for oneDNN (inference only).

    Args:
        linear: the layer to pack; its weight is copied into the packed layout (the original can be freed).

    Shapes: ``x`` ``[..., in_features]`` -> ``[..., out_features]``, in the weight's dtype.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
            self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``module`` (CPU, float32/bfloat16) by a :class:`PackedLinear`.

    Each layer is checked on a probe input against ``F.linear`` (relative error below 1e-4 in float32, 2e-2 in
    bfloat16) and kept unpacked otherwise. Returns the number of layers packed.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            w = child.weight
            if not packing_available(w.device, w.dtype):
                continue
            packed = PackedLinear(child)
            probe = torch.randn(3, child.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
            with torch.no_grad():
                want = F.linear(probe, w, child.bias).float()
                got = packed(probe).float()
            tol = 1e-4 if w.dtype == torch.float32 else 2e-2
            if (got - want).abs().max() <= tol * want.abs().max().clamp_min(1e-6):
                setattr(module, name, packed)
                count += 1
        else:
            count += pack_linears(child)
    return count
