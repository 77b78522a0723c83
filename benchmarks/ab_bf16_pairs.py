"""In-process A/B of the bf16 pairs forward (addnorm.ops.cpu.bf16_pairs) against the general kernels at 4096 x 4096
bf16 RMSNorm, in place: alternating, best of 10 per variant per round, each as a fraction of torch.add(out=) measured
in the same round. Usage: python benchmarks/ab_bf16_pairs.py ROUNDS PREFETCH_ROWS[,PREFETCH_ROWS...]"""

import os
import statistics as st
import sys
import time

import numba
import torch

if os.environ.get("CHUNK"):  # numba's prange chunk size (dynamic scheduling): tried, no gain
    numba.set_parallel_chunksize(int(os.environ["CHUNK"]))
from addnorm.ops.cpu import bf16_pairs as P
from addnorm.ops.cpu import norm_add_launch as L

torch.manual_seed(0)
m = n = 4096
dt = torch.bfloat16
y, r = torch.randn(m, n, dtype=dt), torch.randn(m, n, dtype=dt)
w1, w2 = torch.randn(n, dtype=dt), torch.randn(n, dtype=dt)
h_pre = torch.empty_like(y)
stats = torch.empty((4, m))
opts = dict(eps1=1e-6, eps2=1e-6, is_rms1=True, is_rms2=True, zc1=False, zc2=False, cast1=False, cast2=False)
yi, ri = y.clone(), r.clone()


def stream():
    torch.add(y, r, out=h_pre)


def na_():
    L.forward_into(ri, None, stats, yi, ri, w1, None, None, None, has_norm2=False, **opts)


def nan_():
    L.forward_into(ri, yi, stats, yi, ri, w1, None, w2, None, has_norm2=True, **opts)


def best(f, k=10):
    f()
    b = 1e9
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t0)
    return b


variants = [("old", 1 << 62, 0)] + [(f"pf{p}", 1 << 20, p) for p in map(int, sys.argv[2].split(","))]
print("load", os.getloadavg())
R = {}
for _round in range(int(sys.argv[1])):
    s = best(stream)
    for tag, thr, pf in variants:
        P.MIN_ELEMENTS, P.PREFETCH_ROWS = thr, pf
        R.setdefault(f"{tag} na", []).append(s / best(na_))
        R.setdefault(f"{tag} nan", []).append(s * 4 / 3 / best(nan_))
    print(" ".join(f"{k} {v[-1]:.0%}" for k, v in R.items()), flush=True)
print("best:", " ".join(f"{k} {max(v):.0%}" for k, v in R.items()))
print("median:", " ".join(f"{k} {st.median(v):.0%}" for k, v in R.items()))
print("load", os.getloadavg())
