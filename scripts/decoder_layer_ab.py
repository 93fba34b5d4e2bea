"""A/B of the C++ decoder layer against the PyTorch layer on the real int4 pair, in one process.

``python scripts/decoder_layer_ab.py [--rounds 6] [--threads 2]``

Prints the CPU and its read bandwidth, then, alternating the two layer paths round by round (medians):

- forwards of the 1.5B target and of the 0.5B draft after a 48-token prefill: 1 row (a decode step) and 5 rows
  (a chain-of-4 verification);
- the whole engine without speculation: 40 tokens of the code prompt (tokens/s, and whether the two paths wrote
  the same tokens: they may part at a near tie, ``docs/models.md``).

Needs the real weights (``specstream models fetch``) and an AVX-512 VNNI CPU. Only for reading: nothing here is
asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _forwards(model, rows: int, reps: int = 3) -> float:
    """Seconds of one forward of ``rows`` new tokens after a 48-token prefill (best of ``reps``)."""
    from specstream.kernels.tree_attention import build_tree_mask
    from specstream.stages.speculative.models.llama import ForwardBatch

    prefix = 48
    cache = model.new_cache(1, prefix + 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (1, prefix), generator=g)

    def batch(start, t, tokens):
        pos = torch.arange(start, start + t)[None]
        mask = build_tree_mask(torch.tensor([start]), [torch.ones(t, t, dtype=torch.bool).tril()], start + t, t)
        return ForwardBatch(torch.tensor([0]), tokens, pos, pos.clone(), mask, slot_list=[0], row_invariant=True)

    model.forward_batch(cache, batch(0, prefix, ids))
    step = torch.randint(0, 150000, (1, rows), generator=g)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward_batch(cache, batch(prefix, rows, step))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    from specstream.pipeline.bench.harness import machine_info, machine_line
    from specstream.pipeline.bench.spec_real import DRAFT, TARGET, _engine, prompt_ids
    from specstream.pipeline.models_fetch import install
    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint
    from specstream.stages.speculative.models.loader import load_decoder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install()
    print(machine_line(machine_info(args.threads)))
    target, draft = resolve_checkpoint(TARGET).path, resolve_checkpoint(DRAFT).path
    models = {"1.5B target": load_decoder(target, "int4"), "0.5B draft": load_decoder(draft, "int4")}
    if any(m.fused_layer_args() is None for m in models.values()):
        print("the C++ decoder layer does not run here; nothing to compare")
        return 1
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for fused in ((True, False) if r % 2 else (False, True)):
            for name, model in models.items():
                model._fused_args = None if fused else False
                for rows in (1, 5):
                    times.setdefault((name, rows, fused), []).append(_forwards(model, rows))
    for name in models:
        for rows in (1, 5):
            a = statistics.median(times[(name, rows, False)])
            b = statistics.median(times[(name, rows, True)])
            print(f"{name}, {rows} row(s): PyTorch layers {a * 1e3:.1f} ms, C++ layers {b * 1e3:.1f} ms, "
                  f"{a / b:.2f}x")
    del models
    engine = _engine(target, draft, None, None, 1, 400, True, "int4")
    ids = prompt_ids(target, ["code"])["code"]
    model = engine.executor.target
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[int]] = {}
    engine.generate([ids], 4, speculate=False)
    for r in range(args.rounds):
        for fused in ((True, False) if r % 2 else (False, True)):
            model._fused_args = None if fused else False
            t0 = time.perf_counter()
            out = engine.generate([ids], 40, speculate=False)[0].output_ids
            rates[fused].append(len(out) / (time.perf_counter() - t0))
            outputs.setdefault(fused, out)
    a, b = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"engine, no speculation, code prompt, 40 tokens end to end: PyTorch layers {a:.2f} tokens/s, "
          f"C++ layers {b:.2f} tokens/s, {b / a:.2f}x; same tokens: {outputs[True] == outputs[False]}")
    print(machine_line(machine_info(args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
