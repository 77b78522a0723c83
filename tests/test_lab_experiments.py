"""The init-time and numerics experiments: their criteria on synthetic numbers, their models, one quick real run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from addnorm.lab.experiments.init_time import (
    Attention,
    Stack,
    gradient_flow_verdict,
    lemma2_in_bounds,
    loglog_slope,
    output_change_verdict,
    stream_growth_verdict,
    update_size_verdict,
    xiong_verdict,
)
from addnorm.lab.core import verdict_from
from addnorm.lab.experiments.numerics import bn_ln_verdict, half_precision_verdict, ln_rms_verdict

MINE = ["residual-gradient-flow", "xiong-init-gradients", "deepnet-update-size", "admin-output-change",
        "ln-vs-rms", "half-precision-stats", "batchnorm-vs-layernorm", "residual-stream-growth"]  # fmt: skip


def test_loglog_slope_recovers_a_power_law():
    xs = [6, 12, 24, 48]
    assert loglog_slope(xs, [3 * x**-0.5 for x in xs]) == pytest.approx(-0.5)
    assert loglog_slope(xs, [2.0] * 4) == pytest.approx(0.0, abs=1e-12)


def test_gradient_flow_criterion():
    assert gradient_flow_verdict(1e-6, 0.9)[0] is True
    assert gradient_flow_verdict(1e-2, 0.9)[0] is False  # plain stack did not collapse
    assert gradient_flow_verdict(1e-6, 0.01)[0] is False  # residual stack lost the gradient too
    assert gradient_flow_verdict(float("nan"), 1.0)[0] is None


def _xiong(**over):
    depths = [6, 12, 24, 48]
    kw = dict(depths=depths, pre_last=[L**-0.5 for L in depths], post_last=[1.0, 1.02, 0.98, 1.0],
              pre_ratio=[1.0, 0.9, 1.1, 0.8], post_ratio=[1.5, 2.0, 4.0, 9.0], pre_norm_in_bounds=True)  # fmt: skip
    kw.update(over)
    return xiong_verdict(**kw)


def test_xiong_criterion_accepts_the_theory_and_rejects_each_violation():
    assert _xiong()[0] is True
    assert _xiong(pre_last=[1.0, 1.0, 1.0, 1.0])[0] is False  # Pre-LN not decaying
    assert _xiong(post_last=[1, 2, 4, 8])[0] is False  # Post-LN growing with L
    assert _xiong(post_ratio=[1.5, 1.2, 1.1, 1.0])[0] is False  # Post-LN ratio not growing with L
    assert _xiong(pre_ratio=[1.0, 1.0, 1.0, 0.3])[0] is False  # Pre-LN not flat
    assert _xiong(pre_norm_in_bounds=False)[0] is False
    assert _xiong(pre_last=[1.0, 0.0, 1.0, 1.0])[0] is None
    passed, details = _xiong()
    assert details["pre_ln_slope"] == pytest.approx(-0.5) and all(details["checks"].values())


def test_lemma2_bounds():
    assert lemma2_in_bounds([1 + l for l in range(1, 49)])  # 1 + l sits between 1 + l/2 and 1 + 3l/2
    assert not lemma2_in_bounds([1 + 0.3 * l for l in range(1, 49)])
    assert not lemma2_in_bounds([1 + 2 * l for l in range(1, 49)])
    assert lemma2_in_bounds([1.5 * 0.95])  # within the 10% slack at l = 1


def test_update_size_criterion():
    assert update_size_verdict([6, 12, 24], [0.5, 0.8, 1.2], [0.1, 0.11, 0.12])[0] is True
    assert update_size_verdict([6, 12, 24], [0.5, 0.4, 0.3], [0.1, 0.11, 0.12])[0] is False
    assert update_size_verdict([6, 12, 24], [0.5, 0.8, 1.2], [0.1, 0.5, 1.5])[0] is False
    assert update_size_verdict([6, 12, 24], [0.5, 0.8, float("inf")], [0.1, 0.1, 0.1])[0] is None


def test_output_change_criterion():
    ns = [6, 12, 24, 48]
    linear, log = [1e-3 * n for n in ns], [1e-3 * math.log(n) for n in ns]
    assert output_change_verdict(ns, linear, log)[0] is True
    assert output_change_verdict(ns, log, linear)[0] is False
    assert output_change_verdict(ns, linear, linear)[0] is False
    assert output_change_verdict(ns, linear, [0.0] * 4)[0] is None


def test_stream_growth_criterion():
    good = dict(post_rms=[1.0] * 12, pre_rms=[1.2 + 0.3 * l for l in range(12)], pre_rms_scaled_final=30.0,
                peri_rms_final=5.0, peri_rms_scaled_final=5.1)  # fmt: skip
    assert stream_growth_verdict(**good)[0] is True
    assert stream_growth_verdict(**dict(good, post_rms=[1.0] * 11 + [1.5]))[0] is False
    assert stream_growth_verdict(**dict(good, pre_rms=[1.0] * 12))[0] is False
    assert stream_growth_verdict(**dict(good, pre_rms_scaled_final=5.0))[0] is False
    assert stream_growth_verdict(**dict(good, peri_rms_scaled_final=7.0))[0] is False


def test_ln_rms_criterion():
    ms = [0, 1e-3, 1e-2, 0.1, 1.0]
    assert ln_rms_verdict(ms, [0.0, 1e-3, 1e-2, 0.1, 0.7])[0] is True
    assert ln_rms_verdict(ms, [1e-3, 1e-3, 1e-2, 0.1, 0.7])[0] is False  # not identical at mean 0
    assert ln_rms_verdict(ms, [0.0, 3e-3, 1e-2, 0.1, 0.7])[0] is False  # off the first-order law
    assert ln_rms_verdict(ms, [0.0, 1e-3, 1e-2, 0.1, 0.05])[0] is False  # not monotone
    assert ln_rms_verdict(ms, [0.0, float("nan"), 1e-2, 0.1, 0.7])[0] is None


def test_half_precision_criterion():
    good = dict(overflow_predicted=[False, True], overflow_fp16_acc=[False, True], fp32_acc_max_rel_err=1e-6,
                naive_err_at_max_offset=5.0, stable_max_err=1e-5, fp16_overflows_at_1e5=True,
                bf16_overflows_at_1e5=False, roundtrip_err_ratio_bf16_over_fp16=8.0)  # fmt: skip
    assert half_precision_verdict(**good)[0] is True
    for bad in (dict(overflow_fp16_acc=[True, True]), dict(fp32_acc_max_rel_err=1.0),
                dict(naive_err_at_max_offset=1e-3), dict(stable_max_err=0.1), dict(bf16_overflows_at_1e5=True),
                dict(roundtrip_err_ratio_bf16_over_fp16=1.0)):  # fmt: skip
        assert half_precision_verdict(**dict(good, **bad))[0] is False, bad
    assert half_precision_verdict(**dict(good, stable_max_err=float("nan")))[0] is None


def test_bn_ln_criterion():
    good = dict(bn_padding_change=2.0, ln_padding_change=0.0, bn_batch_change=1.0, ln_batch_change=0.0,
                bn_train_eval_gap=0.4, ln_train_eval_gap=0.0, bn_single_token_degenerate=True,
                ln_single_token_change=0.0)  # fmt: skip
    assert bn_ln_verdict(**good)[0] is True
    for bad in (dict(bn_padding_change=0.01), dict(ln_padding_change=0.5), dict(bn_batch_change=0.0),
                dict(bn_train_eval_gap=0.0), dict(bn_single_token_degenerate=False),
                dict(ln_single_token_change=1.0)):  # fmt: skip
        assert bn_ln_verdict(**dict(good, **bad))[0] is False, bad


def test_uniform_attention_is_the_mean_of_the_values():
    torch.manual_seed(0)
    att = Attention(16, uniform=True)
    x = torch.randn(2, 5, 16)
    expected = att.o(att.v(x).mean(dim=1, keepdim=True)).expand(2, 5, 16)
    torch.testing.assert_close(att(x), expected)


@pytest.mark.parametrize("placement", ["pre", "post", "deepnorm", "sandwich"])
def test_stack_shapes_streams_and_post_ln_normalization(placement):
    torch.manual_seed(0)
    model = Stack(layers=3, d=16, d_ff=32, heads=2, placement=placement)
    out, streams = model(torch.randn(2, 4, 16))
    assert out.shape == (2, 4, 16) and len(streams) == 3
    if placement in ("post", "deepnorm"):  # the stream itself is normalized after every add
        torch.testing.assert_close(streams[-1].pow(2).mean(-1), torch.ones(2, 4), atol=1e-3, rtol=0)
    if placement == "deepnorm":
        alpha = model.subs[0].alpha
        assert alpha == pytest.approx((2 * 3) ** 0.25)


def test_deepnorm_scales_value_output_and_ffn_but_not_query_key():
    torch.manual_seed(0)
    deep = Stack(layers=4, d=64, d_ff=64, heads=2, placement="deepnorm")
    torch.manual_seed(0)
    post = Stack(layers=4, d=64, d_ff=64, heads=2, placement="post")
    beta = (8 * 4) ** -0.25
    a_deep, a_post = deep.subs[0].sublayer, post.subs[0].sublayer
    torch.testing.assert_close(a_deep.q.weight, a_post.q.weight)
    torch.testing.assert_close(a_deep.v.weight, a_post.v.weight * beta)
    torch.testing.assert_close(deep.subs[1].sublayer.w2.weight, post.subs[1].sublayer.w2.weight * beta)


def test_all_eight_experiments_run_quick_and_report(tmp_path):
    """The real experiments end to end in --quick mode: a verdict, metrics, figures embedded in the page."""
    from addnorm.lab.runner import RunOptions, run

    summary = run(RunOptions(out=tmp_path, only=MINE, quick=True, progress=False, device="cpu", threads=1))
    assert summary.failed == [], [r.get("error") for r in summary.records]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert sorted(e["name"] for e in doc["experiments"]) == sorted(MINE)
    page = (tmp_path / "index.html").read_text()
    for e in doc["experiments"]:
        # the verdict follows from the checks the report shows (a verdict set apart from them would be caught here)
        checks = e["metrics"].get("checks")
        expected = "inconclusive" if "note" in e["metrics"] else verdict_from(all(checks.values()))
        assert e["verdict"] == expected, (e["name"], e["verdict"], checks)
        assert e["figures"] and all((tmp_path / f).stat().st_size > 1000 for f in e["figures"])
        assert e["criterion"] and e["summary"] and "checks" in e["metrics"]
        assert f'id="{e["name"]}"' in page
    assert page.count("data:image/png;base64,") == sum(len(e["figures"]) for e in doc["experiments"])
