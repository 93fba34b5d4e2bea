"""Dry runs of the benchmark scripts with tiny shapes, so GPU minutes are never spent on a typo."""

import json

from specstream.pipeline.bench import gpu as bench_gpu


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
    from specstream.pipeline.bench.spec import QUICK, build_models, make_prompts, run

    target, draft = build_models(tmp_path / "m", QUICK)
    res = run(target, draft, make_prompts(1, QUICK.vocab_size, length=16), 8, tmp_path / "out", progress=False)
    assert all(c["identical"] for c in res["configs"].values())
    assert (tmp_path / "out" / "bench_spec.json").exists()
    assert res["configs"]["ours/no-spec"]["vs_no_spec"] == 1.0


def test_bench_mixed_dry_run_through_a_real_server(tmp_path):
    """One sentence, one caption client: a real ``specstream serve`` child process, the WebSocket stream, the
    caption uploads, the server's CPU and device-loop seconds, the table and the plot."""
    from specstream.pipeline.bench.mixed import bench_mixed_main

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


def test_bench_structured_dry_run_on_tiny_models(tiny, tmp_path):
    """``bench spec --real --structured``'s code on the tiny pair and the test vocabulary of test_structured.py:
    every configuration gives the constrained baseline's outputs, finished ones validate, and the forced-token
    drafter's share and the constraint's time per step are reported."""
    from specstream.pipeline.bench.structured import markdown, run_structured
    from specstream.stages.speculative.grammar import raw_vocab_info
    from test_structured import EOS, PROMPTS, SCHEMA, VOCAB

    res = run_structured(tiny.with_eos(EOS), tiny.noisy, raw_vocab_info(VOCAB, [EOS]),
                         {"a": (PROMPTS[0], SCHEMA), "b": (PROMPTS[1], SCHEMA)},
                         lambda ids: "".join(VOCAB[t] for t in ids), 40, 4, (EOS,), adaptive=False, log=lambda m: None)
    assert set(res["configs"]) == {"constrained/no-spec", "constrained/grammar-only", "constrained/specinfer"}
    for per in res["configs"].values():
        assert set(per) == {"a", "b", "batch4"}
        assert all(r["identical"] for r in per.values())
        assert all(r["valid"] + r["cut"] == len(r["outputs"]) and r["valid"] >= 1 for r in per.values())
    only = res["configs"]["constrained/grammar-only"]["batch4"]
    # the forced tokens are the only draft: all accepted draft tokens but those of each request's last step (the
    # executor tells drafters nothing on a request's finishing step)
    assert 0.9 <= only["forced_share"] <= 1.0 and only["tau"] > 1.5 and only["forced_accepted"] > 0
    base = res["configs"]["constrained/no-spec"]["batch4"]
    assert base["tau"] == 1.0 and base["forced_proposed"] == 0 and base["mask_s_per_step"] > 0
    assert "| constrained/specinfer | batch4 |" in markdown(res)
    # with the machine's read bandwidth the table names the no-speculation bound and each row's share of it
    assert res["target_weight_bytes"] > 0
    res.update(cpu="Test CPU", read_bandwidth_gbs=res["target_weight_bytes"] * 100 / 1e9, threads=2)
    table = markdown(res)
    assert "one token per target forward is bound at 100.0 tokens/s" in table
    r = res["configs"]["constrained/no-spec"]["a"]
    assert f"| constrained/no-spec | a | {r['tok_s']:.2f} | {r['tok_s']:.0f} % |" in table
    b = res["configs"]["constrained/no-spec"]["batch4"]  # one forward gives a token to each of 4 requests
    assert b["requests"] == 4
    assert f"| constrained/no-spec | batch4 | {b['tok_s']:.2f} | {b['tok_s'] / 4:.0f} % |" in table
