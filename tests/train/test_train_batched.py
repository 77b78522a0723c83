"""train_batched: each member equals an unbatched train() run, members are independent, bad input is refused.

Tolerance: the batched code computes the same float32 math as train() in another summation order (bmm over
members instead of addmm, per-member means of the cross-entropy, the gradient norm summed over stacked tensors
instead of torch's norm of per-tensor norms, AdamW written out instead of the fused kernel). Rounding differences
of ~1e-7 relative per op then pass through a few Adam steps, which divide by sqrt(v) and so carry relative, not
absolute, errors: over 6 steps the losses measured agree to ~1e-6 (observed <= 2.4e-6 over 12 steps at lr 1e-2).
The tests allow rtol 1e-4 / atol 1e-5, two orders above that and far below any real difference (one step at
lr 1e-3 moves the loss by ~1e-2; a member seeing another's batch or gradient is off by > 1e-2). It holds for
learning rates up to 1e-2 at these sizes; at 3e-2 the loss oscillates (4.5, 5.0, 1.4, 4.5 in 4 steps) and such a
chaotic run amplifies rounding differences past 1e-4 within a few steps, in any two implementations.
"""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.lab.experiments.training_setup import language, model_config
from addnorm.nn import TransformerLM
from addnorm.train.batched import train_batched
from addnorm.train.config import TrainConfig
from addnorm.train.loop import train
from addnorm.train.stacked import StackedLM, VmapLM, check_batchable

RTOL, ATOL = 1e-4, 1e-5
STEPS = 6


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(seed: int, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(model_config(**{"n_layers": 2, **kw}))


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(
        **{"steps": STEPS, "batch_size": 4, "seq_len": 16, "warmup": 2, "eval_batches": 2, "eval_every": 3, **kw}
    )


def _close(a, b) -> bool:
    return all(
        math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(x) and math.isnan(y))
        for x, y in zip(a, b, strict=True)
    )


def _assert_same(ref, got, label=""):
    assert len(ref.losses) == len(got.losses), label
    for name in ("losses", "lrs", "grad_norms", "logz"):
        assert _close(getattr(ref, name), getattr(got, name)), (
            f"{label} {name}: {getattr(ref, name)} vs {getattr(got, name)}"
        )
    assert [s for s, _ in ref.evals] == [s for s, _ in got.evals], label
    assert _close([v for _, v in ref.evals], [v for _, v in got.evals]), label
    assert _close(
        [ref.initial_loss, ref.final_loss, ref.best_loss, ref.max_grad_norm],
        [got.initial_loss, got.final_loss, got.best_loss, got.max_grad_norm],
    ), label
    assert ref.diverged == got.diverged and ref.steps_done == got.steps_done, label
    assert ref.optimum == got.optimum and ref.eval_optimum == got.eval_optimum, label
    assert len(got.step_times) == got.steps_done


# Per member: seed, lr, clip, weight decay (independent or not), z-loss, warmup all differ. clip 0.05 is far
# below these models' gradient norms (checked below), so a clipping that mixed members would show.
MEMBERS = [
    dict(seed=0, lr=1e-3, clip=1.0),
    dict(seed=1, lr=3e-3, clip=0.05, weight_decay=0.1, independent_wd=True, z_loss=1e-3, warmup=0),
    dict(seed=0, lr=1e-2, clip=None, weight_decay=0.01, schedule="inverse_sqrt"),
]


