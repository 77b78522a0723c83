"""The training experiments of the lab: the shared training task and its helpers, the formulas the verdicts use,
and one quick run of each experiment through ctx.map. The rules themselves are tested in test_lab_claims_*.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS, Context, serial_map
from addnorm.lab.experiments import deepnet_depth as D
from addnorm.lab.experiments import rmsnorm as N
from addnorm.lab.experiments import training_setup as C
from addnorm.lab.experiments import wortsman as L

NAMES = ("warmup", "depth-sweep", "lr-sensitivity", "z-loss", "ln-vs-rms-training")


NAMES = ("warmup", "depth-sweep", "lr-sensitivity", "z-loss", "ln-vs-rms-training")


def test_all_training_experiments_are_registered_with_criterion_precondition_and_public_source():
    import addnorm.lab.experiments  # noqa: F401 - registers everything in MODULES

    for name in NAMES:
        exp = EXPERIMENTS[name]
        assert exp.claim and exp.criterion and exp.precondition and exp.kind == "empirical", name
        assert "arXiv:" in exp.source and "seed 0" not in exp.source and "stability.md" not in exp.source, name
        assert exp.config["default"]["seeds"] >= 3, name  # every training verdict rests on >= 3 seeds


def test_seeds_needed_is_a_strict_majority_and_at_least_two():
    assert [C.seeds_needed(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 3, 4]


def test_excess_caps_a_diverged_run_at_its_initial_loss():
    assert C.excess(None, 3.5, 1.0) == pytest.approx(2.5)
    assert C.excess(math.nan, 3.5, 1.0) == pytest.approx(2.5)
    assert C.excess(1.25, 3.5, 1.0) == pytest.approx(0.25)
    assert C.excess(5.0, 3.5, 1.0) == pytest.approx(2.5)  # never above the initial loss


# ---- learning-rate sensitivity --------------------------------------------------------------------------------
def test_lr_sensitivity_formula():
    # loss_0 = 4; best = 1; capped losses: 2, 1, 4 (5 capped), 4 (diverged) -> mean of (1, 0, 3, 3) = 1.75
    assert L.lr_sensitivity([2.0, 1.0, 5.0, math.nan], [4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.75)
    assert L.lr_sensitivity([2.0, 1.0, 5.0, None], [4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.75)
    assert L.lr_sensitivity([1.0, 1.0], [3.0, 3.0]) == 0.0


# ---- the task -------------------------------------------------------------------------------------------------
def test_ratio_ci():
    g, lo, hi = N.ratio_ci([2.0] * 5, [1.0] * 5)
    assert g == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    g, lo, hi = N.ratio_ci([1.0, 1.0, 1.0, 1.0], [0.9, 1.1, 0.95, 1.05])
    assert lo < g < hi and lo < 1.0 < hi
    with pytest.raises(ValueError, match="at least 3"):
        N.ratio_ci([1.0], [1.0])


def test_speed_is_a_benchmark_reading_not_a_verdict():
    rows = N.speed_rows(
        {"a": (0.5, 0.48, 0.52), "b": (1.2, 1.1, 1.3), "c": (1.04, 0.98, 1.1), "d": (math.nan, 0.4, 0.6)}
    )
    assert rows == {"a": "no slower", "b": "slower", "c": "undecided", "d": "n/a"}


def test_norm_timing_task_times_four_matched_implementations_interleaved():
    out = N.norm_timing_task(rows=8, hidden=64, reps=3, seed=0)
    assert set(out) == {"plain", "addnorm"} and all(len(out[p][k]) == 3 for p in out for k in ("ln", "rms"))
    assert all(t > 0 for p in out for k in out[p] for t in out[p][k])
    json.dumps(out)
    x = torch.randn(4, 64, dtype=torch.float64)
    w, b = torch.rand(64, dtype=torch.float64) + 0.5, torch.randn(64, dtype=torch.float64)
    ref = torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5)
    assert torch.allclose(N._written_out_ln(x, w, b, 1e-5), ref)
    assert torch.allclose(N._written_out_rms(x, w, b, 1e-5), torch.nn.functional.rms_norm(x, (64,), w, 1e-5))


def test_cached_batches_are_the_languages_batches():
    lang = C.language(3)
    cached = C.CachedBatches(lang)
    for split in ("train", "val"):
        x, y = cached.batch(5, 4, 8, seed=2, split=split)
        x2, y2 = lang.batch(5, 4, 8, seed=2, split=split)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert cached.optimum(8) == lang.optimum(8)


def test_train_task_is_deterministic_and_json_ready():
    task = {
        "model": {"n_layers": 1, "record_logits": True},
        "lang_seed": 0,
        "init_record": True,
        "train": {
            "steps": 4,
            "lr": 1e-3,
            "warmup": 2,
            "schedule": "constant",
            "seed": 1,
            "monitor": True,
            "monitor_every": 1,
        },
    }
    a = C.train_task(**task)
    assert a == C.train_task(**task)
    json.dumps(a)
    assert a["steps_done"] == 4 and a["steps_at_peak_lr"] == 3  # warmup 2: steps 1, 2, 3 run at the peak
    assert a["excess"] == pytest.approx(a["final_loss"] - a["reference"])
    assert a["reference"] != a["optimum"]  # the optimum on the validation tokens, not the expected one
    assert a["max_attn_logit"] > 0 and a["init_record"]["step"] == 0 and a["init_record"]["layers"]
    assert len(a["loss_curve"]) == 4 and a["logz_init"] == pytest.approx(a["logz_curve"][0])
    other = C.train_task(**{**task, "train": {**task["train"], "seed": 2}})
    assert other["initial_loss"] != a["initial_loss"]  # the seed sets the init and the batches


# ---- the experiments: settings and one quick run each through ctx.map -----------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_settings_come_from_the_registered_config_only(name):
    import addnorm.lab.experiments  # noqa: F401

    config = EXPERIMENTS[name].config
    for mode, quick in (("default", False), ("quick", True)):
        s = C.settings(Context(quick=quick, config=config))
        assert s == {**{k: v for k, v in config.items() if k not in ("default", "quick")}, **config[mode]}
    with pytest.raises(ValueError, match="config"):
        EXPERIMENTS[name].run(Context(quick=True))  # without its config an experiment refuses to guess sizes


@pytest.mark.parametrize("name", NAMES)
def test_quick_run_goes_through_ctx_map_with_portable_tasks(name, tmp_path):
    """Every run is a module-level function with JSON-able arguments and results (what the executor needs); the
    result carries per-seed numbers, and the verdict matches the verdict function's."""
    import addnorm.lab.experiments  # noqa: F401

    calls = []

    def mapper(fn, tasks):
        assert "<locals>" not in fn.__qualname__ and fn.__module__.startswith("addnorm.lab.experiments")
        json.dumps(tasks)
        out = serial_map(fn, tasks)
        json.dumps(out)
        calls.append((fn.__name__, len(tasks)))
        return out

    config = EXPERIMENTS[name].config
    ctx = Context(quick=True, seed=0, figure_dir=tmp_path, config=config, mapper=mapper)
    res = EXPERIMENTS[name].run(ctx)
    quick = C.settings(Context(quick=True, config=config))
    assert calls and calls[0][0] == "train_task"
    assert res.metrics["seeds"] == [0, 1] == list(range(quick["seeds"]))
    assert res.metrics["per_seed"] and all(len(v) == quick["seeds"] for v in res.metrics["per_seed"].values())
    assert res.metrics["criterion"] == EXPERIMENTS[name].criterion and res.summary
    assert (res.verdict == "inconclusive") == bool(res.reason)
    json.dumps(res.metrics)
    json.dumps(res.timings)
    if C.pyplot() is not None:
        assert res.figures and all((tmp_path / f).stat().st_size > 0 for f in res.figures)
    if name == "ln-vs-rms-training":  # wall-clock numbers go to timings only (merge compares metrics)
        assert set(res.timings["ratio_rms_over_ln"]) == {"plain", "addnorm"}
        assert "_ms" not in json.dumps(res.metrics) and "time" not in json.dumps(res.metrics["per_seed"])
        ratio = res.timings["ratio_rms_over_ln"]["plain"]
        assert ratio["ci95"][0] <= ratio["geomean"] <= ratio["ci95"][1]


