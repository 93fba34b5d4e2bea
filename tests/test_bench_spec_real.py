"""``specstream bench spec --real``: the summary arithmetic and the tables, on a hand-made result (the benchmark
itself needs the real weights and runs on a quiet machine)."""

from __future__ import annotations

import pytest

from specstream.pipeline.bench.spec_real import markdown, summarize, workloads


def _result():
    loads = workloads(["code", "prose"], [4])
    assert loads == {"code": ["code"], "prose": ["prose"], "batch-4": ["code", "code", "prose", "prose"]}
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]

    def rec(s, outs, tau=None):
        return {"s": s, "outputs": outs, **({"tau": tau} if tau else {})}

    return {"date": "2026-12-01", "threads": 2, "dtype": "float32", "new_tokens": 4, "target": "t", "draft": "d",
            "workloads": loads, "configs": {
                "hf/greedy": {"code": rec(4.0, [a]), "prose": rec(4.0, [b]), "batch-4": rec(8.0, [a, a, b, b])},
                "hf/assisted": {"code": rec(2.0, [a]), "prose": rec(4.0, [b]), "batch-4": rec(12.0, [a, a, b, b])},
                "ours/no-spec": {"code": rec(2.0, [a], 1.0), "prose": rec(2.0, [b], 1.0),
                                 "batch-4": rec(4.0, [a, a, b, b], 1.0)},
                "ours/specinfer": {"code": rec(1.0, [a], 4.0), "prose": rec(2.0, [b[:3] + [9]], 2.0),
                                   "batch-4": rec(2.0, [a, a, b, b], 3.0)}}}


def test_summary_ratios_and_identity():
    res = _result()
    summarize(res)
    spec = res["configs"]["ours/specinfer"]
    assert spec["code"]["tok_s"] == 4.0 and spec["code"]["vs_no_spec"] == 2.0 and spec["code"]["vs_hf_assisted"] == 2.0
    assert spec["batch-4"]["tok_s"] == 8.0 and spec["batch-4"]["vs_hf_assisted"] == pytest.approx(8.0 / (16 / 12))
    assert spec["code"]["identical"] is True and spec["prose"]["identical"] is False
    assert res["configs"]["hf/greedy"]["batch-4"]["identical"] is True
    table = markdown(res)
    assert ("| configuration | tokens/s | decode tokens/s | first token s | tau | vs ours/no-spec | vs HF assisted | "
            "vs llama.cpp (decode) | vs llama.cpp (end to end) |") in table
    assert "| ours/specinfer | 4.00 | – | – | 4.00 | 2.00x | 2.00x | – | – | – | – | – | yes |" in table
    assert "| ours/specinfer | 2.00 | – | – | 2.00 | 1.00x | 2.00x | – | – | – | – | – | **no** |" in table
    assert "| hf/assisted | 2.00 | – | – | – | 1.00x | 1.00x | – | – | – | – | – | yes |" in table


def test_fixed_tree_run_compares_with_ours_without_speculation():
    """A ``--fixed-trees`` run has no HF configurations: identity is checked against ``ours/no-spec`` alone."""
    res = _result()
    del res["configs"]["hf/greedy"], res["configs"]["hf/assisted"]
    res["adaptive"] = False
    summarize(res)
    assert res["reference"] == "ours/no-spec"
    spec = res["configs"]["ours/specinfer"]
    assert spec["code"]["identical"] is True and spec["prose"]["identical"] is False
    assert spec["batch-4"]["identical"] is True and spec["code"]["vs_hf_assisted"] is None
    table = markdown(res)
    assert "fixed trees (adaptive budget off)" in table and "identical to ours/no-spec |" in table
    assert "| ours/specinfer | 8.00 | – | – | 3.00 | 2.00x | – | – | – | – | – | – | yes |" in table


def test_llama_cpp_rows_compare_decode_with_decode_and_end_to_end_with_end_to_end():
    """With ``--llama-bench`` and ``--dtypes`` the single-prompt tables carry llama.cpp as the anchor row. Its
    plain decode (``-p 0 -n N``) is compared with our rate after the first token, and its end-to-end rate
    (prompt processing of the same length, ``-p P``, plus decoding) with ours end to end. Before, our end-to-end
    rate, prefill included, was divided by llama.cpp's decode-only rate. The row also gives weight bytes, the
    bandwidth bound and RSS."""
    from specstream.pipeline.bench.spec_real import llama_end_to_end, parse_llama_bench

    text = ('build: 1 (abc) with cc\n[\n  {"model_filename": "t.gguf", "n_prompt": 48, "n_gen": 0, "avg_ts": 96.0},'
            '\n  {"model_filename": "t.gguf", "n_prompt": 0, "n_gen": 4, "avg_ts": 8.75, "stddev_ts": 0.1}\n]\n')
    assert parse_llama_bench(text) == {"tg_tok_s": 8.75, "pp_tok_s": {"48": 96.0}}
    with pytest.raises(ValueError, match="no text-generation"):
        parse_llama_bench('[{"n_prompt": 512, "n_gen": 0, "avg_ts": 90.0}]')
    lb = {"tok_s": 2.0, "pp_tok_s": {"8": 4.0}, "file": "t.gguf", "threads": 2}
    assert llama_end_to_end(lb, 8, 4) == pytest.approx(4 / (8 / 4.0 + 4 / 2.0))
    assert llama_end_to_end(lb, 9, 4) is None
    res = _result()
    res.update(cpu="Test CPU", read_bandwidth=14.7e9, dtypes=["float32", "int4"], llama_bench=lb,
               prompt_tokens={"code": 8, "prose": 9})
    # 4 tokens in 2.0 s, the first after 0.5 s: 3 tokens decoded in 1.5 s
    res["configs"]["ours/no-spec@int4"] = {w: {**r, "first_token_s": 0.5, "target_weight_bytes": 2**30,
                                               "draft_weight_bytes": 0, "no_spec_bound_tok_s": 13.69,
                                               "rss_bytes": 3 * 2**29}
                                           for w, r in res["configs"]["ours/no-spec"].items()}
    summarize(res)
    assert res["configs"]["ours/no-spec@int4"]["code"]["decode_tok_s"] == 2.0
    table = markdown(res)
    assert "CPU: Test CPU; measured read bandwidth 14.7 GB/s" in table and "float32, int4" in table
    assert "plain decode 2.00 tokens/s; 8 prompt tokens at 4.0 tokens/s" in table
    assert "| llama.cpp/plain | 1.00 | 2.00 | – | – | – | – | 1.00x | 1.00x | – | – | – | – |" in table
    assert ("| ours/no-spec@int4 | 2.00 | 2.00 | 0.50 | 1.00 | 1.00x | 1.00x | 1.00x | 2.00x | 1.00 | 13.69 | 1.50 "
            "| yes |") in table
    # prose has no llama.cpp prompt record of its length: no end-to-end anchor
    assert "| llama.cpp/plain | – | 2.00 | – | – | – | – | 1.00x | – | – | – | – | – |" in table


