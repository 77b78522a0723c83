"""Training runs on a language other than the lab's order-1 Markov chain, as ``ctx.map`` tasks.

:func:`~addnorm.lab.experiments.training_setup.train_task` always trains on the lab's language (order 1, 3
successors per token: the first block learns it alone). Two experiments need another: ``layernorm-scaling`` a task
whose work is spread over the blocks (an order-2 chain), ``batchnorm-training`` batches that vary as NLP batches do
(:class:`~addnorm.train.data.SentenceMixture`). :func:`language_task` is ``train_task``'s run on a language named
by a JSON spec, returning the same keys for what these experiments read (losses, excess, curve, divergence,
probe). Its batches are not memoized: ``CachedBatches`` keys its cache by (seed, vocabulary) only, which two
different languages can share.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

# _num and _subsample: train_task's own formatting of numbers and curves, so both tasks' results read alike
from addnorm.lab.experiments.training_setup import BATCH, SEQ, _num, model_config, run_outcome

LANGUAGES = ("markov", "sentences")


def make_language(spec: dict, seed: int):
    """The language ``spec`` names: {"kind": "markov", **MarkovLanguage keywords} or {"kind": "sentences",
    **SentenceMixture keywords}, seeded with ``seed``."""
    from addnorm.train.data import MarkovLanguage, SentenceMixture

    kw = dict(spec)
    kind = kw.pop("kind", None)
    if kind not in LANGUAGES:
        raise ValueError(f"language kind must be one of {LANGUAGES}, got {kind!r}")
    if "seed" in kw:
        raise ValueError("the language spec must not hold a seed: the task's lang_seed sets it")
    return (MarkovLanguage if kind == "markov" else SentenceMixture)(**kw, seed=seed)


class PaddingMasked(nn.Module):
    """``model(tokens)`` with ``padding_mask = tokens == pad_id``: the training loop calls ``model(x)`` alone, and
    a BatchNorm must leave padded positions out of its batch statistics (as NLP implementations do)."""

    def __init__(self, model: nn.Module, pad_id: int):
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, padding_mask=tokens == self.pad_id)


def language_task(
    *, model: dict, train: dict, lang_seed: int, language: dict, curve_points: int = 50, probe: str | None = None
) -> dict:
    """One training run of the tiny LM on the language ``language`` (a :func:`make_language` spec) of seed
    ``lang_seed``; ``model``, ``train`` and ``probe`` as in ``train_task`` (the probe sees the unwrapped model). A
    language with a ``pad_id`` is trained with its padding mask. The model's vocabulary is the lab's unless
    ``model`` sets one (it must cover the language's)."""
    from addnorm.nn import TransformerLM
    from addnorm.train.config import TrainConfig
    from addnorm.train.loop import reference_eval_loss
    from addnorm.train.loop import train as run

    cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "eval_batches": 2, **train})
    data = make_language(language, lang_seed)
    torch.manual_seed(cfg.seed)
    net = TransformerLM(model_config(**model))
    if net.config.vocab_size < data.vocab_size:
        raise ValueError(
            f"the model's vocab_size ({net.config.vocab_size}) must cover the language's ({data.vocab_size})"
        )
    finish = None
    if probe is not None:
        module, _, function = probe.partition(":")
        finish = getattr(importlib.import_module(module), function)(net, data, cfg)
    pad = getattr(data, "pad_id", None)
    res = run(net if pad is None else PaddingMasked(net, pad), data, cfg)
    reference = res.eval_optimum if res.eval_optimum is not None else reference_eval_loss(data, cfg)
    out = {
        **run_outcome(res, reference, curve_points),
        "max_grad_norm": _num(res.max_grad_norm),
        "spikes": len(res.spikes),
        "language": {**data.describe(cfg.seq_len), "seed": lang_seed},
    }
    if finish is not None:
        out["probe"] = finish(net, res)
    return out
