"""Train K tiny decoder LMs of one architecture as one batched computation (the lab's seeds and LR grids).

On a CPU, a d_model = 32 model spends most of a step in per-op overhead (dispatch, autograd bookkeeping, small
kernels), so K models that differ only in their weights, batches and optimizer settings train faster as one set of
stacked tensors: every weight gets a leading member dimension K, every linear layer becomes one ``baddbmm`` over
the K members, attention one SDPA call over K * B sequences; all parameters live in one (K, P) buffer, so the
gradient norm, clipping and AdamW are a handful of ops for all members (``benchmarks/results/batched_train.md``:
1.85x to 2.9x the throughput per model on a CPU thread at the lab's sizes).

    params[name]   (K, *shape of that parameter in one TransformerLM)
    ids            (K, B, T)  member k's batch (its own seed)      ->  logits (K, B, T, V)
    loss           sum_k loss_k: member k's gradient is d loss_k / d params_k, untouched by the others

Each member follows :func:`addnorm.train.loop.train` step for step: the same batches (``data.batch(step, ...,
seed=cfg_k.seed)``), cross-entropy + z-loss, its own global gradient-norm clipping, torch's AdamW update (decay on
matrices only, ``independent_wd`` as there), warmup + schedule, divergence check, evaluations and summary. The
numbers agree with ``train()`` up to float rounding (the batched kernels sum in another order), not bitwise:
tests/test_train_batched.py bounds the difference.

A member that diverges leaves the batch (its result is final, as ``train()`` stops), so it costs nothing after.

What the forward covers (anything else raises ValueError naming the field): decoder-only TransformerLM,
placements pre / post / deepnorm / sandwich / none / mix, norms layernorm / rmsnorm / dyt / none, QK-norm, FFN
relu / gelu / swiglu / geglu, learned or no positions, tied or untied head, biases on or off, dropout 0.
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
from addnorm.train.loop import detect_spikes, lr_at, reference_eval_loss

__all__ = ["StackedLM", "VmapLM", "ENGINES", "train_batched", "check_batchable"]

_NORMS = ("layernorm", "rmsnorm", "dyt", "none")
_PLACEMENTS = ("pre", "post", "deepnorm", "sandwich", "none")

# TrainConfig fields every member must share: they shape the batched computation itself (one schedule of steps,
# one batch shape, one Adam state layout) or are not supported in batched training.
_SHARED = (
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


def check_batchable(config) -> None:
    """Raise ValueError (naming the field) when :class:`StackedLM` cannot run a TransformerLM of ``config``."""
    checks = [
        ("norm", config.norm in _NORMS, f"one of {', '.join(_NORMS)}"),
        ("placement", config.placement in _PLACEMENTS + ("mix",), f"one of {', '.join(_PLACEMENTS + ('mix',))}"),
        ("positional", config.positional in ("learned", "none"), "'learned' or 'none'"),
        ("parallel", not config.parallel, "False"),
        ("dropout", config.dropout == 0, "0"),
        ("embed_norm", not config.embed_norm, "False"),
        ("zero_centered_weight", not config.zero_centered_weight, "False"),
        ("norm_kwargs", not config.norm_kwargs, "empty"),
    ]
    for name, ok, want in checks:
        if not ok:
            raise ValueError(
                f"batched training supports TransformerConfig.{name} = {want}, got "
                f"{getattr(config, name)!r}; train this model with addnorm.train.loop.train"
            )


def _norm_kind(module: nn.Module) -> str | None:
    from addnorm.nn.norm_kinds import DyT, NoNorm
    from addnorm.nn.norms import LayerNorm, RMSNorm

    for cls, kind in ((LayerNorm, "layernorm"), (RMSNorm, "rmsnorm"), (DyT, "dyt"), (NoNorm, "none")):
        if isinstance(module, cls):
            return kind
    return None


def _bcast(p: Tensor, x: Tensor) -> Tensor:
    """A stacked parameter (K, *feature shape) viewed to broadcast against x (K, ..., *feature shape)."""
    return p.view(p.shape[0], *([1] * (x.dim() - p.dim())), *p.shape[1:])


class StackedLM:
    """K TransformerLMs of one config as stacked tensors: ``params[name]`` is (K, ...) for every parameter name of
    the module (a tied LM head reads ``embed.tok.weight``). ``forward(ids)`` maps (K, B, T) to (K, B, T, V).

    Built from the modules (so each member keeps its own init); :meth:`write_back` copies member k's weights
    into module k. ``keep(index)`` drops members (a diverged run leaves the batch).
    """

    def __init__(self, models: Sequence[nn.Module]):
        if not models:
            raise ValueError("train_batched needs at least one model")
        config = getattr(models[0], "config", None)
        for i, m in enumerate(models):
            if getattr(m, "config", None) != config:
                raise ValueError(
                    f"models[{i}] has another config than models[0]: batched members share one "
                    "architecture (their weights, seeds and learning rates may differ)"
                )
        from addnorm.nn import TransformerLM

        if not all(isinstance(m, TransformerLM) for m in models):
            bad = next(type(m).__name__ for m in models if not isinstance(m, TransformerLM))
            raise ValueError(f"batched training runs addnorm.nn.TransformerLM models, got a {bad}")
        check_batchable(config)
        self.config = config
        ref = models[0]
        self.n_layers = config.n_layers
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.placements = [block.placement for block in ref.blocks]
        self.alpha = ref.deepnorm_alpha
        self.embed_scale = ref.embed.scale
        self.tied = config.tie_embeddings
        self.record_logits = config.record_logits
        self.final_norm = ref.final_norm is not None
        # each norm's kind and eps, read from the modules themselves (QK-norm is LayerNorm when the model's norm is
        # DyT or none; kinds differ in their default eps)
        self.kinds = {name: kind for name, mod in ref.named_modules() if (kind := _norm_kind(mod)) is not None}
        self.eps = {name: getattr(mod, "eps", None) for name, mod in ref.named_modules()}
        shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        # matrices first: weight decay then touches one leading slice of the flat buffer
        self.names = sorted(shapes, key=lambda n: len(shapes[n]) < 2)
        self.n_decayed = sum(math.prod(shapes[n]) for n in self.names if len(shapes[n]) >= 2)
        own = [dict(m.named_parameters()) for m in models]
        with torch.no_grad():
            flat = torch.cat([torch.stack([o[n].detach().reshape(-1) for o in own]) for n in self.names], dim=1)
        self._shapes = shapes
        self._bind(flat)
        self.max_logits: Tensor | None = None  # (K, n_layers) of the last forward, when record_logits
        self.record_stream = False  # set for a forward whose residual RMS per block should be kept
        self.residual_rms: Tensor | None = None  # (K, n_layers) of that forward
        self._block_names = [[n for n in self.names if n.startswith(f"blocks.{i}.")] for i in range(self.n_layers)]

    def _bind(self, flat: Tensor) -> None:
        """All K members' parameters live in one (K, P) buffer ``flat`` and their gradients in ``grad`` (K, P):
        ``params[name]`` are views of it (autograd accumulates into the preset ``.grad`` views in place), so the
        gradient norm, clipping and AdamW are a few ops on two tensors, not a few per parameter."""
        self.flat, self.grad = flat, torch.zeros_like(flat)
        self.params, start = {}, 0
        for n in self.names:
            size = math.prod(self._shapes[n])
            p = flat[:, start : start + size].view(flat.shape[0], *self._shapes[n]).requires_grad_(True)
            p.grad = self.grad[:, start : start + size].view_as(p)
            self.params[n] = p
            start += size

    @property
    def size(self) -> int:
        return self.flat.shape[0]

    def zero_grad(self) -> None:
        self.grad.zero_()

    def keep(self, index: Tensor) -> None:
        self._bind(self.flat[index])

    @torch.no_grad()
    def block_grad_norms(self) -> Tensor:
        """(K, n_layers): the L2 norm of each block's parameter gradients, per member."""
        k = self.size
        return torch.stack(
            [sum(self.params[n].grad.pow(2).reshape(k, -1).sum(1) for n in names) for names in self._block_names], dim=1
        ).sqrt()

    def check_grads(self) -> None:
        """Autograd accumulates into an existing ``.grad`` in place; should a torch version replace it instead, the
        flat gradient buffer would silently stay zero: fail loudly."""
        start = 0
        for n in self.names:
            if self.params[n].grad.data_ptr() != self.grad[:, start:].data_ptr():
                raise RuntimeError(f"the gradient of {n} did not land in the flat gradient buffer")
            start += math.prod(self._shapes[n])

    @torch.no_grad()
    def write_back(self, models: Sequence[nn.Module], rows: Sequence[int]) -> None:
        """Copy stacked row rows[i] into models[i]'s parameters."""
        for m, r in zip(models, rows):
            own = dict(m.named_parameters())
            for n in self.names:
                own[n].copy_(self.params[n][r])

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def _linear(self, prefix: str, x: Tensor) -> Tensor:
        w = self.params[prefix + ".weight"]  # (K, out, in)
        b = self.params.get(prefix + ".bias")
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        y = torch.bmm(flat, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), flat, w.transpose(1, 2))
        return y.view(*x.shape[:-1], w.shape[1])

    def _norm(self, prefix: str, x: Tensor) -> Tensor:
        kind = self.kinds[prefix]
        w, b = self.params.get(prefix + ".weight"), self.params.get(prefix + ".bias")
        if kind == "none":
            return x
        if kind == "dyt":
            alpha = self.params[prefix + ".alpha"]  # (K,): one scalar per member
            out = torch.tanh(alpha.view(-1, *([1] * (x.dim() - 1))) * x)
        elif kind == "layernorm":
            out = F.layer_norm(x, x.shape[-1:], None, None, self.eps[prefix])
        else:
            out = F.rms_norm(x, x.shape[-1:], None, self.eps[prefix])
        if w is not None:
            out = out * _bcast(w, out)
        if b is not None and kind != "rmsnorm":
            out = out + _bcast(b, out)
        return out

    def _attention(self, prefix: str, x: Tensor, layer: int) -> Tensor:
        k_, b, t, d = x.shape
        h, dh = self.n_heads, self.head_dim

        def heads(name):  # (K, B, T, d) -> (K, B, H, T, dh)
            return self._linear(f"{prefix}.{name}", x).view(k_, b, t, h, dh).transpose(2, 3)

        q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
        if self.config.qk_norm:
            q, k = self._norm(f"{prefix}.q_norm", q), self._norm(f"{prefix}.k_norm", k)
        if self.record_logits:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            self._logits.append(scores.detach().amax(dim=(1, 2, 3, 4)))
            y = torch.softmax(scores, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(
                q.reshape(k_ * b, h, t, dh), k.reshape(k_ * b, h, t, dh), v.reshape(k_ * b, h, t, dh), is_causal=t > 1
            )
        y = y.reshape(k_, b, h, t, dh).transpose(2, 3).reshape(k_, b, t, d)
        return self._linear(f"{prefix}.out_proj", y)

    def _ffn(self, prefix: str, x: Tensor) -> Tensor:
        act = {"relu": F.relu, "gelu": F.gelu, "swiglu": F.silu, "geglu": F.gelu}[self.config.ffn]
        if self.config.ffn in ("swiglu", "geglu"):
            hidden = act(self._linear(f"{prefix}.fc_gate", x)) * self._linear(f"{prefix}.fc_in", x)
        else:
            hidden = act(self._linear(f"{prefix}.fc_in", x))
        return self._linear(f"{prefix}.fc_out", hidden)

    def _residual(self, prefix: str, placement: str, x: Tensor, branch) -> Tensor:
        """The placements of :class:`addnorm.nn.Residual` (its docstring has the formulas)."""
        sub = f"{prefix}.sublayer"
        if placement == "pre":
            return x + branch(sub, self._norm(f"{prefix}.norm", x))
        if placement == "sandwich":
            return x + self._norm(f"{prefix}.norm_out", branch(sub, self._norm(f"{prefix}.norm", x)))
        if placement == "none":
            return x + branch(sub, x)
        if placement == "post":
            return self._norm(f"{prefix}.norm", branch(sub, x) + x)
        return self._norm(f"{prefix}.norm", branch(sub, x) + self.alpha * x)  # deepnorm

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() != 3 or ids.shape[0] != self.size or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an integer tensor (K={self.size}, B, T), got {ids.dtype} {tuple(ids.shape)}")
        k_, b, t = ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        tok = self.params["embed.tok.weight"]  # (K, V, d)
        vocab = tok.shape[1]
        offsets = torch.arange(k_, device=ids.device).view(k_, 1, 1) * vocab
        x = F.embedding(ids + offsets, tok.reshape(k_ * vocab, -1))  # member k reads its own table
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if "embed.pos.weight" in self.params:
            x = x + self.params["embed.pos.weight"][:, None, :t]
        self._logits: list[Tensor] = []
        rms: list[Tensor] = []
        for i, placement in enumerate(self.placements):
            x = self._residual(f"blocks.{i}.attn", placement, x, lambda p, h, i=i: self._attention(p, h, i))
            x = self._residual(f"blocks.{i}.ffn", placement, x, self._ffn)
            if self.record_stream:
                rms.append(x.detach().pow(2).mean(dim=(1, 2, 3)).sqrt())
        if self.record_logits:
            self.max_logits = torch.stack(self._logits, dim=1)
        if self.record_stream:
            self.residual_rms = torch.stack(rms, dim=1)
        if self.final_norm:
            x = self._norm("final_norm", x)
        head = tok if self.tied else self.params["lm_head.proj.weight"]
        return torch.bmm(x.reshape(k_, b * t, -1), head.transpose(1, 2)).view(k_, b, t, vocab)

    __call__ = forward


class VmapLM(StackedLM):
    """The same stacked parameters, run through the unmodified module with ``torch.func.functional_call`` under
    ``torch.vmap`` (the generic way to batch models). Slower than :class:`StackedLM` on CPU (vmap's per-op
    wrapping, and SDPA has no batching rule, so it falls back to a loop over members); kept as a cross-check and
    for ``benchmarks/bench_batched_train.py``. Records nothing (no ``monitor``, no ``record_logits``)."""

    def __init__(self, models: Sequence[nn.Module]):
        import copy

        super().__init__(models)
        if self.record_logits:
            raise ValueError("engine='vmap' cannot record attention logits (record_logits=True): use engine='stacked'")
        self._module = copy.deepcopy(models[0])
        self._buffers = {n: b for n, b in self._module.named_buffers()}

    def forward(self, ids: Tensor) -> Tensor:
        from torch.func import functional_call

        def one(params, x):
            return functional_call(self._module, (params, self._buffers), (x,))

        with warnings.catch_warnings():  # the SDPA fallback named in the class docstring, once per forward
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
            return torch.vmap(one)(self.params, ids)

    __call__ = forward


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
        for name in _SHARED:
            if getattr(c, name) != getattr(cfgs[0], name):
                raise ValueError(
                    f"cfgs[{i}].{name} = {getattr(c, name)!r} differs from cfgs[0].{name} = "
                    f"{getattr(cfgs[0], name)!r}; batched members share {', '.join(_SHARED)}"
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
    weight_decay, independent_wd, clip, z_loss, diverge_factor; the rest must be equal (see ``_SHARED``).
    Returns one :class:`TrainResult` per model, as ``train(models[k], data, cfgs[k])`` would (up to float
    rounding); the trained weights are written back into the models. ``engine``: "stacked" (hand-written batched
    forward, the fast one) or "vmap" (:class:`VmapLM`, the generic one, slower). ``callback`` receives after each
    step ``{"step", "members" (how many trained in it), "time_s" (its wall time), "losses" (theirs)}``.
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
        run = [cfgs[k] for k in active]
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
            callback({"step": step, "members": len(run), "time_s": wall, "losses": ce_v})
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
    for res, c in zip(results, cfgs):
        if res.diverged:
            res.final_loss = math.nan
        finite = [v for _, v in res.evals if math.isfinite(v)]
        res.best_loss = min(finite) if finite else math.nan
        res.spikes = detect_spikes(res.losses, window=c.spike_window, sigma=c.spike_sigma)
        res.max_grad_norm = max((g for g in res.grad_norms if math.isfinite(g)), default=math.nan)
    return results
