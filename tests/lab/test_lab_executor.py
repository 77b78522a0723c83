"""The lab's executor: ctx.map on worker processes gives what it gives in this process (bitwise), in task order;
the task cache resumes a killed experiment; drivers overlap while they wait; Ctrl-C stops the pool."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from addnorm.lab import runner
from addnorm.lab.core import Context, Experiment, Result, verdict_from
from addnorm.lab.executor import Cancelled, Executor
from addnorm.lab.runner import RunOptions, run
from addnorm.lab.tasks import TaskCache, run_task


# --------------------------------------------------------------------- task functions (module level: picklable)
def train_tiny(seed: int, steps: int = 5) -> dict:
    """A tiny deterministic training: what lab tasks do, small."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    x = torch.randn(16, 8, generator=g)
    losses = []
    for _ in range(steps):
        loss = (torch.tanh(x @ w) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
        losses.append(loss.item())
    return {"seed": seed, "losses": losses, "pair": (seed, 0.1 * seed), "inf": float("inf")}


def unseeded(i: int) -> list:
    """Forgets to seed: the executor's seeding makes it deterministic anyway (and equal in a worker and here)."""
    return [
        torch.rand(3).tolist(),
        float(np.random.rand()),
        random.random(),
        torch.get_num_threads(),
        i,
        str(torch.get_default_dtype()),
        torch.is_grad_enabled(),
    ]


def touch(directory: str, name: str, value: int) -> int:
    """Leaves a marker (how many times a task ran), returns ``value``."""
    path = Path(directory) / name
    path.write_text(path.read_text() + "x" if path.exists() else "x")
    return value * 2


def wait_for(path: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def create(path: str) -> bool:
    Path(path).write_text("here")
    return True


def sleep_then(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def boom(i: int) -> int:
    if i == 2:
        raise ValueError(f"task {i} failed on purpose")
    return i


def not_json(i: int) -> object:
    return {"x": object()}


# -------------------------------------------------------------------------------------------------- mapper
@pytest.fixture(scope="module")
def pool2():
    """One 2-worker pool for the tests that do not stop it (starting workers costs seconds on a loaded machine)."""
    with Executor(2) as ex:
        yield ex


@pytest.fixture(params=[1, 2], ids=["jobs1", "jobs2"])
def executor(request, pool2):
    if request.param == 2:
        yield pool2
    else:
        with Executor(1) as ex:
            yield ex


def test_map_results_in_task_order_equal_the_plain_calls(executor):
    tasks = [{"seed": s, "steps": 3 + s % 2} for s in range(5)]
    done_before = executor.tasks_done
    got = executor.map(train_tiny, tasks)
    expected = [json.loads(json.dumps(train_tiny(**t))) for t in tasks]  # tuples come back as lists (JSON)
    assert got == expected
    assert got[0]["inf"] == float("inf") and got[3]["pair"] == [3, 0.30000000000000004]
    assert executor.tasks_done - done_before == 5 and executor.tasks_done == executor.tasks_total


def test_workers_and_this_process_agree_bitwise_even_for_a_task_that_does_not_seed(pool2):
    tasks = [{"i": i} for i in range(4)]
    torch.set_num_threads(2)  # the caller's settings; tasks get what a fresh worker has
    torch.set_default_dtype(torch.float64)
    try:
        with Executor(1) as one, torch.no_grad():
            here = one.map(unseeded, tasks)
        there = pool2.map(unseeded, tasks)
        assert torch.get_num_threads() == 2 and torch.get_default_dtype() == torch.float64
    finally:
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
    assert here == there and all(r[3] == 1 and r[5] == "torch.float32" and r[6] for r in here)
    assert here[0][:3] == here[1][:3]  # every task starts from the same seeded state


def test_running_tasks_here_does_not_change_what_the_driver_draws_next():
    torch.manual_seed(5)
    np.random.seed(5)
    expected = (torch.rand(2).tolist(), np.random.rand(), torch.rand(2).tolist(), np.random.rand())
    torch.manual_seed(5)
    np.random.seed(5)
    with Executor(1) as ex:
        a, b = torch.rand(2).tolist(), np.random.rand()
        ex.map(unseeded, [{"i": 0}])
        got = (a, b, torch.rand(2).tolist(), np.random.rand())
    assert got == expected


def test_a_failing_task_raises_its_error_in_the_driver(executor):
    with pytest.raises(ValueError, match="task 2 failed on purpose"):
        executor.map(boom, [{"i": i} for i in range(4)])
    assert executor.map(boom, [{"i": 1}]) == [1]  # the pool still works


def test_a_lambda_or_a_non_json_result_is_a_clear_error_with_any_jobs(executor):
    with pytest.raises(TypeError, match="module-level function"):
        executor.map(lambda i: i, [{"i": 1}])
    with pytest.raises(TypeError, match="not JSON-serializable"):
        executor.map(not_json, [{"i": 1}])
    with pytest.raises(ValueError, match="jobs"):
        Executor(0)


def test_task_cache_reuses_finished_tasks_and_a_bad_record_is_a_miss(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [{"directory": str(marks), "name": f"t{i}", "value": i} for i in range(3)]
    with Executor(1, cache_dir=tmp_path / "cache") as ex:
        assert ex.map(touch, tasks, salt="a") == [0, 2, 4]
        files = [ex.cache.path(ex.cache.key("a", touch, t)) for t in tasks]
    assert sorted(files) == sorted((tmp_path / "cache").iterdir())
    files[0].write_text("{")  # torn
    files[1].write_text('{"key": "another", "result": 2}')  # not this task's
    with Executor(2, cache_dir=tmp_path / "cache") as ex:
        assert ex.map(touch, tasks, salt="a") == [0, 2, 4]
    assert {p.name: p.read_text() for p in marks.iterdir()} == {"t0": "xx", "t1": "xx", "t2": "x"}
    with Executor(1, cache_dir=tmp_path / "cache") as ex:  # another salt (another experiment key): computed
        ex.map(touch, tasks[:1], salt="b")
        assert (marks / "t0").read_text() == "xxx"
        ex.forget("b")
    assert len(list((tmp_path / "cache").iterdir())) == 3
    with Executor(1, cache_dir=tmp_path / "cache", read_cache=False) as ex:  # --fresh: computed again
        ex.map(touch, tasks[2:], salt="a")
    assert (marks / "t2").read_text() == "xx"


def test_the_task_cache_key_depends_on_function_arguments_and_salt():
    c = TaskCache(None)
    k = c.key("s", touch, {"directory": "d", "name": "n", "value": 1})
    assert k == c.key("s", touch, {"value": 1, "name": "n", "directory": "d"})  # argument order does not matter
    assert k != c.key("t", touch, {"directory": "d", "name": "n", "value": 1})
    assert k != c.key("s", touch, {"directory": "d", "name": "n", "value": 2})
    assert k != c.key("s", create, {"directory": "d", "name": "n", "value": 1})
    with pytest.raises(TypeError, match="JSON-like"):
        c.key("s", touch, {"value": object()})


def test_run_task_gives_json_text_with_non_finite_floats():
    text = run_task(train_tiny, {"seed": 1, "steps": 1})
    assert json.loads(text)["inf"] == float("inf")


# ------------------------------------------------------------------------------------------ concurrent drivers
def test_drivers_overlap_while_they_wait_for_tasks(tmp_path, pool2):
    """A's task waits for a file that only B's task creates: it finishes only if B starts while A waits."""
    flag = str(tmp_path / "flag")
    with contextlib.nullcontext(pool2) as ex:
        calls = [lambda: ex.map(wait_for, [{"path": flag, "timeout": 60.0}]), lambda: ex.map(create, [{"path": flag}])]
        start = time.monotonic()
        assert ex.run_concurrently(calls) == [[True], [True]]
    assert time.monotonic() - start < 50


def _driver(ex: Executor, seed: int) -> list:
    torch.manual_seed(seed)
    before = torch.rand(2).tolist()
    mapped = ex.map(train_tiny, [{"seed": seed + k, "steps": 2} for k in range(3)])
    after = torch.rand(2).tolist()  # the driver's own RNG stream, whatever ran in between
    return [before, [m["losses"] for m in mapped], after]


def test_overlapping_drivers_give_what_serial_drivers_give(pool2):
    with Executor(1) as ex:
        serial = ex.run_concurrently([lambda s=s: _driver(ex, s) for s in range(4)])
    overlapped = pool2.run_concurrently([lambda s=s: _driver(pool2, s) for s in range(4)])
    assert overlapped == serial


def test_an_interrupt_in_one_driver_stops_the_pool_and_the_others():
    with Executor(2) as ex:

        def interrupted():
            raise KeyboardInterrupt

        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ex.run_concurrently([lambda: ex.map(sleep_then, [{"seconds": 60.0}]), interrupted])
        assert time.monotonic() - start < 30  # the 60 s task was killed, not waited for
        with pytest.raises(Cancelled):
            ex.map(touch, [{"directory": ".", "name": "never", "value": 1}])
    assert not [t for t in threading.enumerate() if t.name.startswith("addnorm-lab-driver")]


# ------------------------------------------------------------------------------------------- through the runner
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5f6a1d50000000049454e44ae426082"
)


def _mapping_experiment(name: str, n: int):
    def fn(ctx: Context) -> Result:
        drawn = torch.rand(1).item()  # the driver's own RNG (seeded by the runner)
        runs = ctx.map(train_tiny, [{"seed": ctx.seed * 100 + k, "steps": 2 + k % 3} for k in range(n)])
        final = [r["losses"][-1] for r in runs]
        ctx.figure_path("fig.png").write_bytes(PNG + json.dumps(final).encode())  # bytes depend on the results
        per_seed = {"final loss": final}
        return Result(
            verdict=verdict_from(sum(final) > 0.5),
            figures=["fig.png"],
            summary=f"{name} {sum(final)}",
            metrics={"per_seed": per_seed, "seeds": list(range(n)), "drawn": drawn},
            timings={"wall": time.perf_counter()},
        )

    return Experiment(name=name, claim=f"claim {name}", source="test", run=fn)


def mapping_registry() -> dict[str, Experiment]:
    return {
        e.name: e
        for e in (_mapping_experiment("few", 1), _mapping_experiment("many", 5), _mapping_experiment("some", 3))
    }


_TIMING_FIELDS = ("seconds", "timings", "cached")


def comparable(out: Path) -> dict:
    doc = json.loads((out / "results.json").read_text())
    doc["experiments"] = [{k: v for k, v in e.items() if k not in _TIMING_FIELDS} for e in doc["experiments"]]
    figures = {f: (out / f).read_bytes() for e in doc["experiments"] for f in e["figures"]}
    return {"experiments": doc["experiments"], "counts": doc["counts"], "figures": figures}


def test_jobs_1_and_jobs_2_give_identical_results_json_and_figures(tmp_path):
    reg = mapping_registry()
    one = run(RunOptions(out=tmp_path / "one", progress=False, device="cpu", jobs=1), reg)
    two = run(RunOptions(out=tmp_path / "two", progress=False, device="cpu", jobs=2), reg)
    assert one.meta["jobs"] == 1 and two.meta["jobs"] == 2
    assert comparable(tmp_path / "one") == comparable(tmp_path / "two")
    assert not list((tmp_path / "two" / "runs" / "tasks").glob("*.json"))  # finished experiments keep no tasks


RESUME_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from addnorm.lab.core import Experiment, Result

    MARKS = Path(os.environ["LAB_MARKS"])

    def task(k):
        (MARKS / f"t{k}").write_text((MARKS / f"t{k}").read_text() + "x" if (MARKS / f"t{k}").exists() else "x")
        if k == 3 and os.environ.get("LAB_DIE") == "1":
            os._exit(3)  # killed in the middle of the experiment: no cleanup
        return {"k": k, "sq": k * k}

    def long_experiment(ctx):
        out = ctx.map(task, [{"k": k} for k in range(5)])
        return Result(verdict="reproduced", metrics={"sq": [r["sq"] for r in out]})

    REGISTRY = {"long": Experiment(name="long", claim="c", source="s", run=long_experiment)}

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu", jobs=1), REGISTRY)
    """
)


def test_a_run_killed_in_the_middle_of_an_experiment_resumes_with_its_finished_tasks(tmp_path):
    script, out, marks = tmp_path / "resume_tasks.py", tmp_path / "out", tmp_path / "marks"
    script.write_text(RESUME_SCRIPT)
    marks.mkdir()
    env = dict(
        os.environ,
        LAB_MARKS=str(marks),
        LAB_DIE="1",
        PYTHONPATH=os.pathsep.join([str(Path(runner.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert len(list((out / "runs" / "tasks").glob("*.json"))) == 3  # tasks 0, 1, 2 finished before the kill
    env["LAB_DIE"] = "0"  # the same command again (as __main__: the task cache keys name the task's module)
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_text() for p in marks.iterdir()} == {"t0": "x", "t1": "x", "t2": "x", "t3": "xx", "t4": "x"}
    doc = json.loads((out / "results.json").read_text())
    assert doc["experiments"][0]["metrics"] == {"sq": [0, 1, 4, 9, 16]}
    assert not list((out / "runs" / "tasks").glob("*.json"))


def test_a_failing_task_makes_its_experiment_inconclusive_and_keeps_the_finished_tasks(tmp_path):
    def fails(ctx: Context) -> Result:
        ctx.map(boom, [{"i": i} for i in range(4)])
        return Result(verdict="reproduced", metrics={})

    reg = {"fails": Experiment(name="fails", claim="c", source="s", run=fails), **mapping_registry()}
    s = run(RunOptions(out=tmp_path, progress=False, device="cpu", jobs=2), reg)
    rec = {r["name"]: r for r in s.records}
    assert rec["fails"]["verdict"] == "inconclusive" and "task 2 failed on purpose" in rec["fails"]["error"]
    assert s.failed == ["fails"] and sorted(s.ran) == ["few", "many", "some"]
    assert len(list((tmp_path / "runs" / "tasks").glob("*.json"))) >= 2  # tasks 0 and 1 (3 maybe) kept


def test_progress_bar_never_shows_a_verdict(tmp_path, capsys):
    reg = mapping_registry()
    run(RunOptions(out=tmp_path, device="cpu", jobs=2, progress=True), reg)
    err = capsys.readouterr().err
    assert "tasks" in err and "many" in err
    assert "reproduced" not in err and "inconclusive" not in err


def test_progress_postfix_names_running_experiments_and_task_counts():
    p = runner.Progress(False, total=3)
    p.start("a")
    p.message("a", "seed 1")
    p.start("b")
    p.count_tasks(2, 7)
    assert p.postfix() == "a: seed 1; b | tasks 2/7"
    p.finish("a")
    p.message("a", "late message from a finished experiment")
    assert p.postfix() == "b | tasks 2/7"


# ------------------------------------------------------------------------------------------------- torchrun
TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from addnorm.lab.core import Experiment, Result, verdict_from

    MARKS = Path(os.environ["LAB_MARKS"])

    def task(seed):
        with open(MARKS / f"seed{seed}-rank{os.environ.get('LAB_RANK', 'none')}", "a") as f:
            f.write("x")
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(6, 6, generator=g)
        # what addnorm.train's loop looks at to decide to train data-parallel: a task must see a single process
        alone = not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
        return {"norm": float(torch.linalg.matrix_norm(w @ w)), "seed": seed, "alone": alone}

    def make(name, n):
        def fn(ctx):
            drawn = torch.rand(1).item()
            out = ctx.map(task, [{"seed": ctx.seed * 10 + k} for k in range(n)])
            ctx.figure_path("f.png").write_bytes(b"png " + repr([r["norm"] for r in out]).encode())
            value = sum(r["norm"] for r in out) / n
            return Result(verdict=verdict_from(value > 8), figures=["f.png"], summary=name,
                          metrics={"per_seed": {"norm": [r["norm"] for r in out]}, "drawn": drawn,
                                   "alone": [r["alone"] for r in out]})
        return fn

    REGISTRY = {n: Experiment(name=n, claim="c", source="s", run=make(n, k)) for n, k in (("a", 5), ("b", 1))}

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        os.environ["LAB_RANK"] = os.environ["RANK"]  # the tasks' workers inherit this, not torchrun's RANK
        s = run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu", jobs=1), REGISTRY)
        print(f"world {s.meta['world_size']} rank {os.environ.get('RANK')}", flush=True)  # one write: shared stdout
    """
)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_two_torchrun_ranks_split_the_tasks_and_give_the_single_process_results(tmp_path, monkeypatch):
    script, marks = tmp_path / "lab_torchrun.py", tmp_path / "marks"
    script.write_text(TORCHRUN_SCRIPT)
    marks.mkdir()
    src = str(Path(runner.__file__).parents[2])
    env = dict(
        os.environ,
        LAB_MARKS=str(marks),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    )
    import importlib

    monkeypatch.setenv("LAB_MARKS", str(marks))
    monkeypatch.syspath_prepend(str(tmp_path))  # importable by name: ctx.map's functions must be
    monkeypatch.delitem(sys.modules, "lab_torchrun", raising=False)
    module = importlib.import_module("lab_torchrun")
    run(RunOptions(out=tmp_path / "one", progress=False, device="cpu", jobs=1), module.REGISTRY)
    for p in marks.iterdir():
        p.unlink()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 rank 0" in proc.stdout and "world 2 rank 1" in proc.stdout
    # every task ran once, and both ranks ran some (rank r takes tasks r, r + 2, ...)
    ran = {p.name: p.read_text() for p in marks.iterdir()}  # "b" has one task: seed 0 again, on rank 0
    assert ran == {"seed0-rank0": "xx", "seed1-rank1": "x", "seed2-rank0": "x", "seed3-rank1": "x", "seed4-rank0": "x"}
    assert comparable(tmp_path / "one") == comparable(tmp_path / "two")
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["meta"]["world_size"] == 2
    assert all(all(e["metrics"]["alone"]) for e in two["experiments"])  # no task saw the ranks' process group
    # rank 1 wrote nothing into OUT: only rank 0's report, records and figures are there
    files = sorted(str(p.relative_to(tmp_path / "two")) for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert files == sorted(
        [".lock", "index.html", "report.md", "results.json"]
        + [f"runs/{e['name']}-{e['key']}/{f}" for e in two["experiments"] for f in ("f.png", "result.json")]
    )


def _metrics(out: Path) -> dict:
    return {e["name"]: e["metrics"] for e in json.loads((out / "results.json").read_text())["experiments"]}


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize(
    "engine, experiment",
    # branch-scaling: its probed runs train alone under the batched engine, with addnorm.train's loop as under
    # sequential (the loop is what joined the ranks' process group and trained data-parallel across two tasks)
    [("sequential", "warmup"), ("batched", "branch-scaling")],
)
def test_real_experiments_on_two_torchrun_ranks_give_the_single_process_numbers_bitwise(tmp_path, engine, experiment):
    one = tmp_path / "one"
    run(RunOptions(out=one, only=[experiment], quick=True, progress=False, device="cpu", jobs=1, engine=engine))
    src = str(Path(runner.__file__).parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "addnorm", "lab", "--quick", "--only", experiment, "--engine", engine, "--device", "cpu"]
    cmd += ["--no-progress", "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = _metrics(tmp_path / "two")
    assert json.loads((tmp_path / "two" / "results.json").read_text())["meta"]["world_size"] == 2
    assert two == _metrics(one)  # every number, to the last bit (json round-trips floats exactly)


def test_a_training_task_gives_the_same_bits_in_any_order_and_process(pool2):
    """Nothing a task leaves behind in its process (language and batch caches, RNGs, threads) changes another."""
    from addnorm.lab.experiments.training_setup import train_task

    tasks = [
        {"model": {"placement": p, "n_layers": 1}, "train": {"steps": 4, "lr": 4e-3, "seed": s}, "lang_seed": lang}
        for p, s, lang in (("post", 0, 0), ("pre", 1, 0), ("post", 1, 1), ("pre", 0, 1))
    ]
    forward = [run_task(train_task, t) for t in tasks]
    backward = [run_task(train_task, t) for t in reversed(tasks)][::-1]
    assert forward == backward
    assert pool2.map(train_task, list(reversed(tasks)))[::-1] == [json.loads(t) for t in forward]


def test_a_worker_drops_the_launchers_variables(monkeypatch):
    from addnorm.lab.tasks import single_process_environment

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    single_process_environment()
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(
        os.environ
    )
    assert os.environ["OMP_NUM_THREADS"] == "1"  # not the launcher's business: kept


def test_warm_up_starts_the_workers_before_the_first_task():
    with Executor(2) as ex:
        ex.warm_up()
        deadline = time.monotonic() + 120
        while len(getattr(ex._pool, "_processes", None) or {}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ex._pool._processes) == 2
    with Executor(1) as ex:
        ex.warm_up()
        assert ex._pool is None


def test_default_jobs_shares_the_cpus_among_the_ranks_on_one_machine(monkeypatch):
    from addnorm.lab import executor as E

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = E.default_jobs()
    assert alone >= 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert E.default_jobs() == max(1, alone // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(alone * 4))
    assert E.default_jobs() == 1
