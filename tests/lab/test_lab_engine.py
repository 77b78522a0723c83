"""``addnorm lab --engine``: the training experiments' runs under the sequential engine (exactly ``ctx.map(train_task,
tasks)``) and the batched one (groups trained by train_batched, equal to train_task up to float rounding); the
engine in the cache key, results.json, the report header and merge.

Tolerance of the batched-vs-sequential comparison: tests/train/test_train_batched.py's (rtol 1e-4, atol 1e-5),
argued there: the same float32 math in another summation order, carried through a few Adam steps at lr <= 1e-2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from addnorm.lab import cache, runner
from addnorm.lab.core import Context, serial_map
from addnorm.lab.experiments import training_batch as B
from addnorm.lab.experiments.training_setup import train_task
from addnorm.lab.merge import MergeConflictError, merge
from tests.lab.lab_fakes import make_registry, opts

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _task(seed=0, lr=3e-3, steps=4, model=None, **kw):
    train = {"steps": steps, "lr": lr, "warmup": 1, "seed": seed, **kw.pop("train", {})}
    return {"model": model or {"n_layers": 1}, "train": train, "lang_seed": 0, **kw}


# ------------------------------------------------------------------------------------------------ grouping
def test_plan_groups_seeds_and_lrs_of_one_architecture_and_leaves_the_rest_alone():
    tasks = [
        _task(0),  # 0 \
        _task(1, lr=1e-2),  # 1  > one group: seeds and LRs may differ
        _task(0, model={"n_layers": 1, "placement": "post"}),  # 2: another architecture ...
        _task(2, train={"warmup": 3, "clip": 0.5, "z_loss": 1e-4}),  # 3: per-member warmup, clip, z-loss: group 0
        _task(0, model={"n_layers": 1, "placement": "post-noskip"}),  # 4: StackedLM does not cover it
        _task(1, model={"n_layers": 1, "placement": "post"}),  # 5: ... with its partner
        _task(3, probe="some.module:fn"),  # 6: a probe may hook the model
        _task(4, init_record=True),  # 7: train()'s Monitor record has fields the batched one lacks
        _task(5, steps=5),  # 8: another step count: no partner, alone
        {**_task(6), "lang_seed": 1},  # 9: another language: alone
        _task(7, hidden_probe=True, layer_grads=True, track_mean_logit=True),  # 10: batched options: group 0
        _task(8, train={"out_dir": "/tmp/x"}),  # 11: logs and checkpoints: alone
        _task(0, model={"n_layers": 1, "vocab_size": 4096}),  # 12 \ an output layer too large to gain: alone
        _task(1, model={"n_layers": 1, "vocab_size": 4096}),  # 13 /
    ]
    assert B.plan(tasks) == [[0, 1, 3, 10], [2, 5], [4], [6], [7], [8], [9], [11], [12], [13]]
    assert B.group_key(tasks[0]) == B.group_key(tasks[1]) != B.group_key(tasks[2])
    assert B.group_key(tasks[4]) is None and B.group_key(tasks[6]) is None and B.group_key(tasks[11]) is None


def test_plan_splits_large_groups_into_near_equal_chunks_in_order():
    tasks = [_task(s) for s in range(9)] + [_task(0, model={"n_layers": 1, "placement": "post"})]
    assert B.plan(tasks, max_members=8) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert B.plan(tasks[:9], max_members=3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert max(len(u) for u in B.plan([_task(s) for s in range(40)])) <= B.MAX_MEMBERS


# ------------------------------------------------------------------------------------------------ results
def _close(a, b, path=""):
    """a == b for everything but floats, which agree to RTOL/ATOL; same keys and lengths."""
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for x, y in zip(a, b):
            _close(x, y, path)
    elif isinstance(a, float) and not isinstance(b, bool):
        assert math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_a_batched_group_gives_each_run_train_tasks_dict_to_float_rounding():
    monitor = {"monitor": True, "monitor_every": 2}
    tasks = [
        _task(s, lr=lr, steps=6, model={"n_layers": 2, "record_logits": True}, train=monitor, **options)
        for s, lr, options in [
            (0, 1e-3, {"hidden_probe": True, "layer_grads": True}),
            (1, 3e-3, {"track_mean_logit": True, "curve_points": 3}),
            (2, 1e-2, {"hidden_probe": True, "track_mean_logit": True, "layer_grads": True}),
        ]
    ]
    batched = B.train_group_task(tasks=tasks)
    assert len(batched) == 3
    for got, task in zip(batched, tasks):
        want = train_task(**task)
        _close(got, want)
        assert got["max_attn_logit"] is not None and got["steps_done"] == 6
    assert batched[0]["loss_curve"] != batched[1]["loss_curve"][:3]  # members are distinct runs


def test_a_unit_of_one_is_train_task_bitwise_and_a_mixed_unit_is_refused():
    task = _task(3, probe=None)
    assert B.train_group_task(tasks=[task]) == [train_task(**task)]
    with pytest.raises(ValueError, match="tasks of one group"):
        B.train_group_task(tasks=[_task(0), _task(1, model={"n_layers": 1, "placement": "post"})])


def test_sequential_engine_is_exactly_ctx_map_of_train_task():
    calls = []

    def mapper(fn, tasks):
        calls.append((fn, tasks))
        return [{"i": i} for i in range(len(tasks))]

    tasks = [_task(0), _task(1)]
    ctx = Context(mapper=mapper)
    assert ctx.engine == "sequential"
    assert B.train_runs(ctx, tasks) == [{"i": 0}, {"i": 1}]
    assert calls == [(train_task, tasks)]


def test_batched_engine_returns_the_results_in_task_order():
    calls = []

    def mapper(fn, tasks):
        calls.append((fn, len(tasks)))
        return serial_map(fn, tasks)

    tasks = [
        _task(0),
        _task(0, model={"n_layers": 1, "placement": "post"}),
        _task(1),
        _task(1, model={"n_layers": 1, "placement": "post"}),
        _task(2, model={"n_layers": 1, "placement": "post-noskip"}),
    ]
    got = B.train_runs(Context(mapper=mapper, engine="batched"), tasks)
    assert calls == [(B.train_group_task, 3)]  # one ctx.map call: two groups of 2 and one run alone
    for g, task in zip(got, tasks):
        _close(g, train_task(**task))
    assert got[4] == train_task(**tasks[4])  # the run that trains alone is the sequential task itself


def test_context_refuses_an_unknown_engine():
    with pytest.raises(ValueError, match=r"engine \(--engine\) must be one of sequential, batched, got 'fast'"):
        Context(engine="fast")


# ------------------------------------------------------------------------------------------------ runner, cache, cli
def test_cache_keys_differ_by_engine_and_the_sequential_key_is_unchanged():
    exp = make_registry({}, n=1)["fake-0"]
    kw = dict(quick=True, seed=0, device=torch.device("cpu"))
    seq = runner.experiment_key(exp, **kw)
    assert seq == runner.experiment_key(exp, engine="sequential", **kw) == cache.cache_key(exp, **kw)
    assert runner.experiment_key(exp, engine="batched", **kw) != seq
    with pytest.raises(ValueError, match="engine"):
        runner.experiment_key(exp, engine="nope", **kw)


def test_a_batched_run_never_reuses_a_sequential_result_and_is_recorded(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=2)
    seen = []
    reg["fake-0"].run = (lambda f: lambda ctx: seen.append(ctx.engine) or f(ctx))(reg["fake-0"].run)
    out = tmp_path / "o"
    runner.run(opts(out, jobs=1), reg)
    runner.run(opts(out, jobs=1), reg)  # cached
    assert calls == {"fake-0": 1, "fake-1": 1}
    summary = runner.run(opts(out, jobs=1, engine="batched"), reg)
    assert calls == {"fake-0": 2, "fake-1": 2} and summary.reused == []
    assert seen == ["sequential", "batched"]
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["engine"] == "batched"
    report = (out / "report.md").read_text()
    assert "engine batched" in report and "float rounding" in report
    assert "engine batched" in (out / "index.html").read_text()
    runner.run(opts(out, jobs=1), reg)  # back to sequential: its own cache entries are still there
    assert calls == {"fake-0": 2, "fake-1": 2}
    assert "engine sequential" in (out / "report.md").read_text()


def test_merge_refuses_shards_of_different_engines(tmp_path):
    reg = make_registry({}, n=2)
    runner.run(opts(tmp_path / "a", jobs=1, shard=(1, 2)), reg)
    runner.run(opts(tmp_path / "b", jobs=1, shard=(2, 2), engine="batched"), reg)
    with pytest.raises(MergeConflictError, match="engine='batched'"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")


def test_run_options_refuse_an_unknown_engine(tmp_path):
    with pytest.raises(ValueError, match=r"engine \(--engine\) must be one of sequential, batched, got 'gpu'"):
        opts(tmp_path, engine="gpu")


def test_cli_engine_option(tmp_path, monkeypatch, capsys):
    from addnorm.cli import main

    calls: dict[str, int] = {}
    monkeypatch.setattr(runner, "load_experiments", lambda: make_registry(calls, n=1))
    out = tmp_path / "o"
    assert main(["lab", "--out", str(out), "--no-progress", "--device", "cpu", "--engine", "batched"]) == 0
    assert json.loads((out / "results.json").read_text())["meta"]["engine"] == "batched"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["lab", "--out", str(out), "--engine", "fast"])
    assert exc.value.code == 2
    assert "argument --engine: invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--engine {sequential,batched}" in text and "float rounding" in text and "docs/lab-results.md" in text
