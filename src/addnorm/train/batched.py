"""Train K tiny decoder LMs of one architecture as one batched computation (the lab's seeds and LR grids).

On a CPU, a d_model = 32 model spends most of a step in per-op overhead (dispatch, autograd bookkeeping, small
kernels), so K models that differ only in their weights, batches and optimizer settings train faster as one set of
stacked tensors: every weight gets a leading member dimension K, every linear layer becomes one ``baddbmm`` over
the K members, attention one SDPA call over K * B sequences; all parameters live in one (K, P) buffer, so the
gradient norm, clipping and AdamW are a handful of ops for all members (``benchmarks/results/batched_train.md``:
1.85x to 2.9x the throughput per model on a CPU thread at the lab's sizes).

The K models run as :class:`addnorm.train.stacked.StackedLM` (its docstring: the stacked shapes, and which
architectures it covers).

Each member follows :func:`addnorm.train.loop.train` step for step: the same batches (``data.batch(step, ...,
seed=cfg_k.seed)``), cross-entropy + z-loss, its own global gradient-norm clipping, torch's AdamW update (decay on
matrices only, ``independent_wd`` as there), warmup + schedule, divergence check, evaluations and summary. The
numbers agree with ``train()`` up to float rounding (the batched kernels sum in another order), not bitwise:
tests/train/test_train_batched.py bounds the difference.

A member that diverges leaves the batch (its result is final, as ``train()`` stops), so it costs nothing after.

``cfg.monitor`` records, every ``monitor_every`` steps, a subset of :class:`addnorm.diagnostics.Monitor`'s record:
``step``, ``loss``, ``grad_norm``, ``output_logz`` and per layer ``grad_norm`` (the block's parameters, before
clipping), ``residual_rms`` (of the stream after the block) and, with ``record_logits=True`` in the model config,
``max_attn_logit``; not ``norm_input_rms`` or the update-size probe.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.train.config import TrainConfig, TrainResult
from addnorm.train.loop import detect_spikes, finite_weights, lr_at, reference_eval_loss
from addnorm.train.stacked import StackedLM, VmapLM

__all__ = ["ENGINES", "SHARED_FIELDS", "train_batched"]

# TrainConfig fields every member must share: they shape the batched computation itself (one schedule of steps,
# one batch shape, one Adam state layout) or are not supported in batched training.
SHARED_FIELDS = (
    "steps",
    "batch_size",
    "seq_len",
    "beta1",
    "beta2",
    "adam_eps",
    "eval_every",
    "eval_batches",
    "monitor",
    "monitor_every",
    "device",
    "spike_window",
    "spike_sigma",
)


# ------------------------------------------------------------------------------------------------------------------
# AdamW over stacked tensors (torch.optim.AdamW's update, with a learning rate and decay per member)
# ------------------------------------------------------------------------------------------------------------------
class _Adam:
    """torch.optim.AdamW's update on the flat (K, P) buffers of :class:`StackedLM`."""

    def __init__(self, model: StackedLM):
        self.m, self.v = torch.zeros_like(model.flat), torch.zeros_like(model.flat)
        self.steps = 0

    def keep(self, index: Tensor) -> None:
        self.m, self.v = self.m[index], self.v[index]

    @torch.no_grad()
    def step(self, model: StackedLM, lr: Tensor, decay: Tensor, beta1: float, beta2: float, eps: float) -> None:
        """lr (K,): this step's learning rate per member; decay (K,): lr * weight decay (matrices only)."""
        self.steps += 1
        bc1, bc2 = 1 - beta1**self.steps, 1 - beta2**self.steps
        p, g = model.flat, model.grad
        p[:, : model.n_decayed].mul_((1 - decay)[:, None])  # decoupled decay of the matrices, as torch's AdamW
        self.m.lerp_(g, 1 - beta1)
        self.v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (self.v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(self.m * (-lr / bc1)[:, None], denom)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------
def _check_configs(cfgs: Sequence[TrainConfig]) -> None:
    for i, c in enumerate(cfgs):
        if not isinstance(c, TrainConfig):
            raise TypeError(f"cfgs[{i}] must be a TrainConfig, got {type(c).__name__}")
        # checkpoint_every alone does nothing without an out_dir (train() checkpoints only into out_dir)
        if c.out_dir or c.resume:
            raise ValueError(
                f"cfgs[{i}]: batched training writes no logs or checkpoints (out_dir and resume must "
                "be unset); train this run with addnorm.train.loop.train"
            )
        for name in SHARED_FIELDS:
            if getattr(c, name) != getattr(cfgs[0], name):
                raise ValueError(
                    f"cfgs[{i}].{name} = {getattr(c, name)!r} differs from cfgs[0].{name} = "
                    f"{getattr(cfgs[0], name)!r}; batched members share {', '.join(SHARED_FIELDS)}"
                )


def _batches(data, step: int, cfgs: Sequence[TrainConfig], split: str, device) -> tuple[Tensor, Tensor]:
    """Each member's batch of ``step`` (members with one seed share it: an LR grid builds it once)."""
    cache: dict[int, tuple[Tensor, Tensor]] = {}
    for c in cfgs:
        if c.seed not in cache:
            cache[c.seed] = data.batch(step, c.batch_size, c.seq_len, seed=c.seed, split=split)
    xs, ys = zip(*(cache[c.seed] for c in cfgs))
    return torch.stack(xs).to(device), torch.stack(ys).to(device)


def _per_member_loss(logits: Tensor, y: Tensor) -> Tensor:
    k = logits.shape[0]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return ce.view(k, -1).mean(1)


@torch.no_grad()
def _evaluate(model: StackedLM, data, cfgs: Sequence[TrainConfig], device) -> list[float]:
    """Each member's mean validation loss over its ``eval_batches`` fixed batches (as loop.evaluate)."""
    total = torch.zeros(len(cfgs), dtype=torch.float64)
    for i in range(cfgs[0].eval_batches):
        x, y = _batches(data, i, cfgs, "val", device)
        total += _per_member_loss(model(x), y).double().cpu()
    return (total / cfgs[0].eval_batches).tolist()


ENGINES = {"stacked": StackedLM, "vmap": VmapLM}


def train_batched(
    models: Sequence[nn.Module],
    data,
    cfgs: Sequence[TrainConfig],
    *,
    engine: str = "stacked",
    callback: Callable[[dict], None] | None = None,
) -> list[TrainResult]:
    """Train ``models[k]`` with ``cfgs[k]`` on ``data`` for every k, as one batched computation.

    models: TransformerLMs of one config (each initialised by the caller, e.g. under ``torch.manual_seed``);
    cfgs: one TrainConfig per model. Per member may differ: seed, lr, warmup, schedule, min_lr_ratio,
    weight_decay, independent_wd, clip, z_loss, diverge_factor; the rest must be equal (see ``SHARED_FIELDS``).
    Returns one :class:`TrainResult` per model, as ``train(models[k], data, cfgs[k])`` would (up to float
    rounding); the trained weights are written back into the models. ``engine``: "stacked" (hand-written batched
    forward, the fast one) or "vmap" (:class:`VmapLM`, the generic one, slower). ``callback`` receives after each
    step ``{"step", "members" (how many trained in it), "active" (their indices into ``models``), "time_s" (its
    wall time), "losses" and "mean_logits" (theirs, in the order of "active"; the mean output logit over
    positions and vocabulary)}``.
    ``step_times`` hold each batched step's wall time divided by the members it trained (the cost per model).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    models, cfgs = list(models), list(cfgs)
    if len(models) != len(cfgs):
        raise ValueError(
            f"train_batched needs one TrainConfig per model, got {len(models)} models and {len(cfgs)} configs"
        )
    if not cfgs:
        raise ValueError("train_batched needs at least one model")
    _check_configs(cfgs)
    shared = cfgs[0]
    device = torch.device(shared.device)
    for split in ("train", "val"):  # a split too short for seq_len fails now, not at the final evaluation
        data.batch(0, 1, shared.seq_len, seed=shared.seed, split=split)
    for m in models:
        m.to(device)
    stacked = ENGINES[engine](models)
    if shared.monitor and engine == "vmap":
        raise ValueError("engine='vmap' records nothing (monitor=True): use engine='stacked'")
    adam = _Adam(stacked)
    optimum = data.optimum(shared.seq_len) if hasattr(data, "optimum") else None
    results = [TrainResult(optimum=optimum) for _ in cfgs]
    active = list(range(len(cfgs)))  # member indices still training, in stacked row order
    for step in range(shared.steps):
        t0 = time.perf_counter()
        members, run = list(active), [cfgs[k] for k in active]
        x, y = _batches(data, step, run, "train", device)
        monitoring = shared.monitor and step % shared.monitor_every == 0
        stacked.record_stream = monitoring
        logits = stacked(x)
        stacked.record_stream = False
        ce = _per_member_loss(logits, y)
        logz_all = torch.logsumexp(logits.float(), dim=-1)  # (K, B, T)
        zl = (logz_all**2).mean(dim=(1, 2))
        zcoef = [c.z_loss for c in run]
        loss = ce + torch.tensor(zcoef, device=device) * zl if any(zcoef) else ce
        stacked.zero_grad()
        with warnings.catch_warnings():
            # the .grad views into the flat buffer are strided like their parameters, not contiguous; autograd
            # notes that and still accumulates into them in place (check_grads verifies it)
            warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
            loss.sum().backward()  # member k's parameters only see loss_k
        if step == 0:
            stacked.check_grads()
        if monitoring:  # before clipping, as the Monitor in train() sees them
            block_norms, stream_rms = stacked.block_grad_norms().tolist(), stacked.residual_rms.tolist()
            attn_logits = stacked.max_logits.tolist() if stacked.record_logits else None
        gnorm = stacked.grad.pow(2).sum(1).sqrt()
        clip = torch.tensor([c.clip if c.clip else math.inf for c in run], device=device)
        coef = (clip / (gnorm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule, per member
        stacked.grad.mul_(coef[:, None])
        ce_v, logz_v, gn_v = ce.tolist(), logz_all.detach().mean(dim=(1, 2)).tolist(), gnorm.tolist()
        # the mean output logit over positions and vocabulary (the lab's z-loss experiment follows its drift)
        mean_v = logits.detach().float().mean(dim=(1, 2, 3)).tolist() if callback is not None else None
        lrs = [lr_at(c, step) for c in run]
        diverged = []
        for row, k in enumerate(active):
            res, c = results[k], cfgs[k]
            if step == 0:
                res.initial_loss = ce_v[row]
            if not math.isfinite(ce_v[row]) or ce_v[row] > c.diverge_factor * res.initial_loss:
                res.diverged = True
                diverged.append(row)
            res.losses.append(ce_v[row])
            res.lrs.append(lrs[row])
            res.grad_norms.append(gn_v[row])
            res.logz.append(logz_v[row])
            res.steps_done = step + 1
            if monitoring:
                layers = [
                    {"index": i, "grad_norm": g, "residual_rms": r}
                    for i, (g, r) in enumerate(zip(block_norms[row], stream_rms[row]))
                ]
                if attn_logits is not None:
                    for layer, v in zip(layers, attn_logits[row]):
                        layer["max_attn_logit"] = v
                res.records.append(
                    {
                        "step": step,
                        "loss": ce_v[row],
                        "grad_norm": gn_v[row],
                        "output_logz": logz_v[row],
                        "layers": layers,
                    }
                )
        if diverged:  # train() stops such a run before its optimizer step: hand back the weights it diverged with
            stacked.write_back([models[active[r]] for r in diverged], diverged)
        lr_t = torch.tensor(lrs, device=device)
        # decay per step: lr(t) * wd, or with independent_wd wd * m(t) = lr(t) * (wd / lr) (see loop.py)
        decay = torch.tensor(
            [lr * (c.weight_decay / c.lr if c.independent_wd else c.weight_decay) for lr, c in zip(lrs, run)],
            device=device,
        )
        adam.step(stacked, lr_t, decay, shared.beta1, shared.beta2, shared.adam_eps)
        if diverged:  # they leave the batch (their update above is dropped with them)
            keep = [row for row in range(len(active)) if row not in diverged]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            stacked.keep(index)
            adam.keep(index)
            active = [active[r] for r in keep]
        wall = time.perf_counter() - t0
        dt = wall / len(run)
        if callback is not None:
            callback(
                {
                    "step": step,
                    "members": len(run),
                    "active": members,
                    "time_s": wall,
                    "losses": ce_v,
                    "mean_logits": mean_v,
                }
            )
        for k in [k for k in range(len(cfgs)) if results[k].steps_done == step + 1]:
            results[k].step_times.append(dt)
        if not active:
            break
        if shared.eval_every and (step + 1) % shared.eval_every == 0 and step + 1 < shared.steps:
            for k, v in zip(active, _evaluate(stacked, data, [cfgs[k] for k in active], device)):
                results[k].evals.append((step + 1, v))
    if active:
        finals = _evaluate(stacked, data, [cfgs[k] for k in active], device)
        stacked.write_back([models[k] for k in active], range(len(active)))
        for k, v in zip(active, finals):
            results[k].final_loss = v
            results[k].evals.append((shared.steps, v))
            results[k].eval_optimum = reference_eval_loss(data, cfgs[k])
            # as in train(): the last update is seen by no training step; non-finite here means it diverged
            if not math.isfinite(v) or not finite_weights(models[k]):
                results[k].diverged = True
    for res, c in zip(results, cfgs):
        if res.diverged:
            res.final_loss = math.nan
        finite = [v for _, v in res.evals if math.isfinite(v)]
        res.best_loss = min(finite) if finite else math.nan
        res.spikes = detect_spikes(res.losses, window=c.spike_window, sigma=c.spike_sigma)
        res.max_grad_norm = max((g for g in res.grad_norms if math.isfinite(g)), default=math.nan)
    return results
