"""Row-invariant attention as one C++ call per layer on x86-64 CPUs (``row_attention.cpp``; AVX-512 or AVX2 + FMA,
the instruction set of :func:`specstream.kernels.int4_vnni.cpu_isa`).

The target's forwards at bfloat16 activations need an attention whose result for a query row does not depend on
the rows beside it, so that greedy speculative output equals plain decoding token for token
(:func:`specstream.kernels.tree_attention.canonical_attention` explains why). The PyTorch formulation of that
guarantee, fixed key blocks as float32 GEMMs plus per-row gathers for token trees, costs about 20 small tensor
operations per layer: 0.6 ms for one decoded row at 100 keys, 2 ms for a 21-node tree, against 0.1-0.3 ms for
SDPA (``scripts/attention_bench.py``, ``docs/benchmarks.md``). Here each query row owns its reduction: its visible
columns ordered by the position the KV cache stores for each column (so a tree node's ancestors, at node
columns, come in the order they have when decoded one at a time), one dot product per key, a max, a fixed
polynomial ``exp``, and the value sum in position order (the C++ file's header gives the order of operations).
The idea is the fixed reduction order of batch-invariant kernels (Thinking Machines, "Defeating Nondeterminism in
LLM Inference", 2025).

Its bits differ from :func:`canonical_attention`'s (both are exact softmax attention in float32 to about 1e-6),
so one engine uses one of them for every forward: the choice is made once per process. ``SPECSTREAM_ROW_ATTENTION=
auto|cpp|torch`` (default ``auto``: this kernel where it builds, the PyTorch formulation elsewhere, e.g. on CUDA
or a CPU without AVX2); ``cpp`` makes its absence an error (:class:`RowAttentionUnavailable`).
``tests/test_row_attention.py`` checks the invariance bit for bit and the values against SDPA.
"""

from __future__ import annotations

import torch

from specstream.kernels import int4_vnni
from specstream.kernels.int4_vnni import env_choice


class RowAttentionUnavailable(RuntimeError):
    """``SPECSTREAM_ROW_ATTENTION=cpp`` was asked for and the kernel cannot run here (the message says why)."""


def _choice() -> str:
    return env_choice("SPECSTREAM_ROW_ATTENTION", "cpp")


#: the one compiled module of the C++ kernels (:data:`specstream.kernels.int4_vnni.MODULE_SOURCES`), or the reason
#: it is not available here (a str)
_load = int4_vnni._load


def unavailable_reason() -> str | None:
    """Why the kernel will not be used on the CPU (None when it will)."""
    if _choice() == "torch":
        return "SPECSTREAM_ROW_ATTENTION=torch"
    ext = _load()
    return ext if isinstance(ext, str) else None


def available() -> bool:
    """True when the target's CPU forwards at bfloat16 use this kernel.

    Raises:
        RowAttentionUnavailable: ``SPECSTREAM_ROW_ATTENTION=cpp`` and the kernel cannot run here.
        ValueError: an unknown ``SPECSTREAM_ROW_ATTENTION``.
    """
    reason = unavailable_reason()
    if reason is not None and _choice() == "cpp":
        raise RowAttentionUnavailable(f"SPECSTREAM_ROW_ATTENTION=cpp, but {reason}")
    return reason is None


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, key_pos: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Softmax attention whose result for a query row depends only on that row's query and visible keys/values.

    Args:
        q: ``[B, Hq, T, D]`` float32 or bfloat16, head dimension contiguous (``D`` a multiple of 16, at most 256).
        k, v: ``[B, Hkv, S, D]`` float32 or bfloat16 (one dtype), head dimension contiguous: views of the KV cache
            are read in place.
        mask: ``[B, T, S]`` bool, column ``s`` visible to query row ``t``.
        key_pos: ``[B, S]`` int64, the position each cache column holds (``KVCache.positions``): a row's visible
            columns are reduced in this order.
        scale: softmax scale.

    Returns:
        ``[B, T, Hq, D]`` float32 (note: query rows before heads, as the output projection wants them). A row with
        no visible column gives zeros.

    Raises:
        RowAttentionUnavailable: the kernel cannot run here (:func:`unavailable_reason`).
        RuntimeError: shapes, dtypes or strides outside the above.
    """
    ext = _load()
    if isinstance(ext, str):
        raise RowAttentionUnavailable(ext)
    return ext.row_attention(q, k, v, mask, key_pos, float(scale))
