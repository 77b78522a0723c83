"""The training experiments of the lab: each criterion as a pure function, registration, and one quick run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS, Context
from addnorm.lab.experiments import training as T

NAMES = ("warmup", "depth-sweep", "lr-sensitivity", "z-loss", "placement-comparison", "ln-vs-rms-training")


def test_all_training_experiments_are_registered_with_a_criterion():
    import addnorm.lab.experiments  # noqa: F401 - registers everything in MODULES

    for name in NAMES:
        assert name in EXPERIMENTS, name
        assert EXPERIMENTS[name].claim and EXPERIMENTS[name].source
        assert T.CRITERIA[name]


# ---- warmup ---------------------------------------------------------------------------------------------------


def test_warmup_verdict():
    ok = {"post": {0: 1.0, 50: 0.5, 400: 0.6}, "pre": {0: 0.52, 50: 0.5, 400: 0.55}}
    assert T.warmup_verdict(ok)[0] is True
    assert T.warmup_verdict(ok)[1]["gap_post"] == pytest.approx(0.5)
    pre_cares = {"post": {0: 1.0, 50: 0.5, 400: 0.6}, "pre": {0: 1.0, 50: 0.5, 400: 0.55}}
    assert T.warmup_verdict(pre_cares)[0] is False
    post_fine = {"post": {0: 0.52, 50: 0.5, 400: 0.6}, "pre": {0: 0.5, 50: 0.5, 400: 0.55}}
    assert T.warmup_verdict(post_fine)[0] is False
    assert T.warmup_verdict({"post": {0: math.nan, 50: 0.5}, "pre": {0: 0.5, 50: 0.5}})[0] is None


# ---- depth ----------------------------------------------------------------------------------------------------


def test_depth_verdict():
    never = {"post": {6: False, 48: False}, "deepnorm": {6: False, 48: False}}
    ok = {"post": {6: 0.3, 24: 0.6, 48: 1.5}, "deepnorm": {6: 0.3, 24: 0.3, 48: 0.35}}
    passed, extra = T.depth_verdict(ok, never)
    assert passed is True and extra["degrade_post"] == pytest.approx(1.2)
    assert T.depth_verdict(ok, {"post": never["post"], "deepnorm": {6: False, 48: True}})[0] is False
    flat = {"post": {6: 0.3, 48: 0.35}, "deepnorm": {6: 0.3, 48: 0.3}}
    assert T.depth_verdict(flat, never)[0] is False
    deep_also_bad = {"post": {6: 0.3, 48: 1.5}, "deepnorm": {6: 0.3, 48: 1.2}}
    assert T.depth_verdict(deep_also_bad, never)[0] is False


# ---- learning-rate sensitivity --------------------------------------------------------------------------------


def test_lr_sensitivity_formula():
    # loss_0 = 4; best = 1; capped losses: 2, 1, 4 (5 capped), 4 (diverged) -> mean of (1, 0, 3, 3) = 1.75
    assert T.lr_sensitivity([2.0, 1.0, 5.0, math.nan], [4.0, 4.0, 4.0, 4.0]) == pytest.approx(1.75)
    assert T.lr_sensitivity([1.0, 1.0], [3.0, 3.0]) == 0.0


def test_lr_verdict():
    grows = [2.0, 3.0, 5.0, 8.0, 13.0, 30.0, 20.0]
    passed, extra = T.lr_verdict({"pre": [0.8, 0.7, 0.9], "pre+qk": [0.3, 0.4, 0.5]}, grows)
    assert passed is True and extra["max_logit_growth_pre"] == pytest.approx(15.0)
    assert extra["qk_lower_at_seeds"] == "3/3"
    # QK-norm better on average but not at every seed: one seed's noise could order them either way
    passed, extra = T.lr_verdict({"pre": [0.8, 0.3, 0.9], "pre+qk": [0.3, 0.4, 0.5]}, grows)
    assert passed is False and extra["qk_lower_at_seeds"] == "2/3"
    assert T.lr_verdict({"pre": [0.3], "pre+qk": [0.8]}, grows)[0] is False
    assert T.lr_verdict({"pre": [0.8], "pre+qk": [0.3]}, [2.0] * 7)[0] is False  # the logits did not grow
    assert T.lr_verdict({"pre": [0.8], "pre+qk": [0.3]}, [None] * 7)[0] is None
    assert T.lr_verdict({"pre": [0.8, 0.7], "pre+qk": [0.3]}, grows)[0] is None  # seeds not paired


def test_lr_sensitivity_runs_pre_and_qk_at_every_seed_on_the_same_language(monkeypatch, tmp_path):
    from addnorm.train.loop import TrainResult

    seen = []

    def fake_training(ctx, model_kw, **train_kw):
        seen.append((model_kw.get("placement"), bool(model_kw.get("qk_norm")), train_kw["seed"]))
        return TrainResult(optimum=1.0, initial_loss=3.0, final_loss=2.0, losses=[3.0, 2.0])

    monkeypatch.setattr(T, "run_training", fake_training)
    config = dict(EXPERIMENTS["lr-sensitivity"].config, quick={"steps": 3, "seeds": 2})
    res = EXPERIMENTS["lr-sensitivity"].run(Context(quick=True, seed=5, figure_dir=tmp_path, config=config))
    grid = len(config["grid"])
    assert sorted(set(seen)) == [("post", False, 5), ("pre", False, 5), ("pre", False, 6), ("pre", True, 5),
                                 ("pre", True, 6)]  # fmt: skip
    assert len(seen) == 5 * grid and res.metrics["seeds"] == [5, 6]
    assert len(res.metrics["sensitivity_by_seed"]["pre+qk"]) == 2


# ---- z-loss, placements, LN vs RMS ----------------------------------------------------------------------------


def test_z_loss_verdict():
    assert T.z_loss_verdict(-8.0, 0.5, False)[0] is True
    assert T.z_loss_verdict(-8.0, -5.0, False)[0] is False
    assert T.z_loss_verdict(1.0, 0.1, False)[0] is False  # no drift to prevent
    assert T.z_loss_verdict(-8.0, 0.5, True)[0] is None


def test_placement_verdict():
    res = {"pre": 5.0, "sandwich": 1.5, "post": 1.0}
    grad = {"post": 3.0, "pre": 1.0}
    passed, checks = T.placement_verdict(res, grad)
    assert passed is True and all(checks.values())
    passed, checks = T.placement_verdict(res, {"post": 0.5, "pre": 1.0})
    assert passed is False and checks["post_grad_rises_vs_pre"] is False
    assert T.placement_verdict({"pre": 1.5, "sandwich": 1.0}, grad)[0] is False
    # Post-LN above Pre-LN but falling towards the last layer is not "rising towards the last layers"
    passed, checks = T.placement_verdict(res, {"post": 0.6, "pre": 0.3})
    assert passed is False and checks["post_grad_rises_towards_last_layer"] is False
    assert T.placement_verdict({"pre": None, "sandwich": 1.0}, grad)[0] is None


def test_ln_rms_verdict():
    assert T.ln_rms_verdict(0.50, 0.52, 1.0, 0.98)[0] is True
    assert T.ln_rms_verdict(0.50, 0.70, 1.0, 0.98)[0] is False  # loss differs
    assert T.ln_rms_verdict(0.50, 0.51, 1.0, 1.2)[0] is False  # RMSNorm slower
    assert T.ln_rms_verdict(2.0, 2.15, 1.0, 1.0)[0] is True  # tolerance: 10% of a large excess
    assert T.ln_rms_verdict(math.nan, 0.5, 1.0, 1.0)[0] is None


def test_excess_caps_a_diverged_run_at_its_initial_loss():
    from addnorm.train.loop import TrainResult

    r = TrainResult(optimum=1.0, initial_loss=3.5, final_loss=math.nan, diverged=True)
    assert T.excess(r) == pytest.approx(2.5)
    r = TrainResult(optimum=1.0, initial_loss=3.5, final_loss=1.25)
    assert T.excess(r) == pytest.approx(0.25)


# ---- one quick run --------------------------------------------------------------------------------------------


def test_quick_z_loss_run(tmp_path):
    ctx = Context(quick=True, seed=0, figure_dir=tmp_path, config=EXPERIMENTS["z-loss"].config)
    res = EXPERIMENTS["z-loss"].run(ctx)
    assert res.verdict in ("reproduced", "not reproduced", "inconclusive")
    assert res.metrics["criterion"] == T.CRITERIA["z-loss"] and res.summary and "Criterion:" not in res.summary
    assert math.isfinite(res.metrics["late_logz_without"]) and res.metrics["steps"] == 100
    expected, _ = T.z_loss_verdict(res.metrics["late_logz_without"], res.metrics["late_logz_with"],
                                   res.metrics["diverged_without"])  # fmt: skip
    assert res.verdict == {True: "reproduced", False: "not reproduced", None: "inconclusive"}[expected]
    json.dumps(res.metrics)  # the runner stores metrics as JSON
    for name in res.figures:
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("name", NAMES)
def test_settings_come_from_the_registered_config_only(name):
    """The config in the report and the cache key is what runs: every size is read from it, none hard-coded."""
    import addnorm.lab.experiments  # noqa: F401

    config = EXPERIMENTS[name].config
    for mode, quick in (("default", False), ("quick", True)):
        s = T._settings(Context(quick=quick, config=config))
        assert s == {**{k: v for k, v in config.items() if k not in ("default", "quick")}, **config[mode]}
    with pytest.raises(ValueError, match="config"):
        EXPERIMENTS[name].run(Context(quick=True))  # without its config an experiment refuses to guess sizes


def test_quick_run_uses_the_sizes_in_its_config(tmp_path, monkeypatch):
    seen = []

    def fake_training(ctx, model_kw, **train_kw):
        seen.append((model_kw["n_layers"], train_kw["steps"], train_kw["lr"]))
        from addnorm.train.loop import TrainResult

        return TrainResult(optimum=1.0, initial_loss=3.0, final_loss=2.0, losses=[3.0, 2.0])

    monkeypatch.setattr(T, "run_training", fake_training)
    config = dict(EXPERIMENTS["warmup"].config, quick={"layers": 3, "steps": 7}, lr=0.5, warmups=[0, 2])
    res = EXPERIMENTS["warmup"].run(Context(quick=True, figure_dir=tmp_path, config=config))
    assert seen == [(3, 7, 0.5)] * 4  # (post, pre) x warmups (0, 2)
    assert res.metrics["layers"] == 3 and res.metrics["steps"] == 7 and res.metrics["lr"] == 0.5


@pytest.mark.parametrize("name", NAMES)
def test_every_experiment_runs_on_stand_in_training_with_its_config_sizes(name, tmp_path, monkeypatch):
    """The plumbing of each experiment (settings, verdict, metrics, figure) on instant stand-in runs."""
    from addnorm.train.loop import TrainResult

    seen = []
    layers = [{"residual_rms": 1.0, "grad_norm": 1.0, "max_attn_logit": 2.0},
              {"residual_rms": 3.0, "grad_norm": 2.0, "max_attn_logit": 5.0}]  # fmt: skip

    def fake_training(ctx, model_kw, **train_kw):
        seen.append((model_kw["n_layers"], train_kw["steps"]))
        return TrainResult(optimum=1.0, initial_loss=3.0, final_loss=2.0, losses=[3.0, 2.5, 2.0], logz=[0.5] * 3,
                           records=[{"step": 0, "layers": layers}, {"step": 2, "layers": layers}])  # fmt: skip

    monkeypatch.setattr(T, "run_training", fake_training)
    monkeypatch.setattr(T, "_time_steps", lambda ctx, norm, n_layers, steps: 0.01)
    config = EXPERIMENTS[name].config
    res = EXPERIMENTS[name].run(Context(quick=True, figure_dir=tmp_path, config=config))
    quick = T._settings(Context(quick=True, config=config))
    assert seen and {steps for _, steps in seen} == {quick["steps"]}
    expected_layers = set(quick["depths"]) if "depths" in quick else {quick.get("layers", 2)}
    assert {n for n, _ in seen} == expected_layers
    assert res.metrics["criterion"] == T.CRITERIA[name] and res.metrics["steps"] == quick["steps"]
    json.dumps(res.metrics)
    if T._pyplot() is not None:
        assert res.figures and all((tmp_path / f).stat().st_size > 0 for f in res.figures)


def test_training_runs_use_the_threads_the_runner_set(monkeypatch):
    """`addnorm lab --threads N` applies to the training experiments too (they used to force one thread)."""
    import addnorm.train.loop as loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda model, data, cfg: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        T.run_training(Context(quick=True), {"n_layers": 1}, steps=1)
    finally:
        torch.set_num_threads(before)
    assert seen == [2]
