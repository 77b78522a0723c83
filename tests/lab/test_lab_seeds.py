"""The seeds' own advice as experiments: their verdict rules on synthetic numbers (pass, fail, control
failing), their tasks' pieces (the fp16-statistics norm, the related language, the Post-to-Pre switch, the planted
fault), and one quick run of each through ctx.map with portable tasks."""

from __future__ import annotations

import json

import pytest
import torch

from addnorm.lab.core import EXPERIMENTS, Context, serial_map
from addnorm.lab.experiments import seed_advice_claims as A
from addnorm.lab.experiments import seeds_tasks as K
from addnorm.lab.experiments import training_setup as C

NAMES = ("norm-hyperparameters", "finetune-post-to-pre")


def test_registered_empirical_with_criterion_control_and_the_seed_as_source():
    import addnorm.lab.experiments  # noqa: F401

    for name in NAMES:
        exp = EXPERIMENTS[name]
        assert exp.kind == "empirical" and exp.claim and exp.precondition, name
        assert exp.criterion == A.CRITERIA[name] and exp.source.startswith("Seed 00"), name
        assert exp.config["default"]["seeds"] >= 3, name


# ---- finetune-post-to-pre's tasks ------------------------------------------------------------------------------
def test_related_language_redraws_a_quarter_of_the_rules():
    base, rel = C.language(0), K.related_language(0, 0.25)
    same = [bool((base.table[r] == rel.table[r]).all()) for r in range(C.VOCAB)]
    assert same.count(False) == C.VOCAB // 4 and rel.vocab_size == C.VOCAB
    assert (rel.table == K.related_language(0, 0.25).table).all()  # a pure function of its arguments


def test_the_switch_keeps_every_pretrained_weight_and_adds_the_final_norm_at_its_identity():
    from addnorm.nn import TransformerLM

    pre = {"steps": 3, "lr": 1e-3, "warmup": 1}
    state, summary = K.pretrained_state(layers=2, pretrain=pre, seed=0, lang_seed=0)
    torch.manual_seed(0)
    net = TransformerLM(C.model_config(n_layers=2, placement="pre"))
    missing, unexpected = net.load_state_dict(state, strict=False)
    assert sorted(missing) == ["final_norm.bias", "final_norm.weight"] and not unexpected
    assert summary["steps_done"] == 3
    out = K.finetune_task(
        arm="pre",
        layers=2,
        pretrain=pre,
        finetune={"steps": 2, "lr": 1e-3, "warmup": 1},
        changed=0.25,
        seed=0,
        lang_seed=0,
    )
    post = K.finetune_task(
        arm="post",
        layers=2,
        pretrain=pre,
        finetune={"steps": 2, "lr": 1e-3, "warmup": 1},
        changed=0.25,
        seed=0,
        lang_seed=0,
    )
    assert out["start_loss"] != post["start_loss"] and out["pretrain"] == post["pretrain"] == summary
    with pytest.raises(ValueError, match="arm"):
        K.finetune_task(arm="sideways", layers=2, pretrain=pre, finetune=pre, changed=0.25, seed=0, lang_seed=0)


# ---- localize-divergence ----------------------------------------------------------------------------------------
def test_fault_task_raises_only_the_faulted_blocks_learning_rate():
    kw = dict(layers=2, lr=1e-3, steps=6, warmup=1, fault_step=2, seed=0, lang_seed=0)
    clean = K.fault_task(**kw, fault_layer=None, fault_mult=1.0)
    hot = K.fault_task(**kw, fault_layer=1, fault_mult=1000.0)
    assert len(clean["rms"]) == 6 and all(len(r) == 2 for r in clean["rms"])
    assert clean["rms"][:3] == hot["rms"][:3]  # identical until the fault's first update lands
    assert hot["rms"][-1][0] == pytest.approx(clean["rms"][-1][0], rel=0.2)  # block 0 barely changes
    assert abs(hot["rms"][-1][1] - clean["rms"][-1][1]) > 10 * abs(hot["rms"][-1][0] - clean["rms"][-1][0])
    with pytest.raises(ValueError, match="fault_layer"):
        K.fault_task(**kw, fault_layer=2, fault_mult=2.0)


