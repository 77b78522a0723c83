"""The extended-suite training experiments of issue 27 (layernorm-scaling, reordered-norm, batchnorm-training,
branch-scaling): their verdict rules on synthetic numbers (pass, fail, control failing), their probes, a tiny run
of each, and their place in the registry."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.lab.core import VERDICTS, Context
from addnorm.lab.experiments import powernorm as N
from addnorm.lab.experiments import training_depth as D
from addnorm.lab.experiments import training_setup as C
from addnorm.lab.runner import load_experiments

MINE = ("layernorm-scaling", "reordered-norm", "batchnorm-training", "branch-scaling")


def test_registered_empirical_in_the_extended_suite_with_criterion_precondition_and_source():
    registry = load_experiments()
    for name in MINE:
        exp = registry[name]
        assert exp.kind == "empirical" and exp.suite == "extended", name
        assert exp.claim and exp.criterion and exp.precondition and exp.source, name
        assert exp.config["default"]["seeds"] >= 3, name
    assert "Seed 004" in registry["branch-scaling"].source


# ---- layernorm-scaling ------------------------------------------------------------------------------------------
def test_contributions_and_halves():
    assert D.contributions({"full": 1.0, "skipped": [1.5, 1.25, 1.0, 1.125]}) == [0.5, 0.25, 0.0, 0.125]
    assert D.contributions({"full": float("nan"), "skipped": [1.0]}) == []
    # block 1 (next to the embeddings) is left out: halves of blocks 2..L
    assert D.halves([3.0, 0.5, 0.25, 0.0, 0.125]) == (0.375, 0.0625)
    assert D.halves([3.0, 1.0, 2.0, 3.0]) == (1.0, 3.0)  # odd count: the middle block is in neither half
    assert D.halves([3.0, 0.1, None]) == (None, None) and D.halves([3.0, 0.1]) == (None, None)


def test_lns_verdict_pass_fail_and_controls():
    ok = dict(shallow_pre=[0.5] * 3, deep_pre=[0.1] * 3, deep_lns=[0.3] * 3, max_pre=[0.9] * 3)
    trained = dict(ex_pre=[0.2] * 3, ex_lns=[0.2] * 3)
    passed, details, reason = D.lns_verdict(**ok, **trained)
    assert passed is True and reason == "" and details["seeds_agreeing"] == "3/3"
    # LNS does not raise the deep half at 2 of 3 seeds -> not reproduced
    assert D.lns_verdict(**{**ok, "deep_lns": [0.05, 0.05, 0.3]}, **trained)[0] is False
    # no curse of depth in Pre-LN (its deep half contributes more) -> not reproduced
    assert D.lns_verdict(**{**ok, "deep_pre": [0.6] * 3, "deep_lns": [0.7] * 3}, **trained)[0] is False
    # controls: an untrained arm, or a skip measurement that resolves nothing -> inconclusive
    assert D.lns_verdict(**ok, ex_pre=[0.2] * 3, ex_lns=[0.9, 0.9, 0.2])[0] is None
    passed, _, reason = D.lns_verdict(**{**ok, "max_pre": [0.01] * 3}, **trained)
    assert passed is None and "skipping any one block" in reason
    assert D.lns_verdict([0.5], [0.1, 0.1], [0.3], [0.9], [0.2], [0.2])[0] is None  # unpaired


def test_skip_probe_measures_each_block_skipped_and_leaves_the_model_intact():
    kw = dict(model={"n_layers": 2}, train={"steps": 3, "lr": 1e-2, "seed": 1}, lang_seed=0)
    plain = C.train_task(**kw)
    probed = C.train_task(**kw, probe="addnorm.lab.experiments.training_depth:skip_probe")
    assert probed["final_loss"] == plain["final_loss"]  # the probe changes nothing in the run
    probe = probed["probe"]
    assert probe["full"] == pytest.approx(plain["final_loss"], abs=1e-6) and len(probe["skipped"]) == 2
    assert all(math.isfinite(v) and v != probe["full"] for v in probe["skipped"])


# ---- branch-scaling ---------------------------------------------------------------------------------------------
def test_stream_probe_and_swelling():
    kw = dict(model={"n_layers": 3, "placement": "none"}, train={"steps": 2, "lr": 1e-3, "seed": 0}, lang_seed=0)
    unscaled = C.train_task(**kw, probe="addnorm.lab.experiments.training_depth:stream_probe")["probe"]
    kw["model"]["residual_init_scaling"] = True
    scaled = C.train_task(**kw, probe="addnorm.lab.experiments.training_depth:stream_probe")["probe"]
    assert len(unscaled["block_rms"]) == 3 and unscaled["embed_rms"] == pytest.approx(scaled["embed_rms"])
    assert D.swelling(unscaled) > D.swelling(scaled) > 0  # the scaled branches add less to the stream
    assert D.swelling({"embed_rms": 0.5, "block_rms": [1.0, 2.0]}) == 4.0
    assert D.swelling({"embed_rms": 0.0, "block_rms": [1.0]}) is None and D.swelling(None) is None


def _branch(swell_un, swell_sc, early_un, early_sc, div_sc=(False,) * 3):
    f = "none"
    return (
        {(f, False): list(swell_un), (f, True): list(swell_sc)},
        {(f, False): list(early_un), (f, True): list(early_sc)},
        {(f, False): [False] * 3, (f, True): list(div_sc)},
        [f],
    )


def test_branch_verdict_pass_fail_and_control():
    passed, details, reason = D.branch_verdict(*_branch([50] * 3, [1.2] * 3, [3.0] * 3, [2.5] * 3))
    assert passed is True and details["holds_none_by_seed"] == [True] * 3
    # the scaled stack still swells -> not reproduced
    assert D.branch_verdict(*_branch([50] * 3, [3.0] * 3, [3.0] * 3, [2.5] * 3))[0] is False
    # the scaled stack starts worse, or diverges -> not reproduced
    assert D.branch_verdict(*_branch([50] * 3, [1.2] * 3, [2.0] * 3, [2.5] * 3))[0] is False
    assert D.branch_verdict(*_branch([50] * 3, [1.2] * 3, [3.0] * 3, [2.5] * 3, [True, True, False]))[0] is False
    # the unscaled stack does not swell: nothing to prevent -> inconclusive
    passed, _, reason = D.branch_verdict(*_branch([1.5] * 3, [1.2] * 3, [3.0] * 3, [2.5] * 3))
    assert passed is None and "did not swell" in reason


# ---- batchnorm-training -----------------------------------------------------------------------------------------
def test_iid_deviation_matches_sampling_iid_gaussians():
    n, m = 256, 0.1
    ref_mean, ref_var = N.iid_deviation(n, m)
    g = torch.Generator().manual_seed(0)
    rm, rv = torch.zeros(64), torch.ones(64)
    dm, dv = [], []
    for step in range(400):
        x = torch.randn(n, 64, generator=g)
        mu, var = x.mean(0), x.var(0, unbiased=False)
        if step >= 200:  # running averages settled, as the probe's second half
            dm.append(float(((mu - rm).abs() / rv.sqrt()).mean()))
            dv.append(float(((var - rv).abs() / rv).mean()))
        rm.lerp_(mu, m)
        rv.lerp_(var * n / (n - 1), m)
    assert sum(dm) / len(dm) == pytest.approx(ref_mean, rel=0.05)
    assert sum(dv) / len(dv) == pytest.approx(ref_var, rel=0.1)


def test_batch_stats_probe_records_training_steps_and_deviation_ratios():
    kw = dict(model={"n_layers": 1, "placement": "post", "norm": "batchnorm"}, lang_seed=0)
    out = C.train_task(
        **kw,
        train={"steps": 4, "lr": 1e-3, "seed": 0},
        probe="addnorm.lab.experiments.powernorm:batch_stats_probe",
    )
    probe = out["probe"]
    assert len(probe["per_layer"]) == 2 and all(math.isfinite(v) for row in probe["per_layer"] for v in row)
    r_mean, r_var = N.deviation_ratios(probe)
    assert r_mean > 0 and r_var > 0
    assert probe["samples_per_step"] == 8 * 32  # the lab's language has no padding: every position is a sample
    assert N.deviation_ratios({"per_layer_ratio": [[None, None]]}) == (None, None)


# ---- a tiny run of each -----------------------------------------------------------------------------------------
TINY = {"layers": 2, "steps": 4, "seeds": 2}


@pytest.mark.parametrize("name", MINE)
def test_a_tiny_run_gives_a_verdict_a_per_seed_table_and_a_figure(name, tmp_path):
    exp = load_experiments()[name]
    config = {**exp.config, "quick": {**exp.config["quick"], **TINY}}
    if "grid" in exp.config:
        config["quick"]["grid"] = [3e-3, 1.0]
    result = exp.run(Context(quick=True, seed=0, figure_dir=tmp_path, config=config))
    assert result.verdict in VERDICTS
    assert set(result.metrics["per_seed"]) and all(len(v) == 2 for v in result.metrics["per_seed"].values())
    assert result.summary and all((tmp_path / f).is_file() for f in result.figures)


def test_paired_needs_one_nonzero_length_for_every_series():
    from addnorm.lab.experiments.training_residuals import mix_verdict
    from addnorm.lab.experiments.training_setup import paired

    assert paired([1.0, 2.0], [None, 3.0], [0, 0])
    assert not paired([1.0, 2.0], [3.0])  # a seed missing in one arm
    assert not paired([], [])  # no seeds at all
    assert not paired()
    # a verdict function refuses unpaired arms instead of zipping them short
    verdict, _, reason = mix_verdict([0.5, 0.6], [0.4], [0.1, 0.1], [0.1, 0.1])
    assert verdict is None and "not paired" in reason
