"""What the benchmarks share: the machine they ran on, ratios against a baseline of the same run, and writing a
run's results as JSON, a markdown table and a plot.

Every benchmark measures its configurations and the baseline it compares them with in one run (figures of
different runs on a shared machine are not comparable), then writes ``OUT/<name>.json`` (the raw numbers that
``docs/benchmarks.md`` quotes), and where it has them ``OUT/<name>.md`` and ``OUT/<name>.png``:

- :func:`machine_info` / :func:`machine_line`: the CPU model (with its bfloat16/AMX instruction sets), the
  measured read bandwidth and the thread count, printed beside every figure;
- :func:`ratio`, :func:`ratio_table`, :func:`paired_ratio` and :func:`fmt_ratio`: ``x`` against a baseline
  measured in the same run;
- :func:`md_table`: a markdown table, header row first;
- :func:`pyplot` and :func:`save_figure`: matplotlib without a display (a benchmark skips its plot when
  matplotlib is not installed: ``pip install 'specstream[bench]'``);
- :func:`write_results` (JSON + markdown + plot into a directory) and :func:`write_json` (one JSON file);
- :func:`tests_dir_on_path`: the repository's ``tests/`` on ``sys.path``, for the benchmarks that build their
  recordings with the tests' fixtures (``live_fixtures``, ``whisper_fixtures``).

Nothing here imports torch at module level: a benchmark's parser can import this module cheaply.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

MATPLOTLIB_MISSING = "matplotlib not installed: no plot (pip install 'specstream[bench]')"


# -- the machine -----------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, or ``platform.processor()`` elsewhere), with its bfloat16/AMX
    instruction sets when it has them (``AMD EPYC (avx512_bf16)``): the benchmarks print it beside every figure."""
    import platform

    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = f" {line.split(':', 1)[1]} "
    except OSError:
        pass
    name = name or platform.processor() or "unknown"
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_int8") if f" {f} " in flags]
    return f"{name} ({', '.join(extra)})" if extra else name


def read_bandwidth(threads: int = 2, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Measured read bandwidth in bytes/s: the best of ``repeats`` torch sums over ``nbytes`` of float32 with
    ``threads`` intra-op threads (what one decoding forward does to its weights)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def machine_info(threads: int, nbytes: int = 1 << 30) -> dict:
    """``{"cpu": str, "read_bandwidth": bytes/s, "threads": int}`` of this machine, measured now with
    ``threads`` intra-op threads (:func:`cpu_model`, :func:`read_bandwidth`)."""
    return {"cpu": cpu_model(), "read_bandwidth": read_bandwidth(threads, nbytes), "threads": threads}


def machine_line(info: Mapping) -> str:
    """The header line of a run: ``CPU <model>; read bandwidth 27.2 GB/s (2 threads)``."""
    return f"CPU {info['cpu']}; read bandwidth {info['read_bandwidth'] / 1e9:.1f} GB/s ({info['threads']} threads)"


# -- ratios against a baseline of the same run -----------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is missing or the base is zero."""
    if value is None or not base:
        return None
    return value / base


def ratio_table(rows: Mapping[str, dict], baseline: str, key: str = "tok_s",
                into: str | None = None) -> dict[str, float | None]:
    """Each row's ``key`` over the ``baseline`` row's, for rows measured in the same run: ``{name: ratio}``
    (None for every row when the baseline is not among them). With ``into``, each row also gets the ratio
    under that key (``into="vs_no_spec"``), in place."""
    base = rows.get(baseline, {}).get(key)
    out = {name: ratio(row.get(key), base) for name, row in rows.items()}
    if into is not None:
        for name, row in rows.items():
            row[into] = out[name]
    return out


def paired_ratio(base_times: Sequence[float], times: Sequence[float]) -> float:
    """How many times faster than the baseline, from timings of the same rounds: the median over rounds of
    ``base_time / time`` (each round times the baseline and this configuration back to back, so a round that
    the machine slowed down slows both)."""
    return statistics.median(b / t for b, t in zip(base_times, times, strict=True))


def fmt_ratio(x: float | None, digits: int = 2, missing: str = "–") -> str:
    """``1.23x``, or ``missing`` for None."""
    return f"{x:.{digits}f}x" if x is not None else missing


def tests_dir_on_path() -> None:
    """Put the repository's ``tests/`` folder on ``sys.path`` (the speech benchmarks compose their recordings and
    score WER with the tests' fixtures; they run from a source checkout)."""
    tests = str(Path(__file__).resolve().parents[2] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


# -- output ------------------------------------------------------------------------------------------------------


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A markdown table as lines: the header row, the separator, one line per row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"a row of {len(cells)} cells under a header of {len(header)}: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display), or None when matplotlib is not installed (the
    message goes to stderr and the caller skips its plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MATPLOTLIB_MISSING, file=sys.stderr)
        return None
    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Lay ``fig`` out, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json(path: Path | str, results, indent: int = 1) -> Path:
    """``results`` as JSON in ``path`` (its directory created), ending with a newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent) + "\n")
    return path


def write_results(out_dir: Path | str, name: str, results, *, markdown: str | None = None,
                  plot: Callable[[dict, Path], None] | None = None, indent: int = 1) -> dict[str, Path]:
    """Write one run into ``out_dir`` (created): ``name.json``; ``name.md`` when ``markdown`` is given;
    ``name.png`` when ``plot`` is given (called as ``plot(results, path)``). Returns ``{"json": path, ...}``
    for the files written (a plot whose function skipped it is not listed)."""
    out_dir = Path(out_dir)
    written = {"json": write_json(out_dir / f"{name}.json", results, indent)}
    if markdown is not None:
        path = out_dir / f"{name}.md"
        path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        written["md"] = path
    if plot is not None:
        path = out_dir / f"{name}.png"
        plot(results, path)
        if path.exists():
            written["png"] = path
    return written
