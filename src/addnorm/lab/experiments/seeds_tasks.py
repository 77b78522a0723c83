"""The training tasks of the seeds' own advice, tested as claims: module-level functions
with plain arguments and JSON-able results, run through ``ctx.map`` like :func:`training_setup.train_task`.

- :func:`hyper_task`: one run of the tiny LM with a given norm eps and gain (gamma) init.
- :func:`fault_task`: a Pre-LN run with a fault planted in one block (its learning rate multiplied from a given
  step on), recording every block's residual-stream RMS at every step for :func:`addnorm.diagnostics.localize_jump`.
- :func:`fp16_task`: a run whose LayerNorms compute their statistics in fp16, in fp32, or in fp16 after the seed's
  clamp, counting the steps where a norm's statistics overflowed.
- :func:`finetune_task`: fine-tuning a Post-LN model pretrained on one language on a related one, as it is or with
  its weights rearranged as Pre-LN (or training from scratch, the control); with ``eval_every`` in its fine-tuning
  keywords, the excess loss at every evaluation (``excess_at``: fine-tuning budgets read off one run).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from addnorm.lab.experiments.training_setup import (
    BATCH,
    SEQ,
    VOCAB,
    CachedBatches,
    _num,
    _subsample,
    excess,
    language,
    model_config,
)
from addnorm.lab.seeds import sub_seed


def _run(net: nn.Module, data, train: dict) -> dict:
    """Train ``net`` with addnorm's loop and summarize it the way :func:`training_setup.train_task` does."""
    from addnorm.train.config import TrainConfig
    from addnorm.train.loop import reference_eval_loss
    from addnorm.train.loop import train as run

    cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "eval_batches": 2, **train})
    res = run(net, data, cfg)
    reference = res.eval_optimum if res.eval_optimum is not None else reference_eval_loss(data, cfg)
    out = {
        "initial_loss": _num(res.initial_loss),
        "final_loss": _num(res.final_loss),
        "reference": _num(reference),
        "excess": _num(excess(res.final_loss, res.initial_loss, reference)),
        "diverged": bool(res.diverged),
        "steps_done": res.steps_done,
        "loss_curve": _subsample(res.losses, 50),
    }
    if cfg.eval_every:  # the excess at every evaluation (the same validation tokens, so the same reference)
        evals = dict(res.evals)
        out["excess_at"] = {
            str(step): _num(excess(evals.get(step), res.initial_loss, reference))
            for step in range(cfg.eval_every, cfg.steps + 1, cfg.eval_every)
        }
    return out


# ------------------------------------------------------------------------------------------------ eps and gamma
def set_norm_gains(net: nn.Module, gamma: float) -> int:
    """Set the gain (weight) of every LayerNorm in ``net`` to ``gamma``; returns how many norms were set."""
    count = 0
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.fill_(gamma)
                count += 1
    return count


def hyper_task(*, model: dict, gamma: float, train: dict, lang_seed: int) -> dict:
    """One run of the tiny LM (``model``: TransformerConfig overrides, ``eps`` among them) with every norm's gain
    initialised to ``gamma``; ``train``: TrainConfig keywords (``seed`` sets the init and the batches)."""
    from addnorm.nn import TransformerLM

    torch.manual_seed(train["seed"])
    net = TransformerLM(model_config(**model))
    if set_norm_gains(net, gamma) == 0:
        raise ValueError(f"hyper_task: the model {model} has no LayerNorm whose gain could be set")
    return _run(net, CachedBatches(language(lang_seed)), train)


