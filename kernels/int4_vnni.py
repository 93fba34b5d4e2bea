"""The int4 x int8 product of this project's own on x86-64 CPUs (``int4_vnni.cpp``), and its weight layout.

PyTorch's ``_weight_int4pack_mm_for_cpu`` converts the 4-bit codes to float and multiplies in float32, one
activation row at a time: on this project's 2-core AMD EPYC a 21-row product costs 10x a 1-row one, which is
what token-tree verification and batches pay. The kernel here follows llama.cpp's Q4 x Q8 dot products instead
(activations quantized to int8 in groups of 32, integer products, float scales once per group) on weights
interleaved by blocks of 16 output channels (llama.cpp's repacked CPU layouts), so a block's codes are unpacked
once for up to 8 rows. Measured against PyTorch's kernel on Qwen2.5-1.5B's shapes, weights cold in memory
(``docs/benchmarks.md``): about the same speed for 1 row, 2x faster for 21.

It is built for the best instruction set of :data:`ISAS` the CPU has (:func:`cpu_isa`): AVX-512 VNNI (VPDPBUSD,
AMD Zen 4, Intel since Ice Lake) or AVX2 with FMA (VPMADDUBSW + VPMADDWD, nearly every x86-64 server CPU since
2013). Both compute the same integer sums and the same float operations in the same order (``simd16.h``).
``SPECSTREAM_KERNEL_ISA=avx2`` builds the AVX2 one on an AVX-512 CPU (A/B runs); it applies to every C++ kernel
of :mod:`specstream.kernels`.

The product is row-invariant (a row's bits do not depend on the other rows of the call), which speculative
verification needs; ``tests/test_int4_vnni.py`` checks it bit for bit.

The C++ sources are compiled once per machine and instruction set by ``torch.utils.cpp_extension``, as one
module with the attention and the decoder layer (:data:`MODULE_SOURCES`; 49 s on a 2-core AVX2 EPYC, cached under
``~/.cache/torch_extensions``) on first use. On a CPU without AVX2 and FMA, without a compiler or
ninja, or with ``SPECSTREAM_INT4_KERNEL=torch``, :func:`available` is False and
:class:`~specstream.kernels.quant.Int4Linear` keeps PyTorch's kernel; ``SPECSTREAM_INT4_KERNEL=vnni`` (this
kernel, whatever its instruction set) makes that an error instead. Layers the kernel does not fit (groups other
than 32, ``N`` not a multiple of 16, a device other than the CPU) use PyTorch's kernel whatever the choice.

Layout (:func:`pack`): ``[N / 16, K / 32, 320]`` uint8. For block ``b`` and group ``g``, bytes 0..255 are four
quarters of 64 bytes: byte ``4c + i`` of quarter ``j`` holds column ``32g + 8j + i`` of channel ``16b + c`` in its
low nibble and column ``32g + 8j + 4 + i`` in its high one; bytes 256..287 are the 16 channels' bfloat16 scales
and 288..319 their zeros (``w = (q - 8) * scale + zero``, PyTorch's int4 convention).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import time
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("specstream.kernels")

#: channels per block and columns per group of the layout
LANES, GROUP = 16, 32
#: the instruction sets this project's C++ kernels are built for, best first: name, the CPU flags
#: (``/proc/cpuinfo``) it needs, its compiler flags. The AVX2 build computes the same integers and floats in the
#: same order as the AVX-512 VNNI one (``simd16.h``), with two 256-bit registers where the other has one.
ISAS = (
    ("avx512-vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma")),
    ("avx2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
)
_SOURCE = Path(__file__).with_name("int4_vnni.cpp")
#: the header every kernel source includes (PyTorch's build cache hashes the listed source only)
SIMD_HEADER = Path(__file__).with_name("simd16.h")


class Int4KernelUnavailable(RuntimeError):
    """``SPECSTREAM_INT4_KERNEL=vnni`` (this project's kernel) was asked for and the kernel cannot run here (the
    message says why)."""


def env_choice(variable: str, native: str) -> str:
    """A kernel switch from the environment: ``auto`` (default), ``native`` (the C++ kernel or an error) or
    ``torch`` (PyTorch's operations).

    Raises:
        ValueError: ``variable`` holds something else.
    """
    choice = os.environ.get(variable, "auto").strip().lower()
    if choice not in ("auto", native, "torch"):
        raise ValueError(f"{variable}={choice!r}: expected auto, {native} or torch")
    return choice


def _choice() -> str:
    return env_choice("SPECSTREAM_INT4_KERNEL", "vnni")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


#: a build lock older than this is a killed build's (a build took 49 s on 2 cores); PyTorch would wait on it forever
STALE_LOCK_S = 600.0


def lock_file_blocks() -> bool:
    """Whether PyTorch's extension build lock blocks by the lock file's mere existence (its older ``FileBaton``),
    rather than by an OS advisory lock on it (``FileLock``, torch 2.14), which the OS releases when the holding
    process dies, so a file left behind blocks nothing."""
    from torch.utils import cpp_extension

    return not hasattr(cpp_extension, "FileLock")


def _held(lock: Path) -> bool:
    """Whether some process holds an advisory lock on ``lock`` now."""
    try:
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` when it blocks the build although its build is gone: only where PyTorch's lock is
    the file's existence (:func:`lock_file_blocks`; a build killed while holding it leaves it, and PyTorch would
    wait on it with no timeout), when it is older than ``max_age_s`` and no process holds an advisory lock on it.
    With PyTorch's advisory lock the file stays: deleting it while another process holds its lock would let a
    second build start beside that one. Returns True when one was removed."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age <= max_age_s or not lock_file_blocks() or _held(lock):
        return False
    log.warning("removing the stale build lock %s (%.0f s old, left by a killed build)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def cpu_isa() -> str | None:
    """The instruction set the C++ kernels are built for on this CPU (a name of :data:`ISAS`): the best one whose
    flags the CPU has, or the one ``SPECSTREAM_KERNEL_ISA`` names (``auto``, the default, picks); None when the
    CPU runs none (not x86-64, or without AVX2 and FMA).

    Raises:
        ValueError: ``SPECSTREAM_KERNEL_ISA`` names no instruction set of :data:`ISAS`.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        _wanted_isas()  # a bad value is an error on any machine
        return None
    flags = cpu_flags()
    return next((name for name, needs in _wanted_isas() if needs <= flags), None)


def _wanted_isas() -> list[tuple[str, frozenset[str]]]:
    """The (name, flags) of :data:`ISAS` that ``SPECSTREAM_KERNEL_ISA`` allows, best first."""
    want = os.environ.get("SPECSTREAM_KERNEL_ISA", "auto").strip().lower()
    names = [name for name, _, _ in ISAS]
    if want != "auto" and want not in names:
        raise ValueError(f"SPECSTREAM_KERNEL_ISA={want!r}: expected auto, {', '.join(names)}")
    return [(name, needs) for name, needs, _ in ISAS if want in ("auto", name)]


def cpu_reason() -> str | None:
    """Why this CPU cannot run the C++ kernels (not x86-64, or none of :data:`ISAS`' flag sets, or not the one
    ``SPECSTREAM_KERNEL_ISA`` names); None if it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if cpu_isa() is not None:
        return None
    flags = cpu_flags()
    missing = "; ".join(f"{', '.join(sorted(needs - flags))} for {name}" for name, needs in _wanted_isas())
    return f"the CPU lacks {missing}"


def compile_extension(name: str, sources: tuple[Path, ...], what: str):
    """Build (once per machine and instruction set, cached by ``torch.utils.cpp_extension``) and import the C++
    extension compiled from ``sources[0]`` (which includes the others) for :func:`cpu_isa`; the module's name is
    ``name``, the instruction set and a hash of ``sources``. Returns the module, or the reason it cannot run here
    (a str): not an x86-64 CPU, a CPU without AVX2 and FMA, or a failed build (a missing compiler or ninja).
    ``what`` names it in the log."""
    reason = cpu_reason()
    if reason is not None:
        return reason
    isa = cpu_isa()
    # -fopenmp: ATen's at::parallel_for is OpenMP pragmas in its headers, so without it every loop runs on one core
    cflags = ["-O3", "-fopenmp", *next(f for n, _, f in ISAS if n == isa)]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    name = f"{name}_{isa.replace('-', '_')}_{digest}"
    try:
        quiet = logging.getLogger("torch.utils.cpp_extension")  # its "No CUDA runtime is found" warning on import
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            from torch.utils.cpp_extension import load
        finally:
            quiet.setLevel(level)

        if shutil.which("ninja") is None:  # the pip package's binary, when its venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        try:
            from torch.utils.cpp_extension import _get_build_directory

            clear_stale_lock(Path(_get_build_directory(name, False)))
        except (ImportError, OSError, TypeError) as exc:  # a private helper of PyTorch's: never fatal
            log.debug("build lock check skipped: %s", exc)
        log.info("compiling the %s for %s (once per machine): %s", what, isa, sources[0])
        module = load(name, [str(sources[0])], extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a missing compiler or ninja, a build error: the PyTorch path instead
        text = str(exc).strip()
        return f"building {sources[0].name} failed: {text.splitlines()[-1] if text else repr(exc)}"
    want = min(2, torch.get_num_threads())
    if module.parallel_threads(64) < want:
        log.warning("the %s runs on one thread although torch has %d: its build lacks OpenMP (%s)", what,
                    torch.get_num_threads(), name)
    return module


#: the sources of the one C++ module of :mod:`specstream.kernels`: ``decoder_layer.cpp`` includes the int4 product
#: and the attention and exports all three (one build: 49 s on a 2-core AVX2 EPYC, 2026-12-06)
MODULE_SOURCES = (Path(__file__).with_name("decoder_layer.cpp"), _SOURCE, Path(__file__).with_name("row_attention.cpp"),
                  SIMD_HEADER)


@lru_cache(maxsize=1)
def _load():
    """The compiled module of the C++ kernels (int4 product, attention, decoder layer), or the reason it is not
    available (a str)."""
    return compile_extension("specstream_kernels", MODULE_SOURCES, "C++ kernels (int4 product, attention, layer)")


def unavailable_reason() -> str | None:
    """Why the kernel will not be used (None when it will)."""
    choice = _choice()
    if choice == "torch":
        return "SPECSTREAM_INT4_KERNEL=torch"
    ext = _load()
    return ext if isinstance(ext, str) else None


def available() -> bool:
    """True when :class:`Int4Linear` layers use this kernel.

    Raises:
        Int4KernelUnavailable: ``SPECSTREAM_INT4_KERNEL=vnni`` and the kernel cannot run here.
    """
    reason = unavailable_reason()
    if reason is not None and _choice() == "vnni":
        raise Int4KernelUnavailable(f"SPECSTREAM_INT4_KERNEL=vnni, but {reason}")
    return reason is None


def supports(out_features: int, in_features: int, group_size: int, device: torch.device | str) -> bool:
    """True when a ``[out_features, in_features]`` int4 weight in groups of ``group_size`` goes to this kernel.
    The first True of a process also settles its prefetch distances (:func:`prefetch_distance`): timed at load,
    not in the first request, and a bad ``SPECSTREAM_INT4_PREFETCH`` fails the load.

    Raises:
        ValueError: ``SPECSTREAM_INT4_PREFETCH`` is neither auto, 0 nor 8.
    """
    ok = (torch.device(device).type == "cpu" and group_size == GROUP and out_features % LANES == 0
          and in_features % GROUP == 0 and available())
    if ok:
        prefetch_distance(1)
        prefetch_distance(MANY_ROWS)
    return ok


#: output channels packed at a time by :func:`pack` (its temporaries stay a few MB, not the weight's size again)
PACK_ROWS = 4096


def pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of codes ``q`` ``[N, K]`` (0..15) and ``scales_and_zeros`` ``[K / 32, N, 2]``:
    ``[N / 16, K / 32, 320]`` uint8 (module docstring), made :data:`PACK_ROWS` channels at a time."""
    n, k = q.shape
    b, g = n // LANES, k // GROUP
    out = torch.empty(b, g, 320, dtype=torch.uint8, device=q.device)
    step = max(1, PACK_ROWS // LANES)
    for i in range(0, b, step):
        j = min(b, i + step)
        rows = slice(i * LANES, j * LANES)
        qq = q[rows].to(torch.uint8).reshape(j - i, LANES, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [b, g, j, c, i, h]
        out[i:j, :, :256] = (qq[..., 0] | (qq[..., 1] << 4)).reshape(j - i, g, 256)
        sz = scales_and_zeros[:, rows].to(torch.bfloat16).permute(1, 0, 2).reshape(j - i, LANES, g, 2)
        out[i:j, :, 256:] = sz.permute(0, 2, 3, 1).contiguous().reshape(j - i, g, 32).view(torch.uint8)
    return out


def _channels(packed: torch.Tensor, ids: torch.Tensor, part: slice, dtype: torch.dtype, inner: tuple[int, ...]):
    """Bytes ``part`` of every group of channels ``ids`` (``ids.numel()`` = n), gathered straight from the blocks
    (no block copied). The group's bytes are viewed as ``inner``, whose second entry is the 16 lanes; the result
    is ``[n, K / 32, inner[0], *inner[2:]]``."""
    b, g = packed.shape[:2]
    flat = ids.reshape(-1)
    view = packed[:, :, part].view(dtype).reshape(b, g, *inner)
    return view[flat // LANES, :, :, flat % LANES]


def codes(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Codes ``[*ids.shape, K]`` uint8 (0..15) of output channels ``ids`` of a :func:`pack` layout."""
    g = packed.shape[1]
    sel = _channels(packed, ids, slice(0, 256), torch.uint8, (4, LANES, 4))  # [n, g, j, i]
    return torch.stack([sel & 15, sel >> 4], -2).reshape(*ids.shape, g * GROUP)  # [n, g, j, half, i] -> [n, K]


def scales_zeros(packed: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros ``[*ids.shape, K / 32]`` bfloat16 of output channels ``ids`` of a :func:`pack` layout."""
    g = packed.shape[1]
    sz = _channels(packed, ids, slice(256, 320), torch.bfloat16, (2, LANES))  # [n, g, 2]
    return sz[..., 0].reshape(*ids.shape, g), sz[..., 1].reshape(*ids.shape, g)


def mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (contiguous) times the weights of ``packed`` (:func:`pack`): ``[M, N]``, bfloat16 for a
    bfloat16 ``x``; for a float32 ``x``, float32 (the activations rounded to bfloat16 as they are read, the same
    codes as ``x.to(torch.bfloat16)``; the product and ``bias`` ``[N]`` float32 added without rounding).

    Raises:
        Int4KernelUnavailable: the kernel is not available here (:func:`available`).
        RuntimeError: a bias with a bfloat16 ``x``, or bad shapes (the kernel's check).
    """
    ext = _load()
    if isinstance(ext, str):
        raise Int4KernelUnavailable(ext)
    return ext.int4_mm(x, packed, prefetch_distance(x.shape[0]), bias)


#: the software prefetch distances the kernel is built with (groups ahead; 0: the hardware prefetcher alone)
PREFETCH_DISTANCES = (0, 8)
#: products of at least this many rows are "many rows" for the prefetch choice (:func:`prefetch_distance`)
MANY_ROWS = 3
#: the row count each class is timed at: one decoded token; a chain verification
_TIMED_ROWS = {1: 1, MANY_ROWS: 5}


def prefetch_distance(rows: int = 1) -> int:
    """The kernel's software prefetch distance for a product of ``rows`` activation rows in this process:
    ``SPECSTREAM_INT4_PREFETCH`` (0 or 8) for every product when set, or by default the faster of the two on this
    CPU for the row count's class, one row or :data:`MANY_ROWS` and more, each timed once (:func:`time_prefetch`,
    about 0.1 s). The choice changes no result bit, only how the weights stream from memory: on this project's
    2-core AMD EPYC no software prefetch was 4-10 % faster for one row, and prefetching 8 groups ahead 1.5x faster
    for 5 rows (the products' compute then hides the hardware prefetcher's stream).

    Raises:
        ValueError: ``SPECSTREAM_INT4_PREFETCH`` is set to something else.
    """
    return _prefetch_for(1 if rows < MANY_ROWS else MANY_ROWS)


@lru_cache(maxsize=2)
def _prefetch_for(rows_class: int) -> int:
    env = os.environ.get("SPECSTREAM_INT4_PREFETCH", "auto").strip().lower()
    if env != "auto":
        if env not in {str(d) for d in PREFETCH_DISTANCES}:
            raise ValueError(f"SPECSTREAM_INT4_PREFETCH={env!r}: expected auto, "
                             f"{' or '.join(map(str, PREFETCH_DISTANCES))}")
        return int(env)
    times = time_prefetch(rows=_TIMED_ROWS[rows_class])
    best = min(times, key=times.get)
    log.info("int4 kernel: software prefetch distance %d for %s (seconds per pass: %s)", best,
             "one row" if rows_class == 1 else f"{MANY_ROWS} rows or more",
             ", ".join(f"{d}: {t:.4f}" for d, t in sorted(times.items())))
    return best


def reset_prefetch_choice() -> None:
    """Forget the timed or configured distances (the next product decides again; tests)."""
    _prefetch_for.cache_clear()


def time_prefetch(channels: int = 8192, in_features: int = 1536, copies: int = 12, rounds: int = 3, rows: int = 1
                  ) -> dict[int, float]:
    """Seconds per pass of ``rows`` activation rows through ``copies`` weights of ``[channels, in_features]``
    (together larger than the last-level cache, so they stream from memory as a decode step's do), for each
    prefetch distance, the distances alternated over ``rounds`` (the best round of each). Random codes: only the
    time matters."""
    ext = _load()
    if isinstance(ext, str):
        raise Int4KernelUnavailable(ext)
    shape = (channels // LANES, in_features // GROUP, 320)
    weights = [torch.full(shape, 0x5A, dtype=torch.uint8) for _ in range(copies)]  # codes 10 and 5
    for w in weights:  # finite bfloat16 scales and zeros (1.0, 0.0)
        w[:, :, 256:288].view(torch.bfloat16).fill_(1.0)
        w[:, :, 288:].view(torch.bfloat16).zero_()
    x = torch.linspace(-1.0, 1.0, in_features).to(torch.bfloat16)[None].repeat(rows, 1)
    best = {d: float("inf") for d in PREFETCH_DISTANCES}
    for r in range(rounds):
        for d in (PREFETCH_DISTANCES if r % 2 == 0 else PREFETCH_DISTANCES[::-1]):
            t0 = time.perf_counter()
            for w in weights:
                ext.int4_mm(x, w, d)
            best[d] = min(best[d], time.perf_counter() - t0)
    return best
