"""K TransformerLMs of one config as one set of stacked tensors: the model side of
:func:`addnorm.train.batched.train_batched` (its docstring says why that trains faster on a CPU).

    params[name]   (K, *shape of that parameter in one TransformerLM)
    ids            (K, B, T)  member k's batch (its own seed)      ->  logits (K, B, T, V)
    loss           sum_k loss_k: member k's gradient is d loss_k / d params_k, untouched by the others

What the forward covers (anything else raises ValueError naming the field): decoder-only TransformerLM,
placements pre / post / deepnorm / sandwich / none / mix / rezero / branch-output, norms layernorm / rmsnorm / dyt
(any ``alpha_init``) / none, LayerNorm Scaling, QK-norm, FFN relu / gelu / swiglu / geglu, learned or no positions,
tied or untied head, biases on or off, dropout 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.nn.placements import PLACEMENTS, Placement, branch_forward, residual_forward

__all__ = ["StackedLM", "VmapLM", "check_batchable"]

_NORMS = ("layernorm", "rmsnorm", "dyt", "none")
# every placement with a skip path (the lab's *-noskip placements are not batched), and Mix-LN
_PLACEMENTS = tuple(name for name in PLACEMENTS if Placement.named(name).skip) + ("mix",)
# norm_kwargs that only set an initial value (the stacked forward reads the parameters themselves)
_INIT_ONLY_NORM_KWARGS = ("alpha_init",)


def check_batchable(config) -> None:
    """Raise ValueError (naming the field) when :class:`StackedLM` cannot run a TransformerLM of ``config``."""
    checks = [
        ("norm", config.norm in _NORMS, f"one of {', '.join(_NORMS)}"),
        ("placement", config.placement in _PLACEMENTS, f"one of {', '.join(_PLACEMENTS)}"),
        ("positional", config.positional in ("learned", "none"), "'learned' or 'none'"),
        ("parallel", not config.parallel, "False"),
        ("dropout", config.dropout == 0, "0"),
        ("embed_norm", not config.embed_norm, "False"),
        ("zero_centered_weight", not config.zero_centered_weight, "False"),
        (
            "norm_kwargs",
            set(config.norm_kwargs) <= set(_INIT_ONLY_NORM_KWARGS),
            f"empty or only {', '.join(_INIT_ONLY_NORM_KWARGS)}",
        ),
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
        # LayerNorm Scaling's factor on each branch's normalized input (1 without it), per residual module
        self.input_scale = {
            name: float(getattr(mod, "norm_output_scale", 1.0))
            for name, mod in ref.named_modules()
            if hasattr(mod, "placement") and hasattr(mod, "norm_output_scale")
        }
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

    def _residual(self, prefix: str, placement: str, x: Tensor, sublayer) -> Tensor:
        """One residual step of :class:`addnorm.nn.Residual`'s forward (:func:`residual_forward`), on stacked
        members: the same pieces, read from the stacked parameters. Sandwich and branch-output add their Norm_out
        as the norm and then the add, not through :func:`addnorm.ops.norm_add` as Residual does: the op takes one
        weight per feature, the members' weights are (K, d) (a loop over members would undo the batching), and the
        stacked norms keep their own order of roundings (F.layer_norm / F.rms_norm, then the weight), which the
        batched tests hold to the modules' within a tolerance."""
        p = Placement.named(placement)
        sub = f"{prefix}.sublayer"
        scale = self.input_scale.get(prefix, 1.0)
        # rezero's learned scalar, one per member: (K,) viewed to broadcast against x
        gate = self.params[f"{prefix}.rezero_alpha"].view(-1, *([1] * (x.dim() - 1))) if p.gate else None

        def branch(h: Tensor) -> Tensor:  # LayerNorm Scaling's factor on the normalized input, as Residual.branch
            if scale != 1.0:
                h = h * scale
            return branch_forward(p, lambda h: sublayer(sub, h), h, lambda y: self._norm(f"{prefix}.norm_out", y), gate)

        def norm(h: Tensor) -> Tensor:
            return self._norm(f"{prefix}.norm", h)

        return residual_forward(p, x, branch, norm, lambda y, r: norm(y + r), alpha=self.alpha)

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
