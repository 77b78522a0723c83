"""TransformerConfig: every Add & Norm choice of a Transformer as one dataclass, plus model-family presets.

Presets follow each family's published block (its paper and reference implementation), at tiny CPU-friendly sizes:

    preset     norm       placement   block        ffn     final norm   notes
    original   LayerNorm  post        sequential   relu    no           sinusoidal positions, Xavier, sqrt(d) embed
    bert       LayerNorm  post        sequential   gelu    no           LayerNorm on the embeddings
    gpt2       LayerNorm  pre         sequential   gelu    yes          residual init scaling 1/sqrt(2L)
    gpt3       LayerNorm  pre         sequential   gelu    yes          as GPT-2 (dense attention here)
    palm       LayerNorm  pre         parallel     swiglu  yes          no biases, RoPE
    llama      RMSNorm    pre         sequential   swiglu  yes          no biases, RoPE, untied embeddings
    mistral    RMSNorm    pre         sequential   swiglu  yes          as LLaMA (full attention here)
    qwen       RMSNorm    pre         sequential   swiglu  yes          as LLaMA
    deepseek   RMSNorm    pre         sequential   swiglu  yes          as LLaMA (dense FFN here)
    gemma      RMSNorm    pre         sequential   geglu   yes          weight (1 + w), tied, sqrt(d) embed
    deepnet    LayerNorm  deepnorm    sequential   gelu    no           alpha/beta from depth, Xavier init

Each preset fixes its norm's eps (1e-12 bert, 1e-6 the RMSNorm families, 1e-5 the others; sources beside PRESETS),
so it does not follow the dtype as eps=None does for RMSNorm. Presets describe architecture; dropout is a training
choice and defaults to 0 everywhere (override it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from addnorm.nn.ffn import FFN_KINDS
from addnorm.nn.norm_kinds import NORM_KINDS
from addnorm.nn.placements import PLACEMENTS, Placement

__all__ = ["TransformerConfig", "CONFIG_PLACEMENTS", "POSITIONALS", "INITS", "PRESETS"]

CONFIG_PLACEMENTS = PLACEMENTS + ("mix",)
POSITIONALS = ("learned", "sinusoidal", "rope", "none")
INITS = ("normal", "xavier")
BACKENDS = ("auto", "torch", "reference", "triton", "cpu")

_LLAMA = dict(norm="rmsnorm", placement="pre", ffn="swiglu", bias=False, positional="rope", tie_embeddings=False)

# Every preset fixes its norm's eps. eps=None would be torch.nn.RMSNorm's default, the dtype's machine epsilon (1.2e-7
# in fp32, 7.8e-3 in bf16), so a preset model cast to bf16 would compute another function. The values are the defaults
# of the Hugging Face transformers configuration classes named beside them (checked against transformers 5.25.0;
# tests/nn/test_nn_models.py compares them where transformers is installed). A family transformers has no class for
# keeps torch.nn.LayerNorm's default 1e-5, what eps=None gave it (LayerNorm's None is a fixed 1e-5).

# name -> (fields, one-line description)
PRESETS: dict[str, tuple[dict, str]] = {
    "original": (
        dict(
            norm="layernorm",
            placement="post",
            ffn="relu",
            final_norm=False,
            positional="sinusoidal",
            init="xavier",
            embed_scale=True,
            eps=1e-5,  # no transformers class; torch.nn.LayerNorm's default
        ),
        "Vaswani et al. 2017: LayerNorm, Post-LN",
    ),
    "bert": (
        # eps: BertConfig().layer_norm_eps
        dict(norm="layernorm", placement="post", ffn="gelu", final_norm=False, embed_norm=True, eps=1e-12),
        "BERT 2018: LayerNorm, Post-LN, LayerNorm on the embeddings",
    ),
    "gpt2": (
        # eps: GPT2Config().layer_norm_epsilon
        dict(norm="layernorm", placement="pre", ffn="gelu", final_norm=True, residual_init_scaling=True, eps=1e-5),
        "GPT-2 2019: LayerNorm, Pre-LN, final LayerNorm",
    ),
    "gpt3": (
        # eps: as GPT-2, GPT2Config().layer_norm_epsilon (transformers has no GPT-3 class)
        dict(norm="layernorm", placement="pre", ffn="gelu", final_norm=True, residual_init_scaling=True, eps=1e-5),
        "GPT-3 2020: as GPT-2",
    ),
    "palm": (
        dict(
            norm="layernorm",
            placement="pre",
            ffn="swiglu",
            final_norm=True,
            parallel=True,
            bias=False,
            positional="rope",
            eps=1e-5,  # no transformers class; torch.nn.LayerNorm's default
        ),
        "PaLM 2022: LayerNorm, Pre-LN, parallel attention + FFN",
    ),
    # eps: LlamaConfig().rms_norm_eps, MistralConfig().rms_norm_eps, Qwen2Config().rms_norm_eps,
    # DeepseekV3Config().rms_norm_eps
    "llama": (dict(_LLAMA, final_norm=True, eps=1e-6), "LLaMA 2023: RMSNorm, Pre-LN, SwiGLU"),
    "mistral": (dict(_LLAMA, final_norm=True, eps=1e-6), "Mistral 2023: as LLaMA"),
    "qwen": (dict(_LLAMA, final_norm=True, eps=1e-6), "Qwen 2023: as LLaMA"),
    "deepseek": (dict(_LLAMA, final_norm=True, eps=1e-6), "DeepSeek 2024: as LLaMA"),
    "gemma": (
        dict(
            norm="rmsnorm",
            placement="pre",
            ffn="geglu",
            final_norm=True,
            bias=False,
            positional="rope",
            zero_centered_weight=True,
            tie_embeddings=True,
            embed_scale=True,
            eps=1e-6,  # GemmaConfig().rms_norm_eps
        ),
        "Gemma 2024: RMSNorm (1 + w), Pre-LN",
    ),
    "deepnet": (
        # eps: no transformers class; torch.nn.LayerNorm's default
        dict(norm="layernorm", placement="deepnorm", ffn="gelu", final_norm=False, init="xavier", eps=1e-5),
        "DeepNet 2022: DeepNorm, Norm(alpha x + F(x)), beta-scaled init",
    ),
}


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _is_number(value) -> bool:
    """An int or float, not a bool (bool is an int subclass: ``dropout=False`` or ``alpha=True`` is a mistake)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(kw_only=True)
