"""Weight precisions by name: float dtypes (:func:`parse_dtype`) and the load formats (:func:`weight_format`).

Read by the checkpoint loader (:mod:`~specstream.stages.speculative.models.loader`) and the Whisper decoder
(:mod:`~specstream.stages.speculative.models.whisper`), which the loader dispatches to: kept apart so that neither
imports the other back.
"""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a float precision name (float32, bfloat16, float16)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def weight_format(name: str | torch.dtype, device: str | torch.device = "cpu"):
    """Parse and check a weight precision (``--dtype``): float32, bfloat16, int8, int4 (groups of 32) or
    int4-g64, as a :class:`~specstream.kernels.quant.WeightFormat`.

    Raises:
        UnsupportedDtypeError: an unknown name, or one ``device`` cannot run (no packed kernel, no bfloat16
            hardware support); the message lists what is available. ``SPECSTREAM_DISABLE_DTYPES`` (comma list)
            marks precisions unavailable, as a missing kernel would.
    """
    from specstream.errors import UnsupportedDtypeError
    from specstream.kernels.quant import available_weight_dtypes, kernel_available, parse_weight_format

    if isinstance(name, torch.dtype):
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(name, str(name))
    disabled = {d.strip() for d in os.environ.get("SPECSTREAM_DISABLE_DTYPES", "").split(",") if d.strip()}
    available = [d for d in available_weight_dtypes(device) if d not in disabled]
    try:
        fmt = parse_weight_format(name)
    except ValueError:
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; available on {device}: {', '.join(available)}"
                                    ) from None
    if fmt.label in disabled or fmt.name in disabled or not kernel_available(fmt, device):
        raise UnsupportedDtypeError(f"dtype {fmt.label} cannot run on {device} (no kernel or hardware support); "
                                    f"available: {', '.join(available)}")
    return fmt
