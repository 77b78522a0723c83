"""benchmarks/gpu_check.sh without a GPU: its syntax, its deadline (steps capped by the time left, skipped with a
message when too little is left, the whole run within the deadline) and its refusal to run on a torch or triton that
would shadow the GPU image's. The script runs from a copy in a temporary tree, with a fake ``python`` (and
``nvidia-smi``) first on PATH: every step's command is the fake, which sleeps as long as the test says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
# -c: the script's checks, answered at once (where torch and triton resolve from: FAKE_TORCH_FILE); anything else
# (a benchmark, the tests, a tool) is a step: it sleeps FAKE_SLEEP seconds
if [ "$1" = "-c" ]; then
    case "$2" in
        *__file__*) echo "${FAKE_TORCH_FILE}"; echo "/opt/image/site-packages/triton/__init__.py" ;;
    esac
    exit 0
fi
sleep "${FAKE_SLEEP:-0}"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="bash")


@pytest.fixture
def tree(tmp_path):
    """A working tree holding only the script, and a bin/ with the fakes."""
    (tmp_path / "tree" / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "tree" / "benchmarks" / "gpu_check.sh")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho 'name, NVIDIA Fake'\n")):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    return tmp_path


def _run(tree: Path, *, deadline: int, sleep: float, torch_file: str = "/opt/image/site-packages/torch/__init__.py"):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(
        PATH=f"{tree / 'bin'}:{env['PATH']}",
        ADDNORM_GPU_CHECK_SECONDS=str(deadline),
        FAKE_SLEEP=str(sleep),
        FAKE_TORCH_FILE=torch_file,
        OUT=str(tree / "out"),
    )
    t0 = time.monotonic()
    done = subprocess.run(
        ["bash", str(tree / "tree" / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=deadline + 60,
    )
    return done, time.monotonic() - t0


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_steps_past_the_deadline_are_skipped_with_a_message(tree):
    """A 12 s budget, 4 s steps: the environment runs, then nothing else fits its minimum: each is skipped, said so,
    and the run ends in time with status 3 (incomplete, nothing failed)."""
    done, wall = _run(tree, deadline=12, sleep=4)
    out = done.stdout
    assert done.returncode == 3, out + done.stderr
    assert re.search(r"== environment \(at most [89] s", out), out  # 12 less the 3 s reserve (less a second ticked)
    for name in ("registers and spills", "per-call overhead, bound launches", "Triton tests on CUDA", "graph-safety"):
        assert f"== {name}" in out and "skipped" in out.split(f"== {name}")[1].splitlines()[0], out
    assert "decode benchmark: skipped, benchmarks/bench_generate.py is not in this tree" in out
    assert "incomplete:" in out and wall < 12, (wall, out)
    assert (tree / "out" / "gpu.txt").exists()


def test_a_step_longer_than_the_time_left_is_stopped_at_its_cap(tree):
    """The first step would sleep 100 s: it is stopped when the deadline (less the summary's reserve) comes."""
    done, wall = _run(tree, deadline=10, sleep=100)
    assert re.search(r"environment: stopped at its [67] s cap", done.stdout), done.stdout
    assert done.returncode == 3 and wall < 10 + 6, (wall, done.stdout)  # + timeout's kill-after grace


def test_a_decode_benchmark_in_the_tree_is_run(tree):
    (tree / "tree" / "benchmarks" / "bench_generate.py").write_text("")
    done, _ = _run(tree, deadline=400, sleep=0)
    assert "== decode benchmark (generate) (at most 150 s" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout


def test_the_fused_norm_add_table_runs_after_the_add_rms_norm_table(tree):
    """Issue 37: the fused norm_add / norm_add_norm rows, under the deadline like every step."""
    done, _ = _run(tree, deadline=400, sleep=0)
    out = done.stdout
    assert "== norm_add / norm_add_norm table, fused beside unfused (at most 60 s" in out, out
    assert out.find("== add + RMSNorm table") < out.find("== norm_add / norm_add_norm table"), out


def test_refuses_a_torch_from_inside_the_tree(tree):
    carried = tree / "tree" / ".venv" / "lib" / "python3" / "site-packages" / "torch" / "__init__.py"
    done, _ = _run(tree, deadline=60, sleep=0, torch_file=str(carried))
    assert done.returncode == 2, done.stdout
    assert "refusing:" in done.stdout and "inside the working tree" in done.stdout, done.stdout
    assert "== environment" not in done.stdout


def test_refuses_a_carried_torch_or_triton_wheel(tree):
    (tree / "tree" / ".whl").mkdir()
    (tree / "tree" / ".whl" / "triton-3.6.0-cp311-cp311-manylinux_2_27_x86_64.whl").write_text("")
    done, _ = _run(tree, deadline=60, sleep=0)
    assert done.returncode == 2 and "would shadow the GPU image's" in done.stdout, done.stdout


def test_fake_python_is_what_the_script_ran(tree):
    """The harness: the script's python is the fake (else the tests above would measure a real run)."""
    env = {**os.environ, "PATH": f"{tree / 'bin'}:{os.environ['PATH']}"}
    which = subprocess.run(["bash", "-c", "command -v python"], capture_output=True, text=True, env=env).stdout
    assert which.strip() == str(tree / "bin" / "python") and sys.executable != which.strip()


def test_wide_rows_steps_run_first_when_asked(tree, monkeypatch):
    """ADDNORM_WIDE=1 (issue 28): the wide-row steps run right after the environment, each under the deadline."""
    monkeypatch.setenv("ADDNORM_WIDE", "1")
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "cuda" not in p))
    done, _ = _run(tree, deadline=60, sleep=0)
    out = done.stdout
    order = [out.find(s) for s in ("== environment", "== wide rows: GPU tests", "== wide rows: add + RMSNorm and")]
    assert -1 not in order and order == sorted(order), out
    assert out.find("== wide rows: device kernels per call") < out.find("== registers and spills"), out
    assert "ncu DRAM bytes" in out, out  # run, or skipped with a message where ncu is not on PATH
