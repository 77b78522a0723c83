"""The hidden-state probe, the per-layer gradient record and the mean-logit tracking of train_task, the models
of the newer experiments (ReZero, branch-output), and the helpers the rules read (peak residual RMS)."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS
from addnorm.lab.experiments import peri_ln as P
from addnorm.lab.experiments import training_setup as C

NEW = ("peri-ln-training", "dyt", "rezero", "mix-ln-training")


NEW = ("peri-ln-training", "dyt")


def test_new_experiments_are_registered_empirical_with_criterion_precondition_and_source():
    import addnorm.lab.experiments  # noqa: F401

    for name in NEW:
        exp = EXPERIMENTS[name]
        assert exp.kind == "empirical" and exp.claim and exp.criterion and exp.precondition, name
        assert "arXiv:" in exp.source and exp.config["default"]["seeds"] >= 3, name


# ---- the task's probes ------------------------------------------------------------------------------------------
def test_hidden_stats_measure_each_block_output():
    from addnorm.nn import TransformerLM

    torch.manual_seed(0)
    net = TransformerLM(C.model_config(n_layers=3))
    x = torch.randint(0, C.VOCAB, (2, 8))
    outs = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in net.blocks]
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    stats = C.hidden_stats(net, x)
    assert len(stats) == 3
    for s, h in zip(stats, outs):
        assert s["rms"] == pytest.approx(float(h.pow(2).mean().sqrt()), rel=1e-5)
        assert s["max_abs"] == pytest.approx(float(h.abs().max()), rel=1e-5)
        assert s["max_over_median"] == pytest.approx(float(h.abs().max() / h.abs().median()), rel=1e-5)


def test_train_task_probes_hidden_states_and_tracks_the_mean_logit_without_changing_the_run():
    kw = dict(model={"n_layers": 1, "vocab_size": 64}, train={"steps": 6, "lr": 1e-2, "seed": 3}, lang_seed=0, vocab=8)
    plain = C.train_task(**kw)
    probed = C.train_task(**kw, hidden_probe=True, track_mean_logit=True)
    assert probed["final_loss"] == plain["final_loss"] and probed["loss_curve"] == plain["loss_curve"]
    assert len(probed["hidden_init"]) == 1 and len(probed["hidden_final"]) == 1
    assert probed["hidden_init"][0]["rms"] != probed["hidden_final"][0]["rms"]  # trained in between
    assert len(probed["mean_logit_curve"]) == 6 and math.isfinite(probed["mean_logit_late"])
    assert probed["mean_logit_min"] == min(probed["mean_logit_curve"])  # one value per step at 6 points


# ---- ReZero -----------------------------------------------------------------------------------------------------
def test_rezero_and_branch_output_models_build_fused_and_unfused_alike():
    from addnorm.nn import TransformerLM

    for placement in ("rezero", "branch-output"):
        torch.manual_seed(0)
        fused = TransformerLM(C.model_config(placement=placement, n_layers=2))
        torch.manual_seed(0)
        plain = TransformerLM(C.model_config(placement=placement, n_layers=2, fuse_add_norm=False))
        x = torch.randint(0, C.VOCAB, (2, 8))
        with torch.no_grad():
            torch.testing.assert_close(fused(x), plain(x))
        assert fused.final_norm is None if placement == "rezero" else fused.final_norm is not None


def test_train_task_averages_each_layers_gradient_norm_over_the_records():
    out = C.train_task(
        model={"n_layers": 3},
        train={"steps": 5, "lr": 1e-3, "seed": 0, "monitor": True, "monitor_every": 2},
        lang_seed=0,
        layer_grads=True,
        init_record=True,
    )
    assert len(out["layer_grad_mean"]) == 3 and all(v > 0 for v in out["layer_grad_mean"])


def test_peak_rms():
    assert P.peak_rms([{"rms": 1.0}, {"rms": 3.0}, {"rms": 2.0}]) == 3.0
    assert P.peak_rms([{"rms": 1.0}, {"rms": None}]) is None and P.peak_rms(None) is None
