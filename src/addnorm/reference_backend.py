"""The ``reference`` backend: the float oracle of :mod:`addnorm.reference` behind the kernel contract.

Slow but exact to the contract, its finite-range guard included (:mod:`addnorm.reference_guard`: the rows the
oracle's plain statistics cannot serve, forward and backward, get the float64 answer rounded); it lets the custom-op
registration, autograd wiring and torch.compile support be tested on any machine, independently of the Triton and
CPU kernels. It lives beside the oracle, not under ``addnorm/ops/``: the registry (:mod:`addnorm.ops.backends`)
names it by its import path and imports it only when the ``reference`` backend is asked for, so nothing on the
runtime path of the ops imports the oracle that judges them (tests/test_house.py checks it).
"""

from __future__ import annotations

import torch

from addnorm.reference import add_norm_bwd_ref, add_norm_ref
from addnorm.reference_guard import guard_backward, guard_forward


def unavailable_reason(device: torch.device) -> str | None:
    return None


def forward(
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    dropout_p,
    seed,
    residual_dtype,
    zero_centered_weight,
    store_residual_out,
    cast_before_weight=False,
    out_dtype=None,
    store_stats=True,
):
    out, res_out, mean, rstd = add_norm_ref(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        dropout_p=dropout_p,
        seed=seed,
        residual_dtype=residual_dtype,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
        out_dtype=out_dtype,
    )
    out, mean, rstd = guard_forward(
        out,
        res_out,
        mean,
        rstd,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
    )
    if not store_stats:
        mean = rstd = None
    return out.contiguous(), (res_out.contiguous() if store_residual_out else None), mean, rstd


def backward(
    dout,
    dresidual_out,
    h,
    weight,
    mean,
    rstd,
    *,
    is_rms,
    dropout_p,
    seed,
    zero_centered_weight,
    x_dtype,
    residual_dtype,
    bias_dtype,
    cast_before_weight=False,
):
    grads = add_norm_bwd_ref(
        dout,
        dresidual_out,
        h,
        weight,
        mean,
        rstd,
        bias_dtype=bias_dtype,
        dropout_p=dropout_p,
        seed=seed,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
        x_dtype=x_dtype,
        residual_dtype=residual_dtype,
    )
    return guard_backward(
        grads,
        dout,
        dresidual_out,
        h,
        weight,
        mean,
        rstd,
        dropout_p=dropout_p,
        seed=seed,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
        x_dtype=x_dtype,
        residual_dtype=residual_dtype,
    )
