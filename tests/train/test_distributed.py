"""Data-parallel training: two gloo processes on CPU (torchrun) follow the single-process loss curve."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from addnorm.train import distributed as D

ARGS = [
    "train",
    "--preset",
    "gpt2",
    "--set",
    "d_model=16",
    "--set",
    "n_layers=2",
    "--set",
    "n_heads=2",
    "--set",
    "backend=torch",
    "--steps",
    "8",
    "--batch-size",
    "8",
    "--seq-len",
    "8",
    "--warmup",
    "2",
    "--lr",
    "1e-2",
    "--quiet",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_slices_are_disjoint_and_cover_the_batch():
    rows = [D.local_slice(8, D.DistInfo(rank=r, world_size=4)) for r in range(4)]
    assert [list(range(8))[s] for s in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="divisible"):
        D.local_slice(6, D.DistInfo(rank=0, world_size=4))


def test_single_process_is_rank_zero_of_one():
    info = D.init_from_env()
    assert (info.rank, info.world_size, info.is_main, info.enabled) == (0, 1, True, False)
    assert float(D.mean_across_ranks(torch.tensor(3.0), info)) == 3.0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_two_gloo_processes_match_one(tmp_path):
    from addnorm.cli import main

    assert main([*ARGS, "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "addnorm",
        *ARGS,
        "--out",
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())

    assert two["world_size"] == 2 and one["world_size"] == 1
    # same global batch, gradients averaged over equal halves: equal up to reduction order
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
    assert two["summary"]["final_loss"] == pytest.approx(one["summary"]["final_loss"], rel=1e-4)