# ------------------------------------------------------------------------------------------------ planted fault
def fault_task(
    *,
    layers: int,
    lr: float,
    steps: int,
    warmup: int,
    fault_layer: int | None,
    fault_step: int,
    fault_mult: float,
    seed: int,
    lang_seed: int,
    placement: str = "pre",
) -> dict:
    """A run (Pre-LN unless ``placement`` says otherwise) where block ``fault_layer``'s learning rate is multiplied
    by ``fault_mult`` from ``fault_step`` on (``fault_layer`` None: a clean run). Adam(W) without weight decay,
    linear warmup then a constant LR, gradient clipping at 1 (the lab loop's settings). Every block's
    residual-stream RMS is recorded at every step by :class:`addnorm.diagnostics.Monitor` (the seed's "log each
    layer's output norm"); a run stops at the first non-finite loss."""
    import torch.nn.functional as F

    from addnorm.diagnostics import Monitor
    from addnorm.nn import TransformerLM

    torch.manual_seed(seed)
    net = TransformerLM(model_config(n_layers=layers, placement=placement))
    if fault_layer is not None and not 0 <= fault_layer < layers:
        raise ValueError(f"fault_layer must be None or in [0, {layers}), got {fault_layer}")
    faulty = set() if fault_layer is None else {id(p) for p in net.blocks[fault_layer].parameters()}
    groups = [
        {"params": [p for p in net.parameters() if id(p) not in faulty], "fault": False},
        {"params": [p for p in net.parameters() if id(p) in faulty], "fault": True},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = CachedBatches(language(lang_seed))
    monitor = Monitor(net)
    rms: list[list[float | None]] = []
    losses: list[float] = []
    try:
        for step in range(steps):
            m = min(1.0, (step + 1) / warmup) if warmup else 1.0
            for g in opt.param_groups:
                g["lr"] = lr * m * (fault_mult if g["fault"] and step >= fault_step else 1.0)
            x, y = data.batch(step, BATCH, SEQ, seed=seed)
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            rec = monitor.step(loss=loss)
            rms.append([_num(layer.get("residual_rms")) for layer in rec["layers"]])
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                break
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    finally:
        monitor.detach()
    return {"rms": rms, "losses": [_num(v) for v in losses], "steps_done": len(losses)}


# ------------------------------------------------------------------------------------------------ fp16 statistics
FP16_MAX = 65504.0


class HalfStatsLayerNorm(nn.Module):
    """A LayerNorm whose input is rounded to fp16 (the activations of mixed-precision training), with its mean and
    variance computed in ``stats`` precision: "fp16" (sums over the features in fp16, as a naive half-precision
    LayerNorm does: the sum of squares overflows to inf above 65504), "fp32" (fp32 statistics: addnorm's contract
    for half inputs) or "clamp" (the seed's fix: the fp16 input clamped to +-``clamp`` first, then fp16 statistics).
    The normalized value is rounded to fp16; gain and bias apply in fp32. Calling convention of
    :class:`addnorm.nn.LayerNorm` (``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``).

    Counters (training-mode forwards only): ``overflows`` (forwards where a statistic was not finite) and
    ``max_sumsq`` (the largest per-token sum of squared deviations from the mean, in fp32: the value the fp16 sum
    must hold)."""

    def __init__(self, source: nn.LayerNorm, stats: str, clamp: float | None = None):
        super().__init__()
        if stats not in ("fp16", "fp32", "clamp"):
            raise ValueError(f"stats must be 'fp16', 'fp32' or 'clamp', got {stats!r}")
        if (stats == "clamp") != (clamp is not None):
            raise ValueError("clamp (a bound > 0) is needed with stats='clamp' and only then")
        if clamp is not None and not clamp > 0:
            raise ValueError(f"clamp must be > 0, got {clamp!r}")
        self.stats, self.clamp, self.eps = stats, clamp, float(source.eps)
        self.weight = source.weight
        self.bias = source.bias
        self.overflows = 0
        self.max_sumsq = 0.0

    def forward(self, x: Tensor, residual: Tensor | None = None):
        h = x if residual is None else x + residual
        n = h.shape[-1]
        xh = h.half()
        if self.stats == "clamp":
            xh = xh.clamp(-self.clamp, self.clamp)
        if self.stats == "fp32":
            x32 = xh.float()
            mean = x32.mean(-1, keepdim=True)
            var = (x32 - mean).pow(2).mean(-1, keepdim=True)
            y = ((x32 - mean) * torch.rsqrt(var + self.eps)).half()
        else:  # the sums in fp16, as written in the seed (x.mean / x.var over d_model) on half tensors
            mean = xh.sum(-1, keepdim=True) / n
            xc = xh - mean
            var = (xc * xc).sum(-1, keepdim=True) / n
            y = xc / torch.sqrt(var + self.eps)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                x32 = xh.float()
                sumsq = (x32 - x32.mean(-1, keepdim=True)).pow(2).sum(-1)
                self.max_sumsq = max(self.max_sumsq, float(sumsq.max()))
                if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(var).all())):
                    self.overflows += 1
        out = y.float() * self.weight
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else (out, h)


def swap_norms(net: nn.Module, stats: str, clamp: float | None = None) -> list[HalfStatsLayerNorm]:
    """Replace every LayerNorm of ``net`` by a :class:`HalfStatsLayerNorm` sharing its parameters."""
    swapped = []
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                new = HalfStatsLayerNorm(child, stats, clamp)
                setattr(parent, name, new)
                swapped.append(new)
    if not swapped:
        raise ValueError("swap_norms: the model has no LayerNorm")
    return swapped


