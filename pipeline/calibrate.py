"""Measure this machine and fit a :class:`~specstream.schedulers.costmodel.CostModel`.

``python -m specstream.pipeline.calibrate [--out calib.json] [--quick]`` builds a mid-size random Llama
(hidden 512, 8 layers, vocab 8192) and a same-weights draft as real checkpoints in a temporary directory,
runs real engine steps (prefills of several lengths, decode batches of 1..16 with trees of 1..9 nodes),
records each :class:`StepOutput`'s duration with the plan's features, and fits the step model by non-negative
least squares. Encoders: a random CLIP ViT-B/32 vision tower (224 px) and a random Whisper tiny encoder
(transformers), timed at batch sizes 1, 2 and 4. Prints the fitted coefficients and the raw points as JSON.
"""

from __future__ import annotations

from specstream.threadpolicy import set_thread_policy

if __name__ == "__main__":  # `python -m ...`: before torch loads (libgomp reads the policy once)
    set_thread_policy()

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path


def _fit(rows: list[list[float]], y: list[float]) -> list[float]:
    import numpy as np
    from scipy.optimize import nnls

    coef, _ = nnls(np.asarray(rows, dtype=float), np.asarray(y, dtype=float))
    return [float(c) for c in coef]


def measure_decoder(quick: bool) -> dict:
    import torch

    from specstream.schedulers.fifo import FifoScheduler
    from specstream.schedulers.plan import DecodeWork, Request, StepPlan
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.stages.speculative.models.tiny import TinyDecoderSpec, build_tiny_decoder, random_decoder_state
    from specstream.stages.speculative.models.tiny import save_checkpoint

    spec = TinyDecoderSpec(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        target = build_tiny_decoder(Path(tmp) / "target", spec, seed=1)
        save_checkpoint(Path(tmp) / "draft", spec.config_dict(), random_decoder_state(spec, 1))
        # a chain tree: node budget n -> draft depth n - 1
        cfg = EngineConfig(num_slots=16, max_len=1024, tree=TreeSpec.parse("1,1,1,1,1,1,1,1"), adaptive=False)
        engine = SpeculativeEngine.from_checkpoints(target, drafts=[Path(tmp) / "draft"], config=cfg)
        ex = engine.executor
        torch.manual_seed(0)
        sched = FifoScheduler(16, 1024, max_nodes_per_request=9)
        reqs = [Request(f"r{i}", [int(t) for t in torch.randint(0, 8192, (64 + 24 * i,))], 600) for i in range(16)]
        for r in reqs:
            sched.add(r)
        # prefills one at a time (various lengths)
        nreq = 8 if quick else 16
        reqs = reqs[:nreq]
        for r in reqs:
            sched.free_slots = [reqs.index(r)]
            # only the prefill: the scheduler would also decode the requests admitted before it, and those steps
            # (with their drafts' first catch-up over the whole prompt) made the prefill points grow with i
            plan = dataclasses.replace(sched.schedule(), decodes=())
            out = ex.execute(plan)
            sched.update(out)
            points.append({"rows": 1, "tokens": len(r.prompt_ids), "kv": 0, "depth": 0, "dnodes": 0,
                           "s": out.duration_s})
        batches = (1, 4, 8) if quick else (1, 2, 4, 8, 16)
        nodes_list = (1, 5, 9) if quick else (1, 3, 5, 9)
        step = 1000
        for b in batches:
            for n in nodes_list:
                for rep in range(3):
                    step += 1
                    decodes = tuple(DecodeWork.of(r, r.slot, n, n - 1) for r in reqs[:b])
                    plan = StepPlan(step, (), decodes)
                    out = ex.execute(plan)
                    sched.update(out)
                    if rep == 0:
                        continue  # warm-up of this shape
                    points.append({"rows": b, "tokens": b * n, "kv": sum(len(r.context) for r in reqs[:b]),
                                   "depth": n - 1, "dnodes": b * (n - 1), "s": out.duration_s})
    x = [[1.0, p["rows"], p["tokens"], p["kv"], p["depth"], p["dnodes"]] for p in points]
    coef = _fit(x, [p["s"] for p in points])
    names = ["step_fixed_s", "per_row_s", "per_token_s", "per_kv_token_s", "draft_level_s", "draft_per_node_s"]
    kv_bytes = 2 * spec.num_hidden_layers * spec.num_key_value_heads * (spec.hidden_size // spec.num_attention_heads) * 4
    return {"fit": dict(zip(names, coef)), "kv_bytes_per_token": kv_bytes, "points": points}


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure_encoders(quick: bool) -> dict:
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    out = {}
    vision = CLIPVisionModel(CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, image_size=224, patch_size=32)).eval()
    pts = []
    with torch.inference_mode():
        for b in ((1, 2) if quick else (1, 2, 4)):
            px = torch.randn(b, 3, 224, 224)
            pts.append({"n": b, "s": _time(lambda px=px: vision(pixel_values=px), 1 if quick else 2)})
    coef = _fit([[1.0, p["n"]] for p in pts], [p["s"] for p in pts])
    out["image"] = {"fixed_s": coef[0], "per_quantum_s": coef[1], "quantum": 1.0, "points": pts}
    wcfg = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                         num_mel_bins=80, max_source_positions=1500)
    enc = WhisperEncoder(wcfg).eval()
    pts = []
    with torch.inference_mode():
        for b in ((1, 2) if quick else (1, 2, 4)):
            mel = torch.randn(b, 80, 3000)
            pts.append({"n": b, "s": _time(lambda mel=mel: enc(mel), 1 if quick else 2)})
    coef = _fit([[1.0, p["n"]] for p in pts], [p["s"] for p in pts])
    out["audio"] = {"fixed_s": coef[0], "per_quantum_s": coef[1], "quantum": 30.0, "points": pts}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specstream.pipeline.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer points (about a minute on 2 cores)")
    args = ap.parse_args(argv)
    import torch

    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "decoder": measure_decoder(args.quick), "encoders": measure_encoders(args.quick)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({"decoder": result["decoder"]["fit"],
                      "encoders": {k: {kk: vv for kk, vv in v.items() if kk != "points"}
                                   for k, v in result["encoders"].items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