@pytest.mark.parametrize(
    "arch",
    [
        dict(),
        dict(placement="post", norm="rmsnorm", n_layers=3),
        dict(placement="sandwich", qk_norm=True),
        dict(placement="deepnorm"),
        dict(placement="mix", n_layers=4),
        dict(placement="dyt", qk_norm=True),  # QK-norm is LayerNorm in a DyT model
        dict(ffn="swiglu", tie_embeddings=False, bias=False),
        dict(placement="rezero", n_layers=3),  # x + a F(x), a a learned scalar per branch (0 at init)
        dict(placement="branch-output", qk_norm=True),  # x + Norm(F(x)) (OLMo 2's reordered norm)
        dict(placement="dyt", norm_kwargs={"alpha_init": 2.0}),  # an init-only norm keyword
        dict(layernorm_scaling=True, n_layers=3),  # F(Norm(x) / sqrt(layer))
    ],
)
def test_each_member_matches_unbatched_train(arch):
    data = language(0)
    cfgs = [_cfg(**m) for m in MEMBERS]
    refs, ref_models = [], []
    for c in cfgs:
        ref_models.append(_model(c.seed, **arch))
        refs.append(train(ref_models[-1], data, c))
    models = [_model(c.seed, **arch) for c in cfgs]
    got = train_batched(models, data, cfgs)
    # the tight clip was active: it at least halved a gradient (ReZero's, its branches scaled by 0 at init, are the
    # smallest: 0.13 against 0.05)
    assert max(refs[1].grad_norms) > 0.05 * 2
    for k, (r, g) in enumerate(zip(refs, got)):
        _assert_same(r, g, f"member {k}")
        for (name, a), b in zip(ref_models[k].named_parameters(), models[k].parameters()):  # weights written back
            if name.endswith(("k_proj.bias", "k_norm.bias")):
                # softmax ignores the bias added to the keys (it adds q.b to a whole row of scores): its true
                # gradient is 0 (for k_proj.bias: without QK-norm; with it, the k_norm bias plays that role), the
                # computed one is rounding noise, and Adam turns noise of any size into steps of about lr, so
                # this weight differs between any two implementations without changing any output
                continue
            # Adam's step is about lr whatever the gradient's size, so a weight whose gradients are near rounding
            # level (an embedding row of a token seen once) carries a relative error of its update up to ~1:
            # bound weights by 1% of the largest distance Adam can move them (lr per step)
            torch.testing.assert_close(b, a, rtol=0, atol=0.01 * cfgs[k].lr * STEPS, msg=f"member {k} {name}")


@pytest.mark.parametrize("arch", [dict(record_logits=True), dict(placement="post", n_layers=3)])
def test_monitor_records_match_train(arch):
    """What the lab reads from Monitor records (max attention logit; per-layer gradient norm and residual RMS)."""
    data = language(0)
    cfgs = [_cfg(seed=s, lr=lr, monitor=True, monitor_every=2) for s, lr in ((0, 1e-3), (1, 1e-2))]
    refs = [train(_model(c.seed, **arch), data, c) for c in cfgs]
    got = train_batched([_model(c.seed, **arch) for c in cfgs], data, cfgs)
    keys = ["grad_norm", "residual_rms"] + (["max_attn_logit"] if arch.get("record_logits") else [])
    layers = arch.get("n_layers", 2)
    for r, g in zip(refs, got):
        assert [rec["step"] for rec in r.records] == [rec["step"] for rec in g.records] == [0, 2, 4]
        for key in ("loss", "grad_norm", "output_logz"):
            assert _close([rec[key] for rec in r.records], [rec[key] for rec in g.records]), key
        for key in keys:
            want = [layer[key] for rec in r.records for layer in rec["layers"]]
            have = [layer[key] for rec in g.records for layer in rec["layers"]]
            assert len(want) == len(have) == 3 * layers and _close(want, have), key
        if not arch.get("record_logits"):
            assert all("max_attn_logit" not in layer for rec in g.records for layer in rec["layers"])


def test_vmap_engine_records_nothing():
    with pytest.raises(ValueError, match="monitor=True"):
        train_batched([_model(0)], language(0), [_cfg(monitor=True)], engine="vmap")


def test_a_diverging_member_does_not_change_the_others():
    """Member 1 (lr 3, no clipping) blows up mid-run and leaves the batch; members 0 and 2 are exactly what they
    are without it, and what train() gives."""
    data = language(0)
    members = [dict(seed=0, lr=1e-3), dict(seed=1, lr=3.0, clip=None, diverge_factor=1.2), dict(seed=2, lr=3e-3)]
    cfgs = [_cfg(**m) for m in members]
    alone = train_batched([_model(c.seed) for c in (cfgs[0], cfgs[2])], data, [cfgs[0], cfgs[2]])
    got = train_batched([_model(c.seed) for c in cfgs], data, cfgs)
    ref = train(_model(cfgs[1].seed), data, cfgs[1])
    assert got[1].diverged and ref.diverged and 1 < got[1].steps_done < STEPS  # it did diverge, and mid-run
    _assert_same(ref, got[1], "diverged member")
    assert math.isnan(got[1].final_loss)
    for a, g in zip(alone, (got[0], got[2])):
        assert not g.diverged and g.steps_done == STEPS
        _assert_same(a, g)


