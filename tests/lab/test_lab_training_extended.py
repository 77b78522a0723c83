"""The extended-suite training experiments reordered-norm and batchnorm-training: their verdict rules on synthetic
numbers (pass, fail, control failing), their probes, a tiny run of each, and their place in the registry
(layernorm-scaling and branch-scaling: test_lab_claims_depth_faults.py)."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.lab.core import VERDICTS, Context
from addnorm.lab.experiments import powernorm as N
from addnorm.lab.experiments import training_setup as C
from addnorm.lab.runner import load_experiments

MINE = ("reordered-norm", "batchnorm-training")


def test_registered_empirical_in_the_extended_suite_with_criterion_precondition_and_source():
    registry = load_experiments()
    for name in MINE:
        exp = registry[name]
        assert exp.kind == "empirical" and exp.suite == "extended", name
        assert exp.claim and exp.criterion and exp.precondition and exp.source, name
        assert exp.config["default"]["seeds"] >= 3, name


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
    from addnorm.lab.experiments.training_setup import paired

    assert paired([1.0, 2.0], [None, 3.0], [0, 0])
    assert not paired([1.0, 2.0], [3.0])  # a seed missing in one arm
    assert not paired([], [])  # no seeds at all
    assert not paired()
