"""The issue-27 training experiments: their verdict rules on synthetic numbers (pass, fail, control failing), the
hidden-state probe and the mean-logit tracking of train_task."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS
from addnorm.lab.experiments import training_newer as W
from addnorm.lab.experiments import training_setup as C

NEW = ("peri-ln-training", "dyt")


def test_new_experiments_are_registered_empirical_with_criterion_precondition_and_source():
    import addnorm.lab.experiments  # noqa: F401

    for name in NEW:
        exp = EXPERIMENTS[name]
        assert exp.kind == "empirical" and exp.claim and exp.criterion and exp.precondition, name
        assert "arXiv:" in exp.source and exp.config["default"]["seeds"] >= 3, name


# ---- peri-ln ----------------------------------------------------------------------------------------------------
def test_peri_verdict_pass_and_fail():
    grew_init = [1.0, 1.0, 1.0]
    passed, extra, reason = W.peri_verdict([9.0, 8.0, 3.0], grew_init, [2.0, 2.0, 2.0], [0.3] * 3, [0.31, 0.2, 0.3])
    assert passed is True and reason == "" and extra["holds_by_seed"] == [True, True, False]
    # Peri-LN's stream as large as Pre-LN's: not reproduced
    assert W.peri_verdict([9.0] * 3, grew_init, [6.0] * 3, [0.3] * 3, [0.3] * 3)[0] is False
    # Peri-LN bounded but clearly worse: not reproduced ("trains at least as well" fails)
    assert W.peri_verdict([9.0] * 3, grew_init, [2.0] * 3, [0.2] * 3, [0.4] * 3)[0] is False


def test_peri_verdict_is_inconclusive_when_a_control_fails():
    # Pre-LN's stream did not grow during training: the growth the claim is about did not occur
    passed, extra, reason = W.peri_verdict([1.5] * 3, [1.0] * 3, [1.0] * 3, [0.3] * 3, [0.3] * 3)
    assert passed is None and "did not grow" in reason and extra["pre_grew_by_seed"] == [False] * 3
    passed, _, reason = W.peri_verdict([9.0] * 3, [1.0] * 3, [2.0] * 3, [0.3] * 3, [1.0, 1.0, 0.3])
    assert passed is None and "Peri-LN did not train" in reason
    assert W.peri_verdict([9.0] * 3, [1.0] * 2, [2.0] * 3, [0.3] * 3, [0.3] * 3)[0] is None  # not paired


def test_peak_rms():
    assert W.peak_rms([{"rms": 1.0}, {"rms": 3.0}, {"rms": 2.0}]) == 3.0
    assert W.peak_rms([{"rms": 1.0}, {"rms": None}]) is None and W.peak_rms(None) is None


# ---- DyT --------------------------------------------------------------------------------------------------------
def test_dyt_verdict():
    passed, extra, reason = W.dyt_verdict([0.2, 0.3, 0.25], [0.22, 0.5, 0.27])
    assert passed is True and reason == "" and extra["parity_by_seed"] == [True, False, True]
    assert W.dyt_verdict([0.2] * 3, [0.5] * 3)[0] is False
    passed, _, reason = W.dyt_verdict([1.0, 1.0, 0.2], [0.2] * 3)
    assert passed is None and "LayerNorm model did not train" in reason
    assert W.parity(0.54, 0.5) is True and W.parity(0.6, 0.5) is False and W.parity(math.nan, 0.5) is None


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
