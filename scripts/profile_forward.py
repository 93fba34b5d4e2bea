"""Op profile of one decoder forward at batch 1: a decode step (1 row) and a tree verification (21 rows).

``python scripts/profile_forward.py CHECKPOINT [--dtype int4] [--threads 1,2] [--profile-threads 1]``

CHECKPOINT is anything ``load_decoder`` takes (a converted folder, a .gguf file). The quantized model is loaded
once without fused projections and deep-copied with them (``LlamaDecoder.fuse_projections``), so the two are
timed in one process, interleaved (5 repeats of 3 forwards, medians), after checking that their logits are equal.
Then ``torch.profiler`` tables the self CPU time by op for each (what share the packed products take, what is
host-side small-op work). Only for reading: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def _tree(prefix: int, nodes: int, vocab: int):
    from specstream.kernels.tree_attention import build_tree_mask
    from specstream.stages.speculative.models.llama import ForwardBatch

    from specstream.pipeline.bench.gpu import probe_tree

    anc, depth = probe_tree(nodes)  # the tree bench_gpu times
    mask = build_tree_mask(torch.tensor([prefix]), [anc], prefix + nodes, nodes)
    return ForwardBatch(torch.tensor([0]), torch.randint(0, vocab, (1, nodes)), (prefix + torch.tensor(depth))[None],
                        torch.arange(prefix, prefix + nodes)[None], mask, slot_list=[0])


def _prefilled(model, prefix: int = 64):
    from specstream.kernels.tree_attention import build_tree_mask
    from specstream.stages.speculative.models.llama import ForwardBatch

    torch.manual_seed(1)
    cache = model.new_cache(1, prefix + 64)
    ids = torch.randint(0, model.config.vocab_size, (1, prefix))
    mask = build_tree_mask(torch.tensor([0]), [torch.ones(prefix, prefix, dtype=torch.bool).tril()], prefix, prefix)
    model.forward_batch(cache, ForwardBatch(torch.tensor([0]), ids, torch.arange(prefix)[None],
                                            torch.arange(prefix)[None], mask, logit_index=torch.tensor([[prefix - 1]]),
                                            slot_list=[0]))
    return cache, _tree(prefix, 1, model.config.vocab_size), _tree(prefix, 21, model.config.vocab_size)


def _median_s(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from specstream.stages.speculative.models.llama import LlamaDecoder
    from specstream.stages.speculative.models.loader import load_decoder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--threads", default="1,2", help="thread counts of the timed A/B, comma-separated")
    ap.add_argument("--profile-threads", type=int, default=1)
    args = ap.parse_args(argv)
    fuse = LlamaDecoder.fuse_projections
    LlamaDecoder.fuse_projections = lambda self: 0  # load the separate projections
    try:
        plain = load_decoder(args.checkpoint, args.dtype)
    finally:
        LlamaDecoder.fuse_projections = fuse
    fused = copy.deepcopy(plain)
    print("fused projections:", fused.fuse_projections())
    runs = {"separate": (plain, *_prefilled(plain)), "fused": (fused, *_prefilled(fused))}
    (_, ca, oa, ta), (_, cb, ob, tb) = runs["separate"], runs["fused"]
    same = (torch.equal(plain.forward_batch(ca, oa)[0], fused.forward_batch(cb, ob)[0])
            and torch.equal(plain.forward_batch(ca, ta)[0], fused.forward_batch(cb, tb)[0]))
    print("logits equal:", same)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for what, idx in (("decode, 1 row", 2), ("tree, 21 rows", 3)):
            times = {k: [] for k in runs}
            for _ in range(5):
                for k, (m, c, *batches) in runs.items():
                    times[k].append(_median_s(lambda: m.forward_batch(c, batches[idx - 2])))
            print(f"{threads} thread(s), {what}: " + ", ".join(
                f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in times.items()))
    torch.set_num_threads(args.profile_threads)
    with torch.profiler.profile():  # the profiler's own first-use cost stays out of the tables
        plain.forward_batch(ca, oa)
    for what, idx in (("decode, 1 row", 2), ("tree, 21 rows", 3)):
        for k, (m, c, *batches) in runs.items():
            wall = _median_s(lambda: m.forward_batch(c, batches[idx - 2]), 5)
            with torch.profiler.profile() as prof:
                for _ in range(3):
                    m.forward_batch(c, batches[idx - 2])
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events)
            print(f"\n{k}, {what}, {args.profile_threads} thread(s): {1e3 * wall:.1f} ms wall (unprofiled median), "
                  f"{total / 3e3:.1f} ms self CPU in aten ops per forward ({sum(e.count for e in events) // 3} ops); "
                  f"the rest, Python and dispatch, is about {max(0.0, 1e3 * wall - total / 3e3):.1f} ms")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
                print(f"  {e.key:50s} {e.self_cpu_time_total / 3e3:8.2f} ms {100 * e.self_cpu_time_total / total:5.1f} %"
                      f"  {e.count // 3} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
