"""What the hand-built layer stacks of the hf tests share: their width and how their norms get non-trivial gains."""

from __future__ import annotations

import torch
from torch import nn

W = 16


def randomize(norm: nn.Module) -> None:
    with torch.no_grad():  # gains away from 1, biases away from 0: a norm applied in the wrong place shows
        norm.weight.copy_(1 + 0.3 * torch.randn(W))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.2 * torch.randn(W))
