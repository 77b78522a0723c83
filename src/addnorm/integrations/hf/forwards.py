"""The fused layer forwards :func:`addnorm.integrations.hf.apply` installs, and which layer classes get them.

Each replaces a forward of the installed transformers (read from its source) line for line, except that
"residual = residual + out; h = norm(residual)" becomes one call "h, residual = norm(out, residual)". Which classes
match is recognised from their structure (:mod:`addnorm.integrations.hf.layer_match`), never from a family's name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from addnorm.integrations.hf import layer_match, rewrite
from addnorm.integrations.hf.chain import norm_add_handoff, norm_add_norm
from addnorm.integrations.hf.handoff import add_handoff, count_fused_run

__all__ = ["LayerRule", "Signature", "from_transformers", "layer_rule"]


@dataclass(frozen=True)
class Signature:
    """The original forward's parameters after (self, hidden_states), read once per class: binding by hand keeps the
    fused forward free of inspect calls (cheap per layer call, and nothing for torch.compile to trip on)."""

    names: tuple[str, ...]  # named parameters, in order
    defaults: dict  # name -> default, for those that have one
    var_keyword: bool  # whether the original takes **kwargs
    # decided once per class for the per-call fast path of _bound_arguments (all keywords, no renaming, no unknown
    # name, nothing missing): the names as a set, those without a default, and whether the old keyword
    # ``past_key_values`` is renamed to ``cache``
    name_set: frozenset = frozenset()
    required: tuple[str, ...] = ()
    renames_cache: bool = False

    @classmethod
    def of(cls, fn) -> Signature:
        params = list(inspect.signature(fn).parameters.values())[2:]
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        names = tuple(p.name for p in named)
        defaults = {p.name: p.default for p in named if p.default is not p.empty}
        return cls(
            names=names,
            defaults=defaults,
            var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
            name_set=frozenset(names),
            required=tuple(n for n in names if n not in defaults),
            renames_cache="cache" in names and "past_key_values" not in names,
        )


def _bound_arguments(self, hidden_states, args, kwargs) -> dict:
    """The original forward's arguments after hidden_states, by name, defaults filled in, **kwargs flattened."""
    sig: Signature = self._addnorm_signature
    if not args and not (sig.renames_cache and "past_key_values" in kwargs):
        # how generate() calls a layer: keywords only. One dict merge; the checks below only when it is not clean
        out = {**sig.defaults, **kwargs}
        if (sig.var_keyword or kwargs.keys() <= sig.name_set) and all(n in out for n in sig.required):
            return out
    where = f"{type(self).__name__}.forward()"
    if len(args) > len(sig.names):
        raise TypeError(f"{where} takes {len(sig.names) + 1} positional arguments, got {len(args) + 1}")
    out = dict(sig.defaults)
    out.update(zip(sig.names, args))
    for name, value in kwargs.items():
        if name == "past_key_values" and "cache" in sig.names and "past_key_values" not in sig.names:
            # transformers' deprecate_kwarg wraps the original forward and renames the old keyword the same way
            if "cache" in kwargs:
                continue
            name = "cache"
        if name in sig.names[: len(args)]:
            raise TypeError(f"{where} got multiple values for argument {name!r}")
        if name not in sig.names and not sig.var_keyword:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        out[name] = value
    missing = [n for n in sig.names if n not in out]
    if missing:
        raise TypeError(f"{where} missing required arguments: {', '.join(missing)}")
    return out


def _role(self, name: str) -> nn.Module:
    return getattr(self, self._addnorm_roles[name])


def _pre_forward(self, hidden_states, *args, **kwargs):
    """Template "pre" (and "pre-scaled"): x + attn(norm1(x)), then + mlp(norm2(.)), norm2 fused with the add."""
    # the original passes every argument but hidden_states on to the attention (layer_match checked it)
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    scale = self._addnorm_roles.get("scale")
    residual = hidden_states
    hidden_states = _role(self, "norm1")(hidden_states)
    hidden_states, _ = _role(self, "attn")(hidden_states=hidden_states, **attn_kwargs)
    if scale is not None:
        hidden_states = hidden_states * getattr(self, scale)  # residual + h * m == h * m + residual, bit for bit
    hidden_states, residual = _role(self, "norm2")(hidden_states, residual)
    count_fused_run("add_norm")
    hidden_states = _role(self, "mlp")(hidden_states)
    if scale is not None:
        hidden_states = hidden_states * getattr(self, scale)
    return add_handoff(self, residual, hidden_states)  # fused with the next layer's input norm once linked