def test_nan_member_is_contained():
    """A member whose weights hold a NaN diverges at step 0; the others train as if it were not there."""
    data = language(0)
    cfgs = [_cfg(seed=0, lr=1e-3), _cfg(seed=1, lr=1e-3)]
    bad = _model(1)
    with torch.no_grad():
        bad.blocks[0].ffn.sublayer.fc_in.weight[0, 0] = float("nan")
    got = train_batched([_model(0), bad], data, cfgs)
    (alone,) = train_batched([_model(0)], data, cfgs[:1])
    assert got[1].diverged and got[1].steps_done == 1
    _assert_same(alone, got[0])


def test_vmap_engine_agrees():
    data = language(0)
    cfgs = [_cfg(seed=s, lr=lr) for s, lr in ((0, 1e-3), (1, 1e-2))]
    a = train_batched([_model(c.seed) for c in cfgs], data, cfgs, engine="stacked")
    b = train_batched([_model(c.seed) for c in cfgs], data, cfgs, engine="vmap")
    for x, y in zip(a, b):
        _assert_same(x, y)


def test_forward_matches_modules():
    models = [_model(s, placement="sandwich", qk_norm=True, norm="rmsnorm") for s in range(3)]
    ids = torch.randint(0, 32, (3, 4, 16), generator=torch.Generator().manual_seed(0))
    want = torch.stack([m(x) for m, x in zip(models, ids)])
    torch.testing.assert_close(StackedLM(models)(ids), want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(VmapLM(models)(ids), want, rtol=RTOL, atol=ATOL)


def test_forward_checks_its_input():
    model = StackedLM([_model(0), _model(1)])
    with pytest.raises(ValueError, match=r"\(K=2, B, T\)"):
        model(torch.zeros(3, 4, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(2, 4, 16))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(2, 4, 33, dtype=torch.long))


def test_benchmark_script_runs(tmp_path):
    """The benchmark's own smoke run: a table row per (L, K) and the file written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_batched_train.py"
    spec = importlib.util.spec_from_file_location("bench_batched_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "table.md"
    assert (
        bench.main(
            ["--layers", "1", "--ks", "2", "--steps", "2", "--rounds", "1", "--engines", "stacked", "--out", str(out)]
        )
        == 0
    )
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1 | 2 |")]
    assert len(rows) == 1 and rows[0].count("x") >= 2
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--record-logits", "--engines", "vmap"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("norm", "batchnorm"),
        ("placement", "post-noskip"),
        ("positional", "rope"),
        ("parallel", True),
        ("dropout", 0.1),
        ("embed_norm", True),
    ],
)
def test_unsupported_architecture_is_named(field, value):
    kw = {field: value}
    if field == "parallel":
        kw["ffn"] = "gelu"
    config = model_config(**kw)
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}"):
        check_batchable(config)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}"):
        train_batched([TransformerLM(config)], language(0), [_cfg()])


def test_bad_arguments():
    data = language(0)
    with pytest.raises(ValueError, match="one TrainConfig per model"):
        train_batched([_model(0), _model(1)], data, [_cfg()])
    with pytest.raises(ValueError, match="at least one"):
        train_batched([], data, [])
    with pytest.raises(ValueError, match=r"cfgs\[1\]\.steps"):
        train_batched([_model(0), _model(1)], data, [_cfg(), _cfg(steps=3)])
    with pytest.raises(ValueError, match=r"cfgs\[0\].*checkpoints"):
        train_batched([_model(0)], data, [_cfg(out_dir="/tmp/x")])
    with pytest.raises(ValueError, match="another config"):
        train_batched([_model(0), _model(1, n_layers=3)], data, [_cfg(), _cfg()])
    with pytest.raises(ValueError, match="engine must be one of"):
        train_batched([_model(0)], data, [_cfg()], engine="jit")
    with pytest.raises(TypeError, match=r"cfgs\[0\] must be a TrainConfig"):
        train_batched([_model(0)], data, [{"steps": 3}])
    with pytest.raises(ValueError, match="record_logits"):
        VmapLM([_model(0, record_logits=True)])
    with pytest.raises(ValueError, match="TransformerLM models, got a Linear"):
        train_batched([torch.nn.Linear(2, 2)], data, [_cfg()])
