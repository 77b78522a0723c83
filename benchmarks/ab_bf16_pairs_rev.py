"""In-process A/B of two versions of the bf16 pairs forward (addnorm.ops.cpu.bf16_pairs): the one at git revision
REV against the working tree's, alternating, at 4096 x 4096 bf16 RMSNorm in place with weight.
Usage: python benchmarks/ab_bf16_pairs_rev.py REV ROUNDS dram|cache
dram: % of torch.add(out=) measured in the same round (norm_add_norm_ credited 4 row transfers against 3), best of
10 per variant per round. cache: compute per row with the data in cache, one thread, the difference of 40-row and
8-row calls (launch overhead cancels), best of 200. Only bf16_pairs.py is taken from REV: what it imports
(bf16_words.py, the general kernels) is the working tree's on both sides."""

import importlib.util
import os
import statistics as st
import subprocess
import sys
import tempfile
import time

import torch

from addnorm.ops.cpu import bf16_pairs as PN
from addnorm.ops.cpu import norm_add_launch as L

rev, rounds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rev = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
src = subprocess.run(
    ["git", "show", f"{rev}:src/addnorm/ops/cpu/bf16_pairs.py"], capture_output=True, text=True, check=True
)
# one folder per revision, the file rewritten only when missing: numba's cache beside it (keyed on the file's path
# and mtime) then serves the next run of the same revision, rather than compiling it again (up to 14 minutes)
path = os.path.join(tempfile.gettempdir(), f"addnorm-ab-{rev[:12]}", "bf16_pairs_old.py")
if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(src.stdout)
spec = importlib.util.spec_from_file_location("bf16_pairs_old", path)
PO = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = PO  # (numba's cache names a kernel's module: one not in sys.modules can't be read back)
spec.loader.exec_module(PO)
incache = mode == "cache"
torch.manual_seed(0)
n = 4096
dt = torch.bfloat16
opts = dict(eps1=1e-6, eps2=1e-6, is_rms1=True, is_rms2=True, zc1=False, zc2=False, cast1=False, cast2=False)
if incache:
    torch.set_num_threads(1)
    import numba

    numba.set_num_threads(1)
    PO.MIN_ELEMENTS = PN.MIN_ELEMENTS = 0


def mk(m):
    y, r = torch.randn(m, n, dtype=dt), torch.randn(m, n, dtype=dt)
    w1, w2 = torch.randn(n, dtype=dt), torch.randn(n, dtype=dt)
    h = torch.empty_like(y)
    stats = torch.empty((4, m))
    return (
        lambda: torch.add(y, r, out=h),
        lambda: L.forward_into(r, None, stats, y, r, w1, None, None, None, has_norm2=False, **opts),
        lambda: L.forward_into(r, y, stats, y, r, w1, None, w2, None, has_norm2=True, **opts),
    )


def best(f, k):
    f()
    b = 1e9
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t0)
    return b


print("load", os.getloadavg())
R = {}
if incache:
    s1, a1, b1 = mk(8)
    s2, a2, b2 = mk(40)
    for _ in range(rounds):
        for tag, mod in (("old", PO), ("new", PN)):
            L.P = mod
            R.setdefault(f"{tag} na_ us/row", []).append((best(a2, 200) - best(a1, 200)) / 32 * 1e6)
            R.setdefault(f"{tag} nan_ us/row", []).append((best(b2, 200) - best(b1, 200)) / 32 * 1e6)
        print(" ".join(f"{k} {v[-1]:.2f}" for k, v in R.items()), flush=True)
    print("best:", " ".join(f"{k} {min(v):.2f}" for k, v in R.items()))
    print("median:", " ".join(f"{k} {st.median(v):.2f}" for k, v in R.items()))
else:
    s, a, b = mk(4096)
    for _ in range(rounds):
        for tag, mod in (("old", PO), ("new", PN)):
            L.P = mod
            t = best(s, 10)
            R.setdefault(f"{tag} na", []).append(t / best(a, 10))
            R.setdefault(f"{tag} nan", []).append(t * 4 / 3 / best(b, 10))
        print(" ".join(f"{k} {v[-1]:.0%}" for k, v in R.items()), flush=True)
    print("best:", " ".join(f"{k} {max(v):.0%}" for k, v in R.items()))
    print("median:", " ".join(f"{k} {st.median(v):.0%}" for k, v in R.items()))
print("load", os.getloadavg())
