"""``pipeline/bench/harness.py``: the machine header, ratios against a baseline measured in the same run, and one
run written as JSON + markdown (+ plot)."""

from __future__ import annotations

import json
import time

import pytest

from specstream.pipeline.bench import harness


def _timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_a_run_written_as_json_and_markdown_with_ratios_against_its_own_baseline(tmp_path):
    # one run: a baseline and a configuration doing four times the work, timed here (real values, not fixtures)
    work = list(range(20_000))
    rows = {"baseline": {"s": _timed(lambda: sum(work))},
            "4x work": {"s": _timed(lambda: [sum(work) for _ in range(4)])}}
    for row in rows.values():
        row["items_per_s"] = len(work) / row["s"]
    got = harness.ratio_table(rows, "baseline", "items_per_s", into="vs_baseline")
    assert got["baseline"] == 1.0 == rows["baseline"]["vs_baseline"]
    assert got["4x work"] == pytest.approx(rows["4x work"]["items_per_s"] / rows["baseline"]["items_per_s"])
    assert 0 < got["4x work"] < 1  # four times the work per item count: slower than the baseline
    info = {"cpu": harness.cpu_model(), "read_bandwidth": 12.34e9, "threads": 2}
    assert info["cpu"] and harness.machine_line(info).endswith("; read bandwidth 12.3 GB/s (2 threads)")
    table = harness.md_table(["configuration", "items/s", "vs baseline"],
                             [[name, f"{r['items_per_s']:.0f}", harness.fmt_ratio(r["vs_baseline"])]
                              for name, r in rows.items()])
    results = {"machine": info, "configs": rows}
    plotted = []

    def plot(res, path):
        plotted.append(res)
        plt = harness.pyplot()
        fig, ax = plt.subplots()
        ax.bar(list(res["configs"]), [r["items_per_s"] for r in res["configs"].values()])
        harness.save_figure(fig, path, dpi=50)

    written = harness.write_results(tmp_path / "out", "bench_x", results, markdown="\n".join(table), plot=plot)
    assert set(written) == {"json", "md", "png"} and plotted == [results]
    assert json.loads((tmp_path / "out" / "bench_x.json").read_text()) == results
    md = (tmp_path / "out" / "bench_x.md").read_text().splitlines()
    assert md[0] == "| configuration | items/s | vs baseline |" and md[1] == "|---|---|---|"
    assert md[2] == f"| baseline | {rows['baseline']['items_per_s']:.0f} | 1.00x |"
    assert md[3] == f"| 4x work | {rows['4x work']['items_per_s']:.0f} | {rows['4x work']['vs_baseline']:.2f}x |"
    assert (tmp_path / "out" / "bench_x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without markdown or plot: the JSON alone
    assert set(harness.write_results(tmp_path / "only", "r", {"a": 1})) == {"json"}
    assert not (tmp_path / "only" / "r.md").exists()


def test_ratios_with_a_missing_or_zero_baseline_and_paired_rounds():
    assert harness.ratio(3.0, 0.0) is None and harness.ratio(None, 2.0) is None and harness.ratio(3.0, 2.0) == 1.5
    assert harness.ratio_table({"a": {"v": 1.0}}, "absent", "v") == {"a": None}
    assert harness.fmt_ratio(None) == "–" and harness.fmt_ratio(1.234) == "1.23x"
    # each round times the baseline and the configuration back to back: the median of the per-round ratios
    assert harness.paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0
    with pytest.raises(ValueError):
        harness.md_table(["a", "b"], [["only one"]])


def test_read_bandwidth_is_measured():
    assert harness.read_bandwidth(1, nbytes=1 << 22, repeats=1) > 1e6  # bytes/s: some MB/s at the very least


def test_subtitle_requirements_pair_base_with_tiny_at_the_same_precision():
    """``bench subtitles --dtypes float32,int4`` runs each model at each precision (rows: the model and its
    dtype; tables: 'MODEL int4'); the requirements find tiny.en's faster-whisper reference, kept with the first
    precision, and compare base with tiny.en at the same precision only."""
    from specstream.pipeline.bench.subtitles import _requirements

    def row(model, dtype, wer, p95):
        return {"model": model, "dtype": dtype, "recording": "espeak", "agree_span_s": 0.0, "pace": 1.0,
                "speech_share": 1.0, "max_final_gap_audio_s": 2.0, "wer": wer, "final_latency_s_p95": p95}

    out = {"default_agree_span_s": 0.0,
           "models": {"tiny.en int4": {"model": "tiny.en", "dtype": "int4", "faster_whisper": {}},
                      "tiny.en": {"model": "tiny.en", "dtype": "float32",
                                  "faster_whisper": {"espeak": {"timestamps": 0.095, "none": 0.048}}},
                      "whisper-base": {"model": "whisper-base"}, "whisper-base int4": {"model": "whisper-base"}},
           "runs": [row("tiny.en", "float32", 0.10, 2.0), row("tiny.en", "int4", 0.20, 1.5),
                    row("whisper-base", "float32", 0.05, 9.0), row("whisper-base", "int4", 0.10, 2.5)]}
    req = _requirements(out)
    assert [(r["wer"], r["wer_bound"], r["met"]) for r in req["tiny_latency_and_accuracy"]] == [
        (0.10, 0.148, True), (0.20, 0.148, False)]
    assert [(r["dtype"], r["wer_tiny"], r["wer_base"], r["reduction"]) for r in req["base_vs_tiny"]] == [
        ("float32", 0.10, 0.05, 0.5), ("int4", 0.20, 0.10, 0.5)]


def test_pending_speech_gap_skips_pauses_with_nothing_to_commit():
    """A 3-s pause between two sentences is no stall: the final after it is owed from the speech that follows."""
    from types import SimpleNamespace

    from specstream.pipeline.bench.subtitles import max_final_gap, max_pending_speech_gap

    spans = [(1.0, 4.0), (7.0, 12.0)]
    finals = [SimpleNamespace(start_s=1.0, end_s=4.0, position_s=4.5),  # owed from 1.0: 3.5
              SimpleNamespace(start_s=7.0, end_s=9.0, position_s=9.5),  # after the pause, owed from 7.0: 2.5
              SimpleNamespace(start_s=9.0, end_s=12.0, position_s=12.0)]  # mid-speech, owed from 9.5: 2.5
    assert max_pending_speech_gap(finals, spans, 12.0) == 3.5
    finals[0].position_s = 3.5  # now the longest owed stretch is within the second sentence
    assert max_pending_speech_gap(finals, spans, 12.0) == 2.5
    assert max_final_gap(finals, 1.0, 12.0, audio=True) == 6.0  # the raw gap counts the pause
    finals[0].end_s = 3.8  # Whisper's end a little before the span's: the sentence is still covered
    assert max_pending_speech_gap(finals, spans, 12.0) == 2.5
    assert max_pending_speech_gap(finals, spans, 12.0, tolerance_s=0.1) == 5.7  # else owed from 3.8 to 9.5
