"""``addnorm doctor``: find Add & Norm mistakes in a model, statically and with one forward/backward.

The "three checks" of a broken Transformer (is the skip path an identity, is the norm over the right axis, does
the layout suit the depth and schedule) plus a few numerics checks, on any ``nn.Module``:

==========================  ========  =====================================================================
code                        severity  what is checked
==========================  ========  =====================================================================
``norm-dimension``          error     a norm whose normalized_shape does not match its input; a norm that
                                      normalizes over the sequence or batch axis (its input's last dim is the
                                      sequence length, or changing one position's features changes the output
                                      at other positions); BatchNorm/InstanceNorm on a sequence's stream
``channel-norm``            info      the norm of a convolutional module, checked as such: a channels-first
                                      norm on (B, C, ...) that normalizes each position over C, or a
                                      BatchNorm fed straight by a convolution/linear (conv-BN unit)
``residual-not-identity``   error     with every weight of a block's sublayers set to zero (norm gains reset
                                      to 1, biases to 0), the block must map x to x (Pre-Norm) or to Norm(x)
                                      (Post-Norm); anything else means the skip path is scaled or projected
``skip-path-design``        info      a recognised deliberate design instead (hyper-connections, learnable
                                      skip gates, branch lists, plain conv stacks, block-level residuals,
                                      weightless token mixing): :mod:`~addnorm.diagnostics.doctor.designs`
``missing-final-norm``      error     a Pre-Norm stack with no norm between the last block and the output
                                      (info on a vision encoder: its projector reads the stream)
``post-norm-deep``          warning   Post-Norm with 12 or more blocks (Xiong et al. 2020: needs warmup;
                                      Wang et al. 2022: DeepNorm) and no DeepNorm scaling found
``low-precision-stats``     warning   a norm whose mean/variance reduction runs in fp16/bf16 when fed half
                                      precision (error when it already does so on its input in this model)
``residual-growth``         warning   at init, RMS(stream after the last block) / RMS(after the first)
                                      above 2 * sqrt((1 + 3L/2) / (3/2)): twice the ratio of the Pre-LN
                                      bounds of Xiong et al.'s Lemma 2 (upper at layer L, lower at layer 1);
                                      healthy Pre-Norm grows like sqrt(l), a bad init geometrically
``forward-failed`` etc.     error     the example forward or backward raised, or produced NaN/Inf
==========================  ========  =====================================================================

This module runs the checks and adds the stack-level ones (``post-norm-deep``, ``missing-final-norm``,
``residual-growth``, the summary). Beside it in :mod:`addnorm.diagnostics.doctor`: the example run
(``example_run.py``), the per-norm checks (``norm_checks.py``), the per-block skip-path checks (``block_checks.py``)
and the designs they recognise (``designs.py``), the findings and thresholds (``findings.py``), and the command
``addnorm doctor``, which loads a user's file or a Hugging Face config (``cli.py``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from addnorm.diagnostics.blocks import find_blocks
from addnorm.diagnostics.doctor.block_checks import block_direction, classify_blocks, uses_deepnorm
from addnorm.diagnostics.doctor.designs import explain
from addnorm.diagnostics.doctor.example_run import batch_shape, image_input, run_example
from addnorm.diagnostics.doctor.findings import SEVERITIES, DoctorConfig, Finding, sort_findings
from addnorm.diagnostics.doctor.norm_checks import check_norms

__all__ = ["Finding", "DoctorConfig", "diagnose", "SEVERITIES", "why_not_checkable"]


def why_not_checkable(model: nn.Module) -> str | None:
    """Why the doctor cannot check ``model`` at all (None when it can): the checks hook and call submodules one by
    one, which a compiled ScriptModule does not allow."""
    if isinstance(model, torch.jit.ScriptModule):
        return (
            f"the model is a {type(model).__name__} (torch.jit.script or torch.jit.trace output): the doctor needs "
            "the eager nn.Module, whose submodules it hooks and calls one by one; pass the model before scripting "
            "or tracing it"
        )
    return None


def _meta_tensors(model: nn.Module, example_batch: Any) -> bool:
    """Whether the model's weights or the example batch live on the meta device: shapes without values."""
    tensors = [*model.parameters(), *model.buffers()]
    stack = [example_batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return any(t.device.type == "meta" for t in tensors)


def _meta_finding() -> Finding:
    return Finding(
        code="values-not-checked",
        severity="warning",
        module="<root>",
        message="the model's weights or the example batch are on the meta device (shapes without values): every "
        "check runs the model and reads values (a skip path's output, a norm's statistics), so none was run",
        fix="materialize the model first (model.to_empty(device='cpu') and initialize it, or load its weights) and "
        "give an example batch with values on the same device",
    )


def diagnose(
    model: nn.Module, example_batch: Any, *, blocks: Any = None, config: DoctorConfig | None = None
) -> list[Finding]:
    """Run every check on ``model`` with ``example_batch`` (tensor, tuple or dict of inputs); returns the findings,
    errors first. The model is deep-copied first, so its state (grads, BatchNorm statistics) is left untouched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    reason = why_not_checkable(model)
    if reason is not None:
        raise TypeError(reason)
    if _meta_tensors(model, example_batch):
        return [_meta_finding()]
    cfg = config or DoctorConfig()
    try:
        model = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - some models hold un-copyable handles; then work on the original
        pass
    model.eval()
    findings: list[Finding] = []
    try:
        found = find_blocks(model, blocks)
    except ValueError as e:
        found = []
        findings.append(
            Finding(
                code="no-blocks",
                severity="info",
                module="<root>",
                message=str(e),
                fix="pass blocks= to diagnose() to enable the per-block checks",
            )
        )
    tr = run_example(model, example_batch, found, findings)
    if tr.failed:  # only what the hooks saw before the failure can be reported
        for path, msg in tr.shape_errors.items():
            findings.append(
                Finding(
                    code="norm-dimension",
                    severity="error",
                    module=path,
                    message=msg,
                    fix="give the norm normalized_shape=(d_model,), the feature dim of its input",
                )
            )
        return sort_findings(findings)
    outs = [tr.block_out[i] for i in sorted(tr.block_out)]
    d_model = max({d for _, d in outs}, key=[d for _, d in outs].count) if outs else None
    check_norms(model, tr, batch_shape(example_batch), d_model, findings, cfg, image=image_input(example_batch))
    if not found or not tr.block_calls:
        return sort_findings(findings)

    container = found[0][0].rpartition(".")[0] or "<root>"
    kinds = classify_blocks(found, tr, findings, cfg, explain=explain)
    n_post, n_pre = kinds.count("post"), kinds.count("pre")
    L = len(found)

    if n_post >= cfg.post_norm_depth and not uses_deepnorm(found):
        findings.append(
            Finding(
                code="post-norm-deep",
                severity="warning",
                module=container,
                message=f"{n_post} Post-Norm blocks: at this depth Post-Norm's gradients at init grow with the layer "
                "index, and Adam without warmup often diverges or stalls (Xiong et al. 2020)",
                fix="use a learning-rate warmup, switch to Pre-Norm (with a final norm), or use DeepNorm "
                "(x = LN(alpha x + f(x)), alpha = (2N)^(1/4), branch init scaled by beta = (8N)^(-1/4))",
            )
        )

    if n_pre > L // 2:
        last_end = tr.block_end.get(len(found) - 1)
        block_ids = {id(m) for _, b in found for m in b.modules()}
        modules = dict(model.named_modules())
        # a norm module may run before the blocks and again after them (NanoChat's self.norm): its last call counts
        after = [
            p
            for p, order in tr.norm_last.items()
            if last_end is not None
            and order > last_end
            and id(modules.get("" if p == "<root>" else p)) not in block_ids
        ]
        if last_end is not None and not after and image_input(example_batch):
            findings.append(
                Finding(
                    code="missing-final-norm",
                    severity="info",
                    module=container,
                    message="Pre-Norm blocks and no norm after the last one, in a vision encoder (its input is an "
                    "image): such encoders hand their raw stream to a projector or adapter that normalizes it, as "
                    "Pixtral, InternVL, RADIO, SAM3 and ViTDet do, so this is not an error here",
                    fix="none needed when a projector or neck reads this output; if a head reads it directly, apply "
                    "a final LayerNorm/RMSNorm first",
                )
            )
        elif last_end is not None and not after:
            findings.append(
                Finding(
                    code="missing-final-norm",
                    severity="error",
                    module=container,
                    message="Pre-Norm blocks but no norm runs after the last block: the head reads the raw residual "
                    "stream, whose scale grows with depth",
                    fix="apply a final LayerNorm/RMSNorm to the output of the last block, before the head",
                )
            )

    if n_post <= L // 2 and L >= 2 and 0 in tr.block_out and (L - 1) in tr.block_out:
        first, last = tr.block_out[0][0], tr.block_out[L - 1][0]
        limit = cfg.growth_factor * math.sqrt((1 + 1.5 * L) / 1.5)
        if first > 0 and last / first > limit:
            per_layer = ", ".join(f"{tr.block_out[i][0]:.3g}" for i in sorted(tr.block_out))
            findings.append(
                Finding(
                    code="residual-growth",
                    severity="warning",
                    module=container,
                    message=f"at init the residual stream's RMS grows {last / first:.3g}x from the first block's "
                    f"output to the last one's ({first:.3g} -> {last:.3g}; limit {limit:.3g} = "
                    f"{cfg.growth_factor:g} * sqrt((1 + 3L/2) / (3/2)), L={L}); per block: {per_layer}",
                    fix="normalize each branch's input (Pre-Norm) and scale the init of each branch's output "
                    "projection down with depth (std 0.02/sqrt(2L) as GPT-2, or a 1/sqrt(2L) branch scale)",
                )
            )

    label = {
        "pre": "Pre-Norm",
        "post": "Post-Norm",
        "none": "no norm",
        "bad": "non-identity skip",
        "design": "recognised design",
        None: "not checked",
    }
    counts = {k: kinds.count(k) for k in label if kinds.count(k)}
    if len(counts) == 1:
        placement = label[next(iter(counts))]
    else:
        placement = "mixed (" + ", ".join(f"{n} {label[k]}" for k, n in counts.items()) + ")"
    direction = block_direction(found, tr)
    name = type(found[0][1]).__name__
    # a class name that contradicts what the block does (addnorm's EncoderLayer with causal=True is a decoder-only
    # block) is left out rather than repeated
    misleading = ("encoder" in name.lower() and direction == "causal") or (
        "decoder" in name.lower() and direction == "bidirectional"
    )
    what = f"{L} blocks" if misleading else f"{L} blocks of {name}"
    attention = {"causal": ", causal (decoder-only)", "bidirectional": ", bidirectional (encoder)"}.get(direction, "")
    findings.append(
        Finding(
            code="summary",
            severity="info",
            module=container,
            message=f"{what} at '{container}'{attention}, placement {placement}, d_model {d_model}",
            fix="none needed",
        )
    )
    return sort_findings(findings)