class TransformerConfig:
    """Shape, Add & Norm choices and init of a Transformer; validated on construction.

        ``d_ff=None``: 4 * d_model, or for gated FFNs (swiglu/geglu) 8/3 * d_model rounded up to a multiple of 8
        (same parameter count). ``embed_scale``: multiply token embeddings by sqrt(d_model) (original Transformer,
    Gemma). ``final_norm=None``: on for placements whose stream leaves the last layer
        unnormalized (pre, sandwich, mix, pre-noskip, branch-output, parallel; not rezero, which has no norm). ``placement="mix"``: Post-LN for the first
        ``floor(mix_ln_fraction * n_layers)`` layers, Pre-LN after (Mix-LN). ``deepnorm_alpha/beta``: override the
        values :func:`deepnorm_coefficients` derives from the depth. ``layernorm_scaling``: LayerNorm Scaling (Sun et al.
        2025, The Curse of Depth): in layer l = 1..L each norm's output on a branch's input is multiplied by 1/sqrt(l)
        (placement "pre", sequential blocks; any norm kind). ``fuse_add_norm``: run each pre-norm residual
        add together with the next norm as one fused call (same numbers, fewer memory passes).
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    max_seq_len: int = 128
    norm: str = "layernorm"
    placement: str = "pre"
    ffn: str = "gelu"
    final_norm: bool | None = None
    parallel: bool = False
    qk_norm: bool = False
    zero_centered_weight: bool = False
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True
    init: str = "normal"
    init_std: float = 0.02
    residual_init_scaling: bool = False
    layernorm_scaling: bool = False
    eps: float | None = None
    positional: str = "learned"
    embed_norm: bool = False
    embed_scale: bool = False
    mix_ln_fraction: float = 0.25
    deepnorm_alpha: float | None = None
    deepnorm_beta: float | None = None
    n_decoder_layers: int | None = None
    fuse_add_norm: bool = True
    record_logits: bool = False
    norm_kwargs: dict = field(default_factory=dict)
    backend: str = "auto"

    def __post_init__(self) -> None:
        # bool fields take True/False only: a string such as "no" is truthy and would turn the option on
        for f in dataclasses.fields(self):
            if f.type in ("bool", "bool | None"):
                v = getattr(self, f.name)
                if not isinstance(v, bool) and not (v is None and f.type == "bool | None"):
                    must = "True or False" + (" or None" if f.type == "bool | None" else "")
                    raise TypeError(f"{f.name} must be {must}, got {v!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        for name in ("d_ff", "n_decoder_layers"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        _choice("norm", self.norm, NORM_KINDS)
        _choice("placement", self.placement, CONFIG_PLACEMENTS)
        _choice("ffn", self.ffn, FFN_KINDS)
        _choice("positional", self.positional, POSITIONALS)
        _choice("init", self.init, INITS)
        _choice("backend", self.backend, BACKENDS)
        if self.positional == "rope" and self.head_dim % 2:
            raise ValueError(f"positional 'rope' needs an even head dim, got d_model/n_heads = {self.head_dim}")
        if not _is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not _is_number(self.init_std) or not math.isfinite(self.init_std) or not self.init_std > 0:
            raise ValueError(f"init_std must be a finite number > 0, got {self.init_std!r}")
        if self.eps is not None and (not _is_number(self.eps) or not math.isfinite(self.eps) or not self.eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0 or None, got {self.eps!r}")
        if not _is_number(self.mix_ln_fraction) or not 0.0 <= self.mix_ln_fraction <= 1.0:
            raise ValueError(f"mix_ln_fraction must be in [0, 1], got {self.mix_ln_fraction!r}")
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            v = getattr(self, name)
            if v is not None and (not _is_number(v) or not math.isfinite(v) or v <= 0):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")
        if self.zero_centered_weight and self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"zero_centered_weight needs norm 'layernorm' or 'rmsnorm', got norm={self.norm!r}")
        if self.parallel and self.placement != "pre":
            raise ValueError(f"parallel blocks (PaLM) use placement 'pre'; got placement={self.placement!r}")
        if self.layernorm_scaling and (self.placement != "pre" or self.parallel):
            raise ValueError(
                "layernorm_scaling scales the norms on the branches' inputs of Pre-LN layers: it needs placement "
                f"'pre' and parallel=False, got placement={self.placement!r}, parallel={self.parallel!r}"
            )
        if not isinstance(self.norm_kwargs, dict):
            raise TypeError(f"norm_kwargs must be a dict, got {type(self.norm_kwargs).__name__}")

    # derived values
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """d_ff, or its default for this FFN kind."""
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn in ("swiglu", "geglu"):
            return 8 * math.ceil(8 * self.d_model / 3 / 8)
        return 4 * self.d_model

    @property
    def use_final_norm(self) -> bool:
        if self.final_norm is not None:
            return bool(self.final_norm)
        # Mix-LN ends in Pre-LN layers
        return self.parallel or self.placement == "mix" or Placement.named(self.placement).wants_final_norm

    @property
    def decoder_layers(self) -> int:
        """Decoder depth of an encoder-decoder model (n_decoder_layers, default n_layers)."""
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    def num_post_layers(self, n_layers: int | None = None) -> int:
        """How many leading layers of a Mix-LN stack of ``n_layers`` layers are Post-LN."""
        n = self.n_layers if n_layers is None else n_layers
        return math.floor(self.mix_ln_fraction * n)

    def layer_placement(self, layer_idx: int, n_layers: int | None = None) -> str:
        """The Residual placement of layer ``layer_idx`` (resolves "mix" into "post" or "pre")."""
        if self.placement != "mix":
            return self.placement
        return "post" if layer_idx < self.num_post_layers(n_layers) else "pre"

    def norm_output_scale(self, layer_idx: int) -> float:
        """What the norms on the branches' inputs of layer ``layer_idx`` (0-based) are multiplied by: 1/sqrt(layer_idx
        + 1) with ``layernorm_scaling``, else 1."""
        return 1.0 / math.sqrt(layer_idx + 1) if self.layernorm_scaling else 1.0

    def norm_factory_kwargs(self) -> dict:
        """Keywords for :func:`make_norm` that this config implies (bias, zero-centered weight, backend, extras)."""
        return dict(
            bias=self.bias, zero_centered_weight=self.zero_centered_weight, backend=self.backend, **self.norm_kwargs
        )

    def replace(self, **overrides) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """The config of model family ``name`` (see :data:`PRESETS`) at tiny size; ``overrides`` set any field."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown TransformerConfig field(s) {unknown} in overrides of preset {name!r}")
        return cls(**{**PRESETS[name][0], **overrides})
