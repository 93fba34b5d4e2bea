"""Time the int4 VNNI kernel (kernels/int4_vnni.py) against PyTorch's ``_weight_int4pack_mm_for_cpu`` on
Qwen2.5-1.5B's int4 shapes (fused qkv, o, fused gate/up, down, the tied 151936-row head), weights cold in memory.

    python scripts/int4_kernel_bench.py [--threads 2] [--rows 1,2,4,8,21] [--out results.json]

Each call reads a different copy of the weight (copies enough to exceed 600 MB), so the figures are DRAM-bound as
in a real decode step, not cache-warm. Prints the CPU, its read bandwidth, and per (shape, rows) the mean time of
each kernel over the copies (best of 2 passes), its effective read rate and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specstream.kernels import int4_vnni
from specstream.kernels.quant import _pack_int4, quantize_int4
from specstream.pipeline.bench.harness import machine_info, machine_line

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "lm_head": (151936, 1536)}


def _mean_ms(fn, copies: int) -> float:
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / copies)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,21")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not int4_vnni.available():
        raise SystemExit(f"the int4 VNNI kernel is not available here: {int4_vnni.unavailable_reason()}")
    info = machine_info(args.threads)
    print(machine_line(info))
    print("shape      rows  torch_ms  vnni_ms  torch_GB/s  vnni_GB/s  speed-up")
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q, sz = quantize_int4(torch.randn(n, k, generator=gen) * 0.02, 32)
        sz = sz.to(torch.bfloat16)
        nbytes = n * k // 2 + n * (k // 32) * 4  # codes + bf16 scale and zero per group, both layouts
        copies = max(3, int(600e6 // nbytes))
        ours = [int4_vnni.pack(q, sz) for _ in range(copies)]
        packed = _pack_int4(q)
        theirs = [packed.clone() for _ in range(copies)]
        del packed
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            t_ours = _mean_ms(lambda i: int4_vnni.mm(x, ours[i]), copies)
            t_torch = _mean_ms(lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, theirs[i], 32, sz), copies)
            row = {"shape": name, "n": n, "k": k, "rows": m, "torch_ms": t_torch, "vnni_ms": t_ours,
                   "torch_gb_s": nbytes / t_torch / 1e6, "vnni_gb_s": nbytes / t_ours / 1e6,
                   "speedup": t_torch / t_ours}
            results.append(row)
            print(f"{name:9s} {m:5d} {t_torch:9.3f} {t_ours:8.3f} {row['torch_gb_s']:11.1f} {row['vnni_gb_s']:10.1f}"
                  f"  {row['speedup']:7.2f}x", flush=True)
        del ours, theirs
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
