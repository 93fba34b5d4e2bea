"""GPU benchmark of the engine in one script with a time budget (``python -m specstream.pipeline.bench.gpu``).

Shapes: a Llama-2-7B-shaped target (bfloat16, random weights created directly on the device) and a
~68M-shaped draft (Llama-68M: hidden 768, 2 layers). Measured, writing ``OUT/bench_gpu.json`` after every
section so a run cut short still reports what it measured:

1. ``bandwidth``: device copy bandwidth (GB/s) and the memory roofline of one target step
   (weight bytes / bandwidth).
2. ``step``: target forward time for 1 token and for a 64-node token tree (prefix of 512 tokens), against the
   roofline.
3. ``replay``: tokens/s with a replay drafter (the target's own greedy continuation recorded from the engine's
   verify path, corrupted at a rate) against no speculation on the same runtime: speed-up vs acceptance.
4. ``draft``: tokens/s with the (random) 68M draft model, whose drafts the target rejects: the cost of a
   useless draft, bounded by the adaptive budget.

``--tiny`` runs the same code with tiny shapes on the CPU (the test suite dry-runs it so GPU minutes are not
spent on a typo).
"""

from __future__ import annotations

from specstream.threadpolicy import set_thread_policy

if __name__ == "__main__":  # `python -m ...`: before torch loads (libgomp reads the policy once)
    set_thread_policy()

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from specstream.pipeline.bench.harness import write_results
from specstream.stages.speculative.models.config import DecoderConfig, RopeConfig

LLAMA2_7B = DecoderConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                          rms_norm_eps=1e-5, max_position_embeddings=4096, rope=RopeConfig(), tie_word_embeddings=False,
                          qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None, eos_token_ids=())
LLAMA_68M = replace(LLAMA2_7B, hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                    num_key_value_heads=12, head_dim=64, max_position_embeddings=2048)
TINY_TARGET = replace(LLAMA2_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)
TINY_DRAFT = replace(TINY_TARGET, num_hidden_layers=1)


def probe_tree(nodes: int) -> tuple[torch.Tensor, list[int]]:
    """The verify tree these probes time: a chain of 8 with the remaining nodes fanned out at depth 1..3.
    Returns its ancestor matrix ``[nodes, nodes]`` (bool, self included) and each node's depth."""
    parents = [-1] + [max(0, min(i - 1, 7)) if i <= 8 else (i % 3) for i in range(1, nodes)]
    anc = torch.zeros(nodes, nodes, dtype=torch.bool)
    depth = [0] * nodes
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    return anc, depth