def test_quantized_rows_are_compared_with_no_speculation_at_their_own_dtype():
    """``--dtypes int4,int8`` names configurations ``ours/X@int4``: each is compared (tokens/s ratio and identity)
    with ``ours/no-spec`` at the same precision, whose greedy outputs it must equal; before, the lookup of the bare
    ``ours/no-spec`` missed and the column printed '-'."""
    a, b = [1, 2, 3, 4], [1, 2, 5, 6]  # int8 and int4 decode differently; each dtype agrees with itself

    def rec(s, out):
        return {"s": s, "outputs": [out]}

    res = {"date": "2026-12-03", "threads": 2, "dtype": "float32", "new_tokens": 4, "target": "t", "draft": "d",
           "workloads": {"code": ["code"]}, "configs": {
               "ours/no-spec@int4": {"code": rec(2.0, b)}, "ours/chain-4@int4": {"code": rec(1.0, b)},
               "ours/no-spec@int8": {"code": rec(4.0, a)}, "ours/chain-4@int8": {"code": rec(1.0, [1, 2, 3, 9])}}}
    summarize(res)
    c = res["configs"]
    assert c["ours/chain-4@int4"]["code"]["vs_no_spec"] == 2.0 and c["ours/chain-4@int4"]["code"]["identical"]
    assert c["ours/chain-4@int8"]["code"]["vs_no_spec"] == 4.0 and not c["ours/chain-4@int8"]["code"]["identical"]
    assert c["ours/no-spec@int8"]["code"]["identical"] and c["ours/no-spec@int8"]["code"]["vs_no_spec"] == 1.0
    assert "identical to ours/no-spec at the row's dtype |" in markdown(res)


def test_batch_workloads_take_the_prompts_in_turn_at_every_requested_size():
    names = ["code", "prose", "caption", "repetitive"]
    loads = workloads(names, [8, 1, 4])
    assert list(loads) == [*names, "batch-4", "batch-8"]  # 1 is each prompt alone
    assert loads["batch-4"] == names
    assert loads["batch-8"] == ["code", "code", "prose", "prose", "caption", "caption", "repetitive", "repetitive"]
    assert workloads(["code", "prose"], [4, 8])["batch-8"] == ["code"] * 4 + ["prose"] * 4
    assert workloads(["code"], []) == {"code": ["code"]}


def test_paired_rounds_compare_with_the_same_engine_without_speculation_not_the_other_row():
    from specstream.pipeline.bench.spec_real import median_run

    assert median_run([{"s": 3.0}, {"s": 1.0}, {"s": 2.0}]) == {"s": 2.0}
    assert median_run([{"s": 4.0}, {"s": 1.0}, {"s": 2.0}, {"s": 3.0}]) == {"s": 2.0}
    res = _result()
    res["rounds"] = 3
    # the speculative row ran beside its own engine without speculation, round by round; the host slowed down in
    # round 2, so the pairs' ratios are compared, not each side's median against the other row's
    res["configs"]["ours/specinfer"]["code"].update(s_rounds=[1.0, 2.0, 1.0], no_spec_s_rounds=[1.25, 1.8, 1.5],
                                                    paired_identical=True)
    # a round whose outputs differed (speculative against its neighbour) makes the row not identical
    res["configs"]["ours/specinfer"]["batch-4"].update(paired_identical=False)
    summarize(res)
    spec = res["configs"]["ours/specinfer"]
    assert spec["batch-4"]["identical"] is False and spec["code"]["identical"] is True
    assert spec["code"]["vs_no_spec"] == pytest.approx(1.25)  # the rounds' median, not 4.0 tokens/s over 2.0
    assert spec["prose"]["vs_no_spec"] == 1.0  # unpaired: the ours/no-spec row of the run
    table = markdown(res)
    assert "the median of 3 runs per workload" in table
    assert "| ours/specinfer | 4.00 | – | – | 4.00 | 1.25x (0.90-1.50) |" in table