# ---- fp16-layernorm ---------------------------------------------------------------------------------------------
def _norm(stats, clamp=None):
    src = torch.nn.LayerNorm(32)
    with torch.no_grad():
        src.weight.uniform_(0.5, 1.5)
        src.bias.uniform_(-0.1, 0.1)
    return K.HalfStatsLayerNorm(src, stats, clamp), src


@pytest.mark.parametrize("stats", ["fp16", "fp32"])
def test_half_stats_norm_matches_a_float64_layernorm_of_the_fp16_input(stats):
    norm, src = _norm(stats)
    x = torch.randn(4, 7, 32) * 3
    want = torch.nn.functional.layer_norm(
        x.half().double(), (32,), src.weight.double(), src.bias.double(), src.eps
    ).float()
    torch.testing.assert_close(norm(x), want, atol=2e-2 if stats == "fp16" else 3e-3, rtol=0)
    xh = x.half().float()
    sumsq = float((xh - xh.mean(-1, keepdim=True)).pow(2).sum(-1).max())
    assert norm.overflows == 0 and norm.max_sumsq == pytest.approx(sumsq, rel=1e-6)
    out, h = norm(x, torch.ones_like(x))  # the norms' calling convention with a residual
    torch.testing.assert_close(h, x + 1)
    torch.testing.assert_close(out, norm(x + 1))


def test_fp16_statistics_overflow_where_fp32_statistics_and_the_clamp_do_not():
    x = torch.randn(2, 3, 32) * 60  # per-token sum of squares ~ 32 * 3600 > 65504
    bound = (K.FP16_MAX / 32) ** 0.5 * 0.99
    for stats, clamp, overflows in (("fp16", None, 1), ("fp32", None, 0), ("clamp", bound, 0)):
        norm, _ = _norm(stats, clamp)
        out = norm(x.requires_grad_())
        out.sum().backward()
        assert norm.overflows == overflows, stats
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()  # inf variance: outputs = bias, not NaN
        x.grad = None
    with pytest.raises(ValueError, match="clamp"):
        _norm("clamp")
    with pytest.raises(ValueError, match="stats"):
        _norm("bf16")


def test_swap_norms_and_set_norm_gains_reach_every_layernorm():
    from addnorm.nn import TransformerLM

    net = TransformerLM(C.model_config(n_layers=2, fuse_add_norm=False))
    assert K.set_norm_gains(net, 0.5) == 5  # two per block and the final norm
    assert all(float(m.weight.mean()) == 0.5 for m in net.modules() if isinstance(m, torch.nn.LayerNorm))
    swapped = K.swap_norms(net, "fp32")
    assert len(swapped) == 5 and not any(isinstance(m, torch.nn.LayerNorm) for m in net.modules())
    with pytest.raises(ValueError, match="no LayerNorm"):
        K.swap_norms(net, "fp32")


# ---- quick runs through ctx.map ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_quick_run_goes_through_ctx_map_with_portable_tasks(name, tmp_path):
    import addnorm.lab.experiments  # noqa: F401

    def mapper(fn, tasks):
        assert "<locals>" not in fn.__qualname__ and fn.__module__ == "addnorm.lab.experiments.seeds_tasks"
        json.dumps(tasks)
        out = serial_map(fn, tasks)
        json.dumps(out)
        return out

    config = EXPERIMENTS[name].config
    res = EXPERIMENTS[name].run(Context(quick=True, seed=0, figure_dir=tmp_path, config=config, mapper=mapper))
    assert res.verdict in ("reproduced", "not reproduced", "inconclusive")
    assert (res.verdict == "inconclusive") == bool(res.reason)
    assert res.metrics["seeds"] == [0, 1] and res.metrics["criterion"] == A.CRITERIA[name] and res.summary
    assert all(len(v) == 2 for v in res.metrics["per_seed"].values())
    json.dumps(res.metrics)
    if C.pyplot() is not None:
        assert res.figures and all((tmp_path / f).stat().st_size > 0 for f in res.figures)
