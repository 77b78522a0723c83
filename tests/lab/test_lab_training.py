"""The training experiments of the lab: each verdict function on synthetic numbers (pass, fail, and the
precondition -> inconclusive path), the training task, and one quick run of each experiment through ctx.map."""

from __future__ import annotations

import json
import math

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS, Context, serial_map
from addnorm.lab.experiments import training as T
from addnorm.lab.experiments import training_norms as N
from addnorm.lab.experiments import training_setup as C
from addnorm.lab.experiments import wortsman as L

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


# ---- warmup ---------------------------------------------------------------------------------------------------
PEAK_OK = {"post": {0: [500] * 3, 300: [201] * 3}, "pre": {0: [500] * 3, 300: [201] * 3}}  # 500 steps, warmup 300


def test_warmup_verdict_pass_and_fail():
    ok = {"post": {0: [1.0, 1.0, 0.12], 300: [0.1, 0.1, 0.1]}, "pre": {0: [0.1, 0.1, 0.1], 300: [0.1, 0.09, 0.1]}}
    passed, extra, reason = T.warmup_verdict(ok, PEAK_OK, 500)
    assert passed is True and reason == "" and extra["seeds_agreeing"] == "2/3"  # the third seed's gap is < 0.05
    assert extra["gap_post"] == pytest.approx([0.9, 0.9, 0.02])
    one_seed = {"post": {0: [1.0, 0.1, 0.1], 300: [0.1, 0.1, 0.1]}, "pre": ok["pre"]}
    passed, extra, _ = T.warmup_verdict(one_seed, PEAK_OK, 500)
    assert passed is False and extra["seeds_agreeing"] == "1/3"  # one seed is not a majority
    pre_cares = {"post": ok["post"], "pre": {0: [0.49] * 3, 300: [0.01] * 3}}  # gap 0.48 > 0.9 / 2
    assert T.warmup_verdict(pre_cares, PEAK_OK, 500)[0] is False


def test_warmup_verdict_is_inconclusive_when_a_control_fails():
    ok = {"post": {0: [1.0] * 3, 300: [0.1] * 3}, "pre": {0: [0.1] * 3, 300: [0.1] * 3}}
    short = {"post": {0: [150] * 3, 400: [0] * 3}, "pre": {0: [150] * 3, 400: [0] * 3}}
    ok400 = {p: {0: v[0], 400: v[300]} for p, v in ok.items()}
    passed, _, reason = T.warmup_verdict(ok400, short, 150)
    assert passed is None and "peak LR" in reason and "warmup 400" in reason
    pre_stuck = {"post": ok["post"], "pre": {0: [1.0, 1.0, 0.1], 300: [0.1] * 3}}
    passed, _, reason = T.warmup_verdict(pre_stuck, PEAK_OK, 500)
    assert passed is None and "Pre-LN without warmup did not train" in reason and "1 of 3" in reason


# ---- depth ----------------------------------------------------------------------------------------------------
NEVER = {"post": {6: [False] * 3, 24: [False] * 3}, "deepnorm": {6: [False] * 3, 24: [False] * 3}}


LONG_FAILS = [1.1, 1.0, 0.9]  # deep Post-LN with the long warmup: still far worse than shallow Post-LN


def test_depth_verdict_pass_and_fail():
    ok = {"post": {6: [0.2, 0.3, 0.35], 24: [1.0, 1.0, 1.0]}, "deepnorm": {6: [0.1] * 3, 24: [0.08] * 3}}
    passed, extra, reason = T.depth_verdict(ok, NEVER, LONG_FAILS)
    assert passed is True and reason == "" and extra["degrade_post"] == pytest.approx([0.8, 0.7, 0.65])
    assert extra["degrade_post_long_warmup"] == pytest.approx([0.9, 0.7, 0.55])
    assert extra["long_warmup_rescues_depth_at_seeds"] == "0/3"
    deep_div = {"post": NEVER["post"], "deepnorm": {6: [False] * 3, 24: [True, True, False]}}
    assert T.depth_verdict(ok, deep_div, LONG_FAILS)[0] is False
    flat = {"post": {6: [0.2] * 3, 24: [0.25] * 3}, "deepnorm": ok["deepnorm"]}
    assert T.depth_verdict(flat, NEVER, LONG_FAILS)[0] is False
    deep_also_bad = {"post": ok["post"], "deepnorm": {6: [0.1] * 3, 24: [0.9] * 3}}
    assert T.depth_verdict(deep_also_bad, NEVER, LONG_FAILS)[0] is False


def test_depth_verdict_fails_when_the_long_warmup_rescues_deep_post_ln():
    ok = {"post": {6: [0.2, 0.3, 0.35], 24: [1.0, 1.0, 1.0]}, "deepnorm": {6: [0.1] * 3, 24: [0.08] * 3}}
    rescued = [0.25, 0.3, 1.0]  # within 0.1 nats of shallow Post-LN at two seeds
    passed, extra, reason = T.depth_verdict(ok, NEVER, rescued)
    assert passed is False and reason == "" and extra["long_warmup_rescues_depth_at_seeds"] == "2/3"
    passed, _, reason = T.depth_verdict(ok, NEVER, None)
    assert passed is None and "long warmup" in reason
    assert T.depth_verdict(ok, NEVER, [1.0, 1.0])[0] is None  # not paired


def test_depth_verdict_is_inconclusive_when_shallow_post_ln_does_not_train():
    stuck = {"post": {6: [1.03, 1.03, 0.2], 24: [1.03] * 3}, "deepnorm": {6: [0.1] * 3, 24: [0.05] * 3}}
    passed, _, reason = T.depth_verdict(stuck, NEVER, LONG_FAILS)
    assert passed is None and "Post-LN at L=6 did not train" in reason