def random_decoder(cfg: DecoderConfig, device: str, dtype: torch.dtype, seed: int):
    """A decoder with random weights created on ``device`` (no checkpoint: 7B of random numbers)."""
    from specstream.stages.speculative.models.llama import LlamaDecoder

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaDecoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "lm_head" not in name else 0.2)
    return model.to(dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_step(model, device: str, prefix: int, nodes: int, repeats: int) -> float:
    """Median seconds of one target forward over a ``nodes``-node tree after a ``prefix``-token prompt."""
    from specstream.kernels.tree_attention import build_tree_mask
    from specstream.stages.speculative.models.llama import ForwardBatch

    cache = model.new_cache(1, prefix + nodes + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, prefix), device=device)
    mask = build_tree_mask(torch.tensor([0]), [torch.ones(prefix, prefix, dtype=torch.bool).tril()], prefix, prefix)
    model.forward_batch(cache, ForwardBatch(torch.tensor([0], device=device), ids,
                                            torch.arange(prefix, device=device)[None],
                                            torch.arange(prefix, device=device)[None], mask.to(device),
                                            logit_index=torch.tensor([[prefix - 1]], device=device)))
    anc, depth = probe_tree(nodes)
    tmask = build_tree_mask(torch.tensor([prefix]), [anc], prefix + nodes, nodes).to(device)
    batch = ForwardBatch(torch.tensor([0], device=device),
                         torch.randint(0, model.config.vocab_size, (1, nodes), device=device),
                         (prefix + torch.tensor(depth, device=device))[None],
                         torch.arange(prefix, prefix + nodes, device=device)[None], tmask)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        model.forward_batch(cache, batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specstream.pipeline.bench.gpu", description=__doc__)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new sections after this")
    p.add_argument("--out", type=Path, default=Path("bench-gpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (dry run)")
    p.add_argument("--device", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    tcfg, dcfg = (TINY_TARGET, TINY_DRAFT) if args.tiny else (LLAMA2_7B, LLAMA_68M)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype), "target": tcfg.hidden_size,
                    "sections": {}, "complete": False}

    def save():
        result["elapsed_s"] = time.perf_counter() - t_start
        write_results(args.out, "bench_gpu", result, indent=2)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    target = random_decoder(tcfg, device, dtype, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    bw = measure_bandwidth(device, 1 << (30 if not args.tiny else 22))
    result["sections"]["bandwidth"] = {"copy_GBps": bw, "target_weight_bytes": weight_bytes,
                                       "roofline_step_s": weight_bytes / (bw * 1e9)}
    save()
    prefix = 512 if not args.tiny else 32
    steps = {}
    for nodes in (1, 16, 64):
        if left() < 10:
            break
        steps[nodes] = measure_step(target, device, prefix, nodes, repeats=10 if not args.tiny else 2)
    result["sections"]["step"] = {"prefix": prefix, "seconds": steps,
                                  "vs_roofline": {n: s / result["sections"]["bandwidth"]["roofline_step_s"]
                                                  for n, s in steps.items()}}
    save()
    from specstream.stages.speculative.drafters.replay import ReplayDrafter
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    n_new = args.max_new_tokens if not args.tiny else 16
    prompts = [torch.randint(0, tcfg.vocab_size, (64,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(2)]

    def timed(engine, speculate=True):
        _sync(device)
        t0 = time.perf_counter()
        reqs = [engine.generate([pr], n_new, speculate=speculate)[0] for pr in prompts]
        _sync(device)
        secs = time.perf_counter() - t0
        return secs, reqs

    base_engine = SpeculativeEngine(target, [], EngineConfig(num_slots=1, max_len=1024))
    timed(base_engine, speculate=False)  # warm-up
    base_s, base_reqs = timed(base_engine, speculate=False)
    recordings = {tuple(pr): r.output_ids for pr, r in zip(prompts, base_reqs)}
    total = len(prompts) * n_new
    replay = []
    result["sections"]["replay"] = {"no_spec_tok_s": total / base_s, "points": replay}
    for corruption in (0.0, 0.1, 0.3, 0.5):
        for depth in (4, 8, 16):
            if left() < 20:
                break
            rep = ReplayDrafter(recordings, corruption, depth, tcfg.vocab_size, seed=depth)
            eng = SpeculativeEngine(target, [rep], EngineConfig(num_slots=1, max_len=1024, adaptive=False,
                                                                max_nodes_per_request=depth + 1))
            secs, reqs = timed(eng)
            same = all(r.output_ids == recordings[tuple(pr)] for pr, r in zip(prompts, reqs))
            replay.append({"corruption": corruption, "depth": depth, "tok_s": total / secs,
                           "speedup": base_s / secs, "tau": total / sum(r.stats.target_steps for r in reqs),
                           "identical": same})
            save()
    if left() > 30:
        from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec

        draft = random_decoder(dcfg, device, dtype, seed=1)
        md = ModelDrafter(draft, 1, 1024, TreeSpec(), vocab_limit=tcfg.vocab_size, target_vocab=tcfg.vocab_size)
        eng = SpeculativeEngine(target, [md], EngineConfig(num_slots=1, max_len=1024))
        secs, reqs = timed(eng)
        result["sections"]["draft"] = {"tok_s": total / secs, "vs_no_spec": base_s / secs,
                                       "tau": total / sum(r.stats.target_steps for r in reqs),
                                       "identical": all(r.output_ids == recordings[tuple(pr)]
                                                        for pr, r in zip(prompts, reqs))}
    result["complete"] = True
    save()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
