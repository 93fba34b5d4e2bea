"""Dry runs of the benchmark scripts with tiny shapes, so GPU minutes are never spent on a typo."""

import json

from specstream.pipeline import bench_gpu


def test_gpu_bench_script_dry_run_on_cpu(tmp_path):
    assert bench_gpu.main(["--tiny", "--out", str(tmp_path), "--budget-s", "120"]) == 0
    res = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert res["complete"] is True
    assert set(res["sections"]) == {"bandwidth", "step", "replay", "draft"}
    assert set(res["sections"]["step"]["seconds"]) == {"1", "16", "64"}
    points = res["sections"]["replay"]["points"]
    assert points and all(p["identical"] for p in points)
    # a replay of the target's own continuation with no corruption is accepted in full: tau = depth + 1 bound
    exact = [p for p in points if p["corruption"] == 0.0]
    assert all(p["tau"] > 3 for p in exact)
    assert res["sections"]["draft"]["identical"] is True


def test_bench_spec_quick_smoke(tmp_path):
    from specstream.pipeline.bench_spec import QUICK, build_models, make_prompts, run

    target, draft = build_models(tmp_path / "m", QUICK)
    res = run(target, draft, make_prompts(1, QUICK.vocab_size, length=16), 8, tmp_path / "out", progress=False)
    assert all(c["identical"] for c in res["configs"].values())
    assert (tmp_path / "out" / "bench_spec.json").exists()
    assert res["configs"]["ours/no-spec"]["vs_no_spec"] == 1.0


def test_bench_mixed_dry_run_through_a_real_server(tmp_path):
    """One sentence, one caption client: a real ``specstream serve`` child process, the WebSocket stream, the
    caption uploads, the server's CPU and device-loop seconds, the table and the plot."""
    from specstream.pipeline.bench_mixed import bench_mixed_main

    assert bench_mixed_main(["--sentences", "1", "--inflight", "1", "--max-new-tokens", "4",
                             "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_mixed.json").read_text())
    (design,) = res["designs"]
    alone, caps, mixed = design["runs"]
    assert alone["subtitles"]["finals"] >= 1 and alone["subtitles"]["wer"] <= 0.5
    assert mixed["subtitles"]["finals"] >= 1 and mixed["with_stream"] and not caps["with_stream"]
    assert caps["captions"] > 0 and caps["errors"] == 0 and mixed["errors"] == 0
    # the loop measures its time per model: subtitle work alone is whisper's only
    assert alone["device_share"]["whisper"] > 0 and alone["device_share"].get("vlm", 0.0) == 0.0
    assert caps["device_share"]["vlm"] > 0
    (verdict,) = design["verdicts"]
    assert verdict["subtitle_cpu_share"] == alone["device_share"]["whisper"]
    assert (tmp_path / "bench_mixed.png").stat().st_size > 0
    assert "| this build | 1 |" in (tmp_path / "bench_mixed.md").read_text()