def fp16_task(*, model: dict, stats: str, clamp: float | None, train: dict, lang_seed: int) -> dict:
    """One run with every LayerNorm's statistics in ``stats`` precision (see :class:`HalfStatsLayerNorm`); the
    rest of the model in fp32. Reports the run as :func:`_run` and the norms' overflow count and largest sum of
    squares, and the first step at which a norm overflowed (None: never)."""
    from addnorm.nn import TransformerLM

    torch.manual_seed(train["seed"])
    net = TransformerLM(model_config(**{**model, "fuse_add_norm": False}))
    norms = swap_norms(net, stats, clamp)
    first: list[int] = []

    def after_step(entry: dict) -> None:
        if not first and any(m.overflows for m in norms):
            first.append(entry["step"])

    from addnorm.train.config import TrainConfig
    from addnorm.train.loop import reference_eval_loss
    from addnorm.train.loop import train as run

    cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "eval_batches": 2, **train})
    data = CachedBatches(language(lang_seed))
    res = run(net, data, cfg, callback=after_step)
    reference = res.eval_optimum if res.eval_optimum is not None else reference_eval_loss(data, cfg)
    return {
        "initial_loss": _num(res.initial_loss),
        "final_loss": _num(res.final_loss),
        "excess": _num(excess(res.final_loss, res.initial_loss, reference)),
        "diverged": bool(res.diverged),
        "steps_done": res.steps_done,
        "loss_curve": _subsample(res.losses, 50),
        "overflows": sum(m.overflows for m in norms),
        "first_overflow_step": first[0] if first else None,
        "max_sumsq": _num(max(m.max_sumsq for m in norms)),
    }


# ------------------------------------------------------------------------------------------------ fine-tuning
def related_language(seed: int, changed: float, vocab: int = VOCAB):
    """The lab's language of ``seed`` with a fraction ``changed`` of its contexts given new next-token
    distributions (drawn as the language draws its rows): a related language sharing the rest of its rules."""
    from addnorm.train.data import MarkovLanguage

    base = language(seed, vocab)
    fresh = MarkovLanguage(vocab_size=vocab, order=1, branching=3, seed=sub_seed(seed, "fresh-language"))
    rng = np.random.default_rng(sub_seed(seed, "table"))
    rows = rng.choice(vocab, size=round(changed * vocab), replace=False)
    table = base.table.copy()
    table[rows] = fresh.table[rows]
    return MarkovLanguage.from_table(table, order=1, seed=sub_seed(seed, "fresh-language"))


_PRETRAINED: dict[tuple, dict] = {}


def pretrained_state(*, layers: int, pretrain: dict, seed: int, lang_seed: int) -> tuple[dict, dict]:
    """A Post-LN model's state dict after pretraining on the language of ``lang_seed`` (memoized in this process:
    the fine-tuning arms of one seed share it; a pure function of its arguments) and the run's summary."""
    key = (layers, tuple(sorted(pretrain.items())), seed, lang_seed)
    if key not in _PRETRAINED:
        from addnorm.nn import TransformerLM

        torch.manual_seed(seed)
        net = TransformerLM(model_config(n_layers=layers, placement="post"))
        summary = _run(net, CachedBatches(language(lang_seed)), {**pretrain, "seed": seed})
        _PRETRAINED.clear()  # one model at a time is all a worker needs
        _PRETRAINED[key] = {"state": {k: v.clone() for k, v in net.state_dict().items()}, "summary": summary}
    hit = _PRETRAINED[key]
    return hit["state"], hit["summary"]


def finetune_task(
    *, arm: str, layers: int, pretrain: dict, finetune: dict, changed: float, seed: int, lang_seed: int
) -> dict:
    """Fine-tune on the related language (:func:`related_language`) for ``finetune`` (TrainConfig keywords).
    ``arm``: "post" (the pretrained Post-LN model as it is), "pre" (the same weights in a Pre-LN model: every
    block's norm moves to its branch's input, and the final norm, which Post-LN has not, starts at the identity
    init), "scratch-post" / "scratch-pre" (a fresh model of that placement, same init seed)."""
    from addnorm.nn import TransformerLM

    if arm not in ("post", "pre", "scratch-post", "scratch-pre"):
        raise ValueError(f"arm must be post, pre, scratch-post or scratch-pre, got {arm!r}")
    placement = arm.removeprefix("scratch-")
    torch.manual_seed(seed)
    net = TransformerLM(model_config(n_layers=layers, placement=placement))
    pre_summary = None
    if not arm.startswith("scratch"):
        state, pre_summary = pretrained_state(layers=layers, pretrain=pretrain, seed=seed, lang_seed=lang_seed)
        missing, unexpected = net.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("final_norm.") for k in missing):
            raise RuntimeError(
                f"rearranging Post-LN weights as {placement}: missing {missing}, unexpected {unexpected}"
            )
    data = CachedBatches(related_language(lang_seed, changed))
    with torch.no_grad():  # the loss on the new language before any fine-tuning step
        x, y = data.batch(0, BATCH, SEQ, seed=seed, split="val")
        logits = net(x)
        start = float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    out = _run(net, data, {**finetune, "seed": sub_seed(seed, "finetune")})
    out["start_loss"] = _num(start)
    out["pretrain"] = pre_summary
    return out
