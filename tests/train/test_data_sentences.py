"""SentenceMixture: padded sentences of varied sources and lengths, with an exact best loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from addnorm.train.data import MarkovLanguage, SentenceMixture

LANG = SentenceMixture(sources=3, tokens_per_source=4, min_len=3, seed=5)


def _rows(lang, n=64, seq_len=12, step=0, split="train", seed=0):
    x, y = lang.batch(step, n, seq_len, seed=seed, split=split)
    return x, y, torch.cat([x[:, :1], y], dim=1)


def test_rows_are_one_sentence_each_then_padding():
    x, y, full = _rows(LANG)
    assert x.shape == y.shape == (64, 12) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets shifted by one
    m = LANG.tokens_per_source
    for row in full.tolist():
        length = next((i for i, t in enumerate(row) if t == LANG.pad_id), len(row))
        assert LANG.min_len <= length <= 13
        assert all(t == LANG.pad_id for t in row[length:])  # padding only after the sentence, to the end
        source = (row[0] - 1) // m
        assert all(1 + source * m <= t <= (source + 1) * m for t in row[:length])  # one source's tokens
    assert LANG.vocab_size == 1 + 3 * 4


def test_batches_are_a_pure_function_of_seed_step_and_split():
    a = _rows(LANG, step=3)[2]
    assert torch.equal(a, _rows(LANG, step=3)[2])
    assert not torch.equal(a, _rows(LANG, step=4)[2])
    assert not torch.equal(a, _rows(LANG, step=3, split="val")[2])
    assert not torch.equal(a, _rows(LANG, step=3, seed=1)[2])
    other = SentenceMixture(sources=3, tokens_per_source=4, min_len=3, seed=6)
    assert not np.allclose(other.chains[0].table, LANG.chains[0].table)  # the language's seed changes its sources


def test_sources_and_lengths_follow_their_distributions():
    full = torch.cat([_rows(LANG, n=512, step=s)[2] for s in range(8)])
    source = (full[:, 0] - 1) // LANG.tokens_per_source
    freq = torch.bincount(source, minlength=3).double() / len(source)
    assert torch.allclose(freq, torch.tensor([4 / 7, 2 / 7, 1 / 7], dtype=torch.float64), atol=0.03)
    lengths = (full != LANG.pad_id).sum(1)
    hist = torch.bincount(lengths, minlength=14)[LANG.min_len :].double() / len(lengths)
    assert torch.allclose(hist, torch.full_like(hist, 1 / 11), atol=0.02)  # uniform on 3..13


def _brute_reference(lang, x: torch.Tensor) -> float:
    """-log P(x_t | x_<t) by enumerating the process's rules token by token (the class vectorizes this)."""
    seq_len = x.shape[1] - 1
    lengths = list(range(lang.min_len, seq_len + 2))
    m, total = lang.tokens_per_source, 0.0
    for row in x.tolist():
        chain = lang.chains[(row[0] - 1) // m]
        for t in range(1, seq_len + 1):
            if row[t - 1] == lang.pad_id:
                continue  # padding after padding: probability 1
            still = [n for n in lengths if n >= t]
            h = sum(1 for n in still if n == t) / len(still)
            if row[t] == lang.pad_id:
                total -= math.log(h)
            else:
                total -= math.log(1 - h) + math.log(chain.table[(row[t - 1] - 1) % m, (row[t] - 1) % m])
    return total / (x.shape[0] * seq_len)


def test_reference_loss_scores_tokens_exactly_and_its_mean_is_the_optimum():
    x, y, full = _rows(LANG, n=16)
    assert LANG.reference_loss(x, y) == pytest.approx(_brute_reference(LANG, full), rel=1e-12)
    values = [LANG.reference_loss(*LANG.batch(s, 256, 12, split="val")) for s in range(40)]
    mean, sem = float(np.mean(values)), float(np.std(values) / math.sqrt(len(values)))
    assert abs(mean - LANG.optimum(12)) < 4 * sem + 1e-3
    # the optimum sits between what padding alone costs and a model blind to the sources' chains
    assert 0 < LANG.optimum(12) < math.log(LANG.vocab_size)
    assert LANG.describe(12)["optimum"] == pytest.approx(LANG.optimum(12))


def test_a_sequence_shorter_than_a_sentence_has_no_padding_and_the_chain_rate():
    lang = SentenceMixture(sources=1, tokens_per_source=5, min_len=8, seed=1)
    # with seq_len + 1 = 8 = min_len every sentence fills the window: the optimum is the chain's entropy rate
    assert lang.optimum(7) == pytest.approx(lang.chains[0].entropy_rate)
    assert (_rows(lang, seq_len=7)[2] != lang.pad_id).all()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sources": 0}, "sources"),
        ({"tokens_per_source": 1}, "tokens_per_source"),
        ({"min_len": 1}, "min_len"),
        ({"weights": [1.0, 2.0]}, "weights"),
        ({"weights": [1.0, -1.0, 1.0, 1.0]}, "weights"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises(ValueError, match=match):
        SentenceMixture(**kw)


def test_seq_len_too_short_for_the_shortest_sentence():
    with pytest.raises(ValueError, match="seq_len"):
        LANG.batch(0, 2, 1)
    assert isinstance(LANG.chains[0], MarkovLanguage)