def test_training_runs_use_the_threads_the_runner_set(monkeypatch):
    """`addnorm lab --threads N` applies to the training tasks too: they do not force a thread count."""
    import addnorm.train.loop as loop

    seen = []

    def fake_train(model, data, cfg):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop")

    monkeypatch.setattr(loop, "train", fake_train)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="stop"):
            C.train_task(model={"n_layers": 1}, train={"steps": 1}, lang_seed=0)
    finally:
        torch.set_num_threads(before)
    assert seen == [2]


def test_depth_sweep_figure_shows_only_the_swept_depths_as_tick_labels(tmp_path, monkeypatch):
    """Issue 16.10: on the log depth axis matplotlib's minor tick labels overlapped the depths' own labels."""
    if C.pyplot() is None:
        pytest.skip("matplotlib is not installed")
    seen = []
    real_save = D.save

    def keep(plt, fig, ctx, name):
        ax = fig.axes[0]
        fig.canvas.draw()
        seen.append(
            (
                [t.get_text() for t in ax.get_xticklabels()],
                [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()],
            )
        )
        return real_save(plt, fig, ctx, name)

    monkeypatch.setattr(D, "save", keep)
    fake = {"excess": 0.1, "diverged": False, "max_grad_norm": 1.0, "loss_curve": [3.0, 1.0]}
    config = EXPERIMENTS["depth-sweep"].config
    ctx = Context(quick=True, figure_dir=tmp_path, config=config, mapper=lambda fn, tasks: [fake] * len(tasks))
    EXPERIMENTS["depth-sweep"].run(ctx)
    depths = [str(n) for n in C.settings(ctx)["depths"]]
    assert seen == [(depths, [])]


def test_the_lab_model_and_language_are_importable_from_training_setup():
    """benchmarks/bench_batched_train.py and tests/train/test_train_batched.py import them from this module."""
    from addnorm.lab.experiments.training_setup import language, model_config

    assert model_config().d_model == C.D_MODEL and language(0).vocab_size == C.VOCAB
