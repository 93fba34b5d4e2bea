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


AUTO = "auto"


def auto_weight_dtype(device: str | torch.device = "cpu") -> str:
    """The precision ``--dtype auto`` loads on ``device``: the one that decodes fastest there, among those it runs.

    - CUDA: ``bfloat16``.
    - A CPU with bfloat16 in hardware (AVX-512 bf16 or AMX, :func:`~specstream.kernels.quant.native_bf16`), or
      one that runs this project's int4 kernel (AVX-512 VNNI or AVX2 + FMA, :mod:`specstream.kernels.int4_vnni`):
      ``int4`` (groups of 32), a quarter of float32's bytes per weight read by a kernel that keeps up with them
      (docs/benchmarks.md, "int4 and int8 on an AVX2-only CPU").
    - Any other CPU: ``int8``. PyTorch's int4 kernel without native bf16 converts in software and is
      compute-bound: measured on an AVX2 EPYC it decoded the real 1.5B target at about half int8's speed.

    A precision this machine cannot run (or that ``SPECSTREAM_DISABLE_DTYPES`` disables) is skipped for the next of
    int8, bfloat16, float32.
    """
    from specstream.kernels import int4_vnni
    from specstream.kernels.quant import kernel_available, native_bf16, parse_weight_format

    dev = torch.device(device)
    if dev.type == "cuda":
        first = "bfloat16"
    else:
        own_int4 = int4_vnni.cpu_reason() is None and int4_vnni._choice() != "torch"
        first = "int4" if native_bf16(dev) or own_int4 else "int8"
    disabled = {d.strip() for d in os.environ.get("SPECSTREAM_DISABLE_DTYPES", "").split(",") if d.strip()}
    # probed in order, stopping at the first that runs (probing int4 builds its kernel: kernels/int4_vnni.py)
    return next((d for d in (first, "int8", "bfloat16", "float32")
                 if d not in disabled and kernel_available(parse_weight_format(d), dev)), "float32")


def weight_format(name: str | torch.dtype, device: str | torch.device = "cpu"):
    """Parse and check a weight precision (``--dtype``): float32, bfloat16, int8, int4 (groups of 32),
    int4-g64, or ``auto`` (:func:`auto_weight_dtype`: the fastest for ``device``), as a
    :class:`~specstream.kernels.quant.WeightFormat`.

    Raises:
        UnsupportedDtypeError: an unknown name, or one ``device`` cannot run (no packed kernel, no bfloat16
            hardware support); the message lists what is available. ``SPECSTREAM_DISABLE_DTYPES`` (comma list)
            marks precisions unavailable, as a missing kernel would.
    """
    from specstream.errors import UnsupportedDtypeError
    from specstream.kernels.quant import available_weight_dtypes, kernel_available, parse_weight_format

    if isinstance(name, torch.dtype):
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(name, str(name))
    if str(name).strip().lower() == AUTO:
        name = auto_weight_dtype(device)
    disabled = {d.strip() for d in os.environ.get("SPECSTREAM_DISABLE_DTYPES", "").split(",") if d.strip()}

    def available() -> str:
        # probed for the error message only: the probe of every precision builds the int4 kernel (tens of
        # seconds on first use, kernels/int4_vnni.py), which a float32 or int8 load never needs
        return ", ".join(d for d in available_weight_dtypes(device) if d not in disabled)

    try:
        fmt = parse_weight_format(name)
    except ValueError:
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; available on {device}: {available()}") from None
    if fmt.label in disabled or fmt.name in disabled or not kernel_available(fmt, device):
        raise UnsupportedDtypeError(f"dtype {fmt.label} cannot run on {device} (no kernel or hardware support); "
                                    f"available: {available()}")
    return fmt
