"""Position-wise feed-forward networks.

relu / gelu:      fc_out(act(fc_in(x)))                       original Transformer (ReLU), BERT/GPT (GELU)
swiglu / geglu:   fc_out(act(fc_gate(x)) * fc_in(x))          act = SiLU (LLaMA family) or GELU (Gemma)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FFN_KINDS", "FeedForward"]

FFN_KINDS = ("relu", "gelu", "swiglu", "geglu")

_ACT = {"relu": F.relu, "gelu": F.gelu, "swiglu": F.silu, "geglu": F.gelu}


class FeedForward(nn.Module):
    """Two-layer (or gated three-matrix) MLP, d_model -> d_ff -> d_model. Activation one of :data:`FFN_KINDS`."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", bias: bool = True):
        super().__init__()
        if activation not in FFN_KINDS:
            raise ValueError(f"activation must be one of {', '.join(FFN_KINDS)}; got {activation!r}")
        self.activation = activation
        self.gated = activation in ("swiglu", "geglu")
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.fc_gate = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)

    def deepnorm_scaled_weights(self) -> list[Tensor]:
        return [m.weight for m in (self.fc_in, self.fc_gate, self.fc_out) if m is not None]

    def residual_output_weights(self) -> list[Tensor]:
        return [self.fc_out.weight]

    def forward(self, x: Tensor) -> Tensor:
        act = _ACT[self.activation]
        if self.gated:
            return self.fc_out(act(self.fc_gate(x)) * self.fc_in(x))
        return self.fc_out(act(self.fc_in(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
