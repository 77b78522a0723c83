"""language_task (a training run on a named language) and the languages of layernorm-scaling and
batchnorm-training: what they need of the model, and the BatchNorm probe with padding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from addnorm.lab.experiments import language_tasks as LT
from addnorm.lab.experiments import layernorm_scaling as D
from addnorm.lab.experiments import powernorm as N
from addnorm.lab.runner import load_experiments
from addnorm.train.data import MarkovLanguage, SentenceMixture


def _bigram_loss(lang: MarkovLanguage) -> float:
    """The best loss of a predictor that sees only the previous token, H(x_t | x_{t-1}), for an order-2 chain."""
    v = lang.vocab_size
    joint = lang.stationary.reshape(v, v)[:, :, None] * lang.table.reshape(v, v, v)  # P(a, b, c)
    pair = joint.sum(0)  # P(b, c)
    return float(-(pair * np.log(pair / pair.sum(1, keepdims=True))).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_depth_language_needs_two_tokens_of_context(seed):
    """What one block's lookup of the current token can learn (the bigram) is far from the optimum: the order-1
    language, by contrast, is solved by it (the reason layernorm-scaling's later blocks had nothing to do)."""
    lang = LT.make_language(D.DEPTH_LANGUAGE, seed)
    assert lang.order == 2 and lang.vocab_size == 8
    assert _bigram_loss(lang) - lang.entropy_rate > 0.5
    assert load_experiments()["layernorm-scaling"].config["language"] == D.DEPTH_LANGUAGE


def test_make_language_builds_each_kind_and_refuses_bad_specs():
    assert isinstance(LT.make_language({"kind": "markov", "vocab_size": 4}, 3), MarkovLanguage)
    sentences = LT.make_language(N.BN_LANGUAGE, 3)
    assert isinstance(sentences, SentenceMixture) and sentences.seed == 3
    with pytest.raises(ValueError, match="kind"):
        LT.make_language({"kind": "zipf"}, 0)
    with pytest.raises(ValueError, match="seed"):
        LT.make_language({"kind": "markov", "seed": 1}, 0)


def test_language_task_is_deterministic_and_reports_its_language():
    kw = dict(model={"n_layers": 1}, train={"steps": 3, "lr": 1e-2, "seed": 1}, lang_seed=2, language=D.DEPTH_LANGUAGE)
    a, b = LT.language_task(**kw), LT.language_task(**kw)
    assert a == b
    assert math.isfinite(a["excess"]) and len(a["loss_curve"]) == 3 and a["diverged"] is False
    assert a["language"]["order"] == 2 and a["language"]["seed"] == 2
    ref = MarkovLanguage(vocab_size=8, order=2, branching=2, seed=2)
    assert a["optimum"] == pytest.approx(ref.optimum(32))
    with pytest.raises(ValueError, match="vocab_size"):
        LT.language_task(**{**kw, "model": {"n_layers": 1, "vocab_size": 4}})


def test_padding_masked_hands_the_mask_to_the_model():
    from addnorm.lab.experiments.training_setup import model_config
    from addnorm.nn import TransformerLM

    torch.manual_seed(0)
    net = TransformerLM(model_config(n_layers=1, norm="batchnorm", placement="post")).eval()
    x = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 0]])
    assert torch.equal(LT.PaddingMasked(net, 0)(x), net(x, padding_mask=x == 0))
    assert not torch.equal(net(x), net(x, padding_mask=x == 0))  # the mask does change the output


def test_batch_stats_probe_counts_only_unpadded_positions():
    out = LT.language_task(
        model={"n_layers": 1, "placement": "post", "norm": "batchnorm"},
        train={"steps": 4, "lr": 1e-3, "seed": 0},
        lang_seed=0,
        language=N.BN_LANGUAGE,
        probe="addnorm.lab.experiments.powernorm:batch_stats_probe",
    )
    probe = out["probe"]
    assert 8 * N.BN_LANGUAGE["min_len"] <= probe["samples_per_step"] < 8 * 32  # padding left out
    assert len(probe["per_layer_ratio"]) == 2
    r_mean, r_var = N.deviation_ratios(probe)
    assert r_mean > 0 and r_var > 0
    # each ratio is the raw deviation over the i.i.d. level at the step's own count: about raw / level at the mean
    raw_mean = sum(r[0] for r in probe["per_layer"]) / 2
    assert r_mean == pytest.approx(raw_mean / probe["iid_mean"], rel=0.25)
    assert N.deviation_ratios({"per_layer_ratio": [[None, 1.0]]}) == (None, None)
    assert N.deviation_ratios({"per_layer_ratio": [[2.0, 4.0], [4.0, 2.0]]}) == (3.0, 3.0)