def _sandwich_forward(self, hidden_states, *args, **kwargs):
    """Template "sandwich": x + norm2(attn(norm1(x))), then norm3 (before the MLP) on the sum, and the same around
    the MLP with norm4 and the next layer's input norm: each post-norm, add and next pre-norm one call (chain.py)."""
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    residual = hidden_states
    hidden_states = _role(self, "norm1")(hidden_states)
    hidden_states, _ = _role(self, "attn")(hidden_states=hidden_states, **attn_kwargs)
    # norm2's output added to the stream, and norm3 on the sum: one norm_add_norm call
    hidden_states, residual = norm_add_norm(_role(self, "norm2"), _role(self, "norm3"), hidden_states, residual)
    hidden_states = _role(self, "mlp")(hidden_states)
    # norm4's output added, and (once linked) the next layer's input norm on the sum: one norm_add_norm call
    return norm_add_handoff(self, _role(self, "norm4"), hidden_states, residual)


def _post_output_forward(self, hidden_states, input_tensor):
    """Template "post-output" (BERT's output sublayers): norm(dropout(dense(h)) + input) as one fused add + norm."""
    hidden_states = _role(self, "dropout")(_role(self, "dense")(hidden_states))
    count_fused_run("add_norm")
    return _role(self, "norm")(hidden_states, input_tensor)[0]


def _gpt2_forward(self, hidden_states, *args, **kwargs):
    """GPT2Block: ln_2 (and ln_cross_attn) fused with the residual add before it."""
    a = _bound_arguments(self, hidden_states, args, kwargs)
    cache, mask, use_cache = a.pop("cache"), a.pop("attention_mask"), a.pop("use_cache")
    encoder_hidden_states, encoder_mask = a.pop("encoder_hidden_states"), a.pop("encoder_attention_mask")
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    branch, _ = self.attn(hidden_states, cache=cache, attention_mask=mask, use_cache=use_cache, **a)
    if encoder_hidden_states is not None:
        if not hasattr(self, "crossattention"):
            raise ValueError(
                f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                "cross-attention layers by setting `config.add_cross_attention=True`"
            )
        hidden_states, residual = self.ln_cross_attn(branch, residual)
        count_fused_run("add_norm")
        branch, _ = self.crossattention(
            hidden_states,
            cache=cache,
            attention_mask=mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_mask,
        )
    hidden_states, residual = self.ln_2(branch, residual)
    count_fused_run("add_norm")
    return add_handoff(self, residual, self.mlp(hidden_states))


# --------------------------------------------------------------------------------------------------------------
# What to patch: recognised from the model's structure
# --------------------------------------------------------------------------------------------------------------


# the add each template returns is handed off to the next layer's input norm (links.link reads this)
for _forward in (_pre_forward, _sandwich_forward, _gpt2_forward):
    _forward._addnorm_handoff = True


@dataclass(frozen=True)
class LayerRule:
    forward: object
    fused_norms: tuple[str, ...]  # roles of the norms called with a residual: they must be addnorm modules


_TEMPLATE_RULES = {
    "pre": LayerRule(_pre_forward, ("norm2",)),
    "pre-scaled": LayerRule(_pre_forward, ("norm2",)),
    "sandwich": LayerRule(_sandwich_forward, ("norm3",)),
    "post-output": LayerRule(_post_output_forward, ("norm",)),
}

# GPT-2's block (self- and cross-attention, several return paths) is matched by the lines the fused forward rewrites
# and its exact parameters; the attribute names are GPT-2's own.
_GPT2_LINES = (
    "hidden_states = attn_output + residual",
    "hidden_states = self.ln_2(hidden_states)",
    "hidden_states = residual + cross_attn_output",
    "hidden_states = residual + feed_forward_hidden_states",
)
_GPT2_PARAMS = (
    "self",
    "hidden_states",
    "cache",
    "attention_mask",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "use_cache",
    "kwargs",
)
_GPT2_ROLES = {"norm1": "ln_1", "attn": "attn", "norm2": "ln_2", "mlp": "mlp"}


def _normalized_source(fn) -> str | None:
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    return "\n".join(" ".join(line.split()) for line in src.splitlines())


def _is_gpt2_block(cls: type) -> bool:
    if tuple(inspect.signature(cls.forward).parameters) != _GPT2_PARAMS:
        return False
    src = _normalized_source(cls.forward)
    return src is not None and all(line in src for line in _GPT2_LINES)


def from_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def layer_rule(module: nn.Module) -> tuple[LayerRule, dict[str, str]] | None:
    """The fused forward for ``module``'s class and its roles -> attribute names, or None."""
    cls = type(module)
    if not from_transformers(cls):
        return None
    found = layer_match.match(cls)
    if found is not None:
        return _TEMPLATE_RULES[found.template], found.roles
    if _is_gpt2_block(cls):
        cross = {"norm_cross": "ln_cross_attn"} if hasattr(module, "ln_cross_attn") else {}
        return LayerRule(_gpt2_forward, ("norm2",) + tuple(cross)), {**_GPT2_ROLES, **cross}
    # any other forward with a residual add next to a norm: its own source rewritten (rewrite.py)
    rewritten = rewrite.rewrite_forward(cls, rewrite.norm_attributes(module))
    if rewritten is not None:
        return LayerRule(rewritten.forward, rewritten.fused), {attr: attr for attr in rewritten.fused}
    return None
