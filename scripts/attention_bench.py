"""Time the row-invariant attentions (canonical_attention in PyTorch ops, and the C++ row_attention where it
builds) against PyTorch's SDPA, one layer call, Qwen2.5-1.5B's head layout (12 query heads, 2 key/value heads, head
dim 128), bf16 keys/values, float32 math. The plan of canonical_attention (once per forward) is not timed.

    python scripts/attention_bench.py [--threads 1]

Prints the CPU model and, per (query rows, key columns), the best of 30 calls of each and their ratios to SDPA.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from specstream.kernels import row_attention
from specstream.kernels.tree_attention import attention_bias, canonical_attention, canonical_plan, tree_mask

HQ, HKV, D = 12, 2, 128


def _best(fn, n: int = 30) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{_cpu()}, {args.threads} thread(s)")
    cpp = row_attention.unavailable_reason() is None
    if not cpp:
        print(f"row_attention (C++): not timed, {row_attention.unavailable_reason()}")
    print("rows  keys  sdpa_ms  canonical_ms  ratio  cpp_ms  ratio")
    for t in (1, 4, 21):
        for prefix in (100, 500, 1000):
            s = prefix + t
            parents = [-1] + [max(0, i - 2) for i in range(1, t)]  # a tree with two branches
            anc = torch.zeros(1, t, t, dtype=torch.bool)
            depth: list[int] = []
            for j, p in enumerate(parents):
                depth.append(0 if p < 0 else depth[p] + 1)
                k = j
                while k >= 0:
                    anc[0, j, k] = True
                    k = parents[k]
            mask = tree_mask(torch.tensor([prefix]), anc, torch.tensor([t]), s)
            q = torch.randn(1, HQ, t, D).bfloat16()
            k = torch.randn(1, HKV, s, D).bfloat16()
            v = torch.randn(1, HKV, s, D).bfloat16()
            bias = attention_bias(mask, torch.float32)
            cols, pos = (prefix + torch.arange(t))[None], (prefix + torch.tensor(depth))[None]
            plan = canonical_plan(mask, cols, pos, HQ // HKV, [0] if t > 1 else None, t)
            sdpa = _best(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias,
                                                                scale=D**-0.5, enable_gqa=True).bfloat16())
            canon = _best(lambda: canonical_attention(q, k, v, plan, D**-0.5).bfloat16())
            line = f"{t:4d} {s:5d} {sdpa:8.3f} {canon:13.3f} {canon / sdpa:6.2f}"
            if cpp:
                key_pos = torch.arange(s)[None].clone()
                key_pos[0, prefix:] = pos[0]
                rk = _best(lambda: row_attention.row_attention(q, k, v, mask, key_pos, D**-0.5).bfloat16())
                line += f" {rk:7.3f} {rk / sdpa:6.2f}"
            print(line)


if __name__ == "__main__":
    main()
