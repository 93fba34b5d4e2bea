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