# ---- learning-rate sensitivity --------------------------------------------------------------------------------
def test_lr_sensitivity_formula():
    # loss_0 = 4; best = 1; capped losses: 2, 1, 4 (5 capped), 4 (diverged) -> mean of (1, 0, 3, 3) = 1.75
    assert L.lr_sensitivity([2.0, 1.0, 5.0, math.nan], [4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.75)
    assert L.lr_sensitivity([2.0, 1.0, 5.0, None], [4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.75)
    assert L.lr_sensitivity([1.0, 1.0], [3.0, 3.0]) == 0.0


# ---- placements -----------------------------------------------------------------------------------------------
def test_increment_ratio_separates_linear_from_exponential_growth():
    lin_var = [math.sqrt(1 + 0.5 * k) for k in range(25)]  # Lemma 2: variance linear in depth
    assert N.increment_ratio(lin_var) == pytest.approx(1.0)
    assert 2.5 < N.increment_ratio([1.0 + k for k in range(25)]) < 3.5  # RMS linear: increments grow linearly
    assert N.increment_ratio([1.1**k for k in range(25)]) > 8  # 1.1x per layer: far outside the linear range
    assert N.increment_ratio([5.0] + lin_var[1:]) == pytest.approx(1.0)  # block 0 left out
    assert N.increment_ratio([1.0] * 25) is None  # no growth at all: no ratio
    assert N.increment_ratio(lin_var[:4]) is None and N.increment_ratio(lin_var[:10] + [None]) is None


def test_placement_check_needs_five_of_six_inits_in_the_linear_range():
    passed, extra, reason = N.placement_check([1.0, 1.2, 0.9, 1.4, 0.8, 9.0])
    assert passed is True and reason == "" and extra["inits_agreeing"] == "5/6"
    assert extra["holds_by_init"][5] is False
    assert N.placement_check([1.0, 3.0, 0.9, 1.4, 0.8, 9.0])[0] is False  # two inits look exponential
    assert N.placement_check([1.0, 2.5])[0] is False and N.placement_check([1.0, 1.9])[0] is True
    passed, _, reason = N.placement_check([1.0, None])
    assert passed is None and "finite" in reason


def test_placement_comparison_is_a_demonstration_now():
    import addnorm.lab.experiments  # noqa: F401

    assert EXPERIMENTS["placement-comparison"].kind == "demonstration"


def test_quarter_growth_leaves_block_0_out_and_averages_quarters():
    profile = [100.0] + [1.0] * 4 + [2.0] * 4 + [3.0] * 4 + [4.0] * 4  # block 0 an outlier; 16 more layers
    assert N.quarter_growth(profile) == 4.0
    assert N.quarter_growth([1.0, 2.0, None, 3.0, 4.0]) == 2.0  # a missing middle layer is not in either quarter
    assert N.quarter_growth([1.0, 2.0, 3.0, 3.0, None]) is None  # a missing layer in a quarter: no statistic
    assert N.quarter_growth([1.0]) is None


# ---- LN vs RMS ------------------------------------------------------------------------------------------------
def test_ratio_ci():
    g, lo, hi = N.ratio_ci([2.0] * 5, [1.0] * 5)
    assert g == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    g, lo, hi = N.ratio_ci([1.0, 1.0, 1.0, 1.0], [0.9, 1.1, 0.95, 1.05])
    assert lo < g < hi and lo < 1.0 < hi
    with pytest.raises(ValueError, match="at least 3"):
        N.ratio_ci([1.0], [1.0])


def test_ln_rms_verdict_is_loss_parity_only():
    passed, extra, reason = N.ln_rms_verdict([0.2, 0.21, 0.19], [0.21, 0.2, 0.3])
    assert passed is True and reason == "" and extra["loss_parity_by_seed"] == [True, True, False]
    assert N.ln_rms_verdict([0.2] * 3, [0.4] * 3)[0] is False  # the losses differ
    passed, _, reason = N.ln_rms_verdict([1.0, 1.0, 0.2], [1.0, 1.0, 0.2])
    assert passed is None and "LayerNorm model did not train" in reason


def test_speed_is_a_benchmark_reading_not_a_verdict():
    rows = N.speed_rows(
        {"a": (0.5, 0.48, 0.52), "b": (1.2, 1.1, 1.3), "c": (1.04, 0.98, 1.1), "d": (math.nan, 0.4, 0.6)}
    )
    assert rows == {"a": "no slower", "b": "slower", "c": "undecided", "d": "n/a"}
    import inspect

    assert list(inspect.signature(N.ln_rms_verdict).parameters) == ["excess_ln", "excess_rms"]


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


# ---- the task -------------------------------------------------------------------------------------------------
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
    assert res.metrics["criterion"] == (T.CRITERIA | L.CRITERIA | N.CRITERIA)[name] and res.summary
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
    real_save = T.save

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

    monkeypatch.setattr(T, "save", keep)
    fake = {"excess": 0.1, "diverged": False, "max_grad_norm": 1.0, "loss_curve": [3.0, 1.0]}
    config = EXPERIMENTS["depth-sweep"].config
    ctx = Context(quick=True, figure_dir=tmp_path, config=config, mapper=lambda fn, tasks: [fake] * len(tasks))
    EXPERIMENTS["depth-sweep"].run(ctx)
    depths = [str(n) for n in C.settings(ctx)["depths"]]
    assert seen == [(depths, [])]


def test_the_lab_model_and_language_are_importable_from_training():
    """benchmarks/bench_batched_train.py and tests/train/test_train_batched.py import them from this module."""
    from addnorm.lab.experiments.training import language, model_config

    assert model_config().d_model == C.D_MODEL and language(0).vocab_size == C.VOCAB
