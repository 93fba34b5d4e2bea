"""A whole decoder layer as one C++ call for int4 weights on x86-64 CPUs with AVX-512 VNNI or AVX2 + FMA
(``decoder_layer.cpp``, built for :func:`specstream.kernels.int4_vnni.cpu_isa`).

At int4 on this project's 2-core AMD EPYC a decode step of the 1.5B target spent 49-65 ms in the int4 products
and another 18-22 ms in the roughly 50 small PyTorch operations per layer around them (norms, RoPE, cache writes,
casts, SiLU, residual adds) and in their dispatch (medians of 4 runs, ``docs/benchmarks.md``). The C++ layer calls the
same product (:mod:`specstream.kernels.int4_vnni`) and attention (:mod:`specstream.kernels.row_attention`) kernels
and does the rest in plain loops, once per layer, as llama.cpp's fused graph does. It rounds to bfloat16 where the
PyTorch layer rounds; the float32 sums of its norms and its SiLU's ``exp`` are its own, so the last bits may differ
from the PyTorch layer's, and one process uses one of the two for every forward of a decoder (the choice is made
once per process). It is row-invariant, like its kernels, so greedy speculative output equals plain decoding.

``SPECSTREAM_DECODER_LAYER=auto|cpp|torch`` (default ``auto``: the C++ layer where the int4 kernel and the
row-invariant attention both run, and the model fits it; ``cpp`` makes its absence an error,
:class:`DecoderLayerUnavailable`; ``torch`` keeps the PyTorch layer). The C++ source is compiled once per machine
(one module with the kernels, 49 s on a 2-core AVX2 EPYC, cached by ``torch.utils.cpp_extension``). ``tests/test_decoder_layer.py`` checks it against the
PyTorch layer and for row invariance.
"""

from __future__ import annotations

from specstream.kernels import int4_vnni
from specstream.kernels import row_attention as _row_attention


class DecoderLayerUnavailable(RuntimeError):
    """``SPECSTREAM_DECODER_LAYER=cpp`` was asked for and the C++ layer cannot run here (the message says why)."""


def _choice() -> str:
    return int4_vnni.env_choice("SPECSTREAM_DECODER_LAYER", "cpp")


#: the one compiled module of the C++ kernels (:data:`specstream.kernels.int4_vnni.MODULE_SOURCES`), or the reason
#: it is not available here (a str)
_load = int4_vnni._load


def cpu_supported() -> bool:
    """Whether this machine can run the C++ layer at all (an x86-64 CPU with the int4 kernel's flags, and no
    environment switch against it or its kernels), decided without compiling anything."""
    if _choice() == "torch" or int4_vnni._choice() == "torch" or _row_attention._choice() == "torch":
        return False
    return int4_vnni.cpu_reason() is None


def unavailable_reason() -> str | None:
    """Why the C++ layer will not be used (None when it will, for models that fit it). The environment switches
    (this one, ``SPECSTREAM_INT4_KERNEL`` and ``SPECSTREAM_ROW_ATTENTION``) are read on every call; the build
    is tried once per process."""
    if _choice() == "torch":
        return "SPECSTREAM_DECODER_LAYER=torch"
    # one module holds the three kernels (int4_vnni.MODULE_SOURCES): built as theirs, it is built as the layer's
    return int4_vnni.unavailable_reason() or _row_attention.unavailable_reason()


def available() -> bool:
    """True when decoders whose layers fit (:meth:`LlamaDecoder.fused_layer_args`) run them in C++.

    Raises:
        DecoderLayerUnavailable: ``SPECSTREAM_DECODER_LAYER=cpp`` and the C++ layer cannot run here.
        ValueError: an unknown ``SPECSTREAM_DECODER_LAYER``.
    """
    reason = unavailable_reason()
    if reason is not None and _choice() == "cpp":
        raise DecoderLayerUnavailable(f"SPECSTREAM_DECODER_LAYER=cpp, but {reason}")
    return reason is None


def extension():
    """The compiled module (``decoder_layer(...)``; argument list in ``decoder_layer.cpp``).

    Raises:
        DecoderLayerUnavailable: it cannot run here (:func:`unavailable_reason`).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise DecoderLayerUnavailable(reason)
    return _load()
