"""``addnorm survey``: where every architecture of the installed transformers puts its norms, measured.

For each ``model_type`` with a base model class, :func:`survey_one` builds a tiny random model from its config
class (:mod:`~addnorm.integrations.tiny`, nothing downloaded), runs one forward under the dataflow recorder
(:mod:`.trace`), and reports one row:

    norm                  layernorm | rmsnorm | a class name (what the stream's norms compute, per norm_probe)
    placement             pre | post | sandwich | branch-output | parallel | mixed | unknown (the last stack to run:
                          the decoder of an encoder-decoder, the language model of a vision-language model)
    eps, zero_centered_weight, bias, final_norm, qk_norm, residual_scale, role (encoder/decoder/encoder-decoder)
    hf_apply              fused | norms | unsupported (what addnorm.integrations.hf.apply does; its output is
                          compared with the unpatched model's, and a difference is reported, not hidden;
                          hf_apply_reason: why, for norms, unsupported and mismatch)
    hf_ops                the fused ops the patched layers called in that forward: add_norm (norm(a + b)),
                          norm_add (a + norm(y)), norm_add_norm (the sandwich chain, next_norm(a + norm(y)))
    doctor                the findings of addnorm's doctor on the same model
    status                ok | skipped (with the reason)

Rows are plain dicts (JSON-ready); :mod:`.report` writes survey.md, survey.json and index.html.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from addnorm._limits import time_limit
from addnorm.integrations.survey import trace
from addnorm.integrations.tiny import SkipModel, SurveyTimeout, build, model_types, tiny_config

__all__ = ["survey", "survey_one", "model_types", "tiny_config", "build", "SkipModel"]

TIME_LIMIT_S = 20.0  # CPU seconds per architecture: a few default configs stay large after shrinking (audio codecs)


def _time_limit(seconds: float | None):
    """Raise SurveyTimeout after ``seconds`` of this process's CPU time (not wall time: on a loaded machine the same model
    takes several times longer by the clock, and which ones are skipped should not depend on the neighbours)."""

    def expire():
        raise SurveyTimeout(f"over the survey's limit of {seconds:g} CPU seconds per architecture")

    return time_limit(seconds, expire, cpu_time=True)


def _main_stack(events, n_stacks: int) -> int | None:
    last = {}
    for i, e in enumerate(events):
        if e.kind == "block-end":
            last[e.ref[0]] = i
    return max(last, key=last.get) if last else None


def _final_norm(events, stack: int, width: int | None) -> bool:
    """A norm of the stream's width runs after the stack's last layer, outside every layer."""
    ends = [i for i, e in enumerate(events) if e.kind == "block-end" and e.ref[0] == stack]
    if not ends:
        return False
    depth = 0
    for e in events[ends[-1] + 1 :]:
        depth += (e.kind == "block-start") - (e.kind == "block-end")
        if e.kind == "norm" and depth == 0 and e.inputs[0] is not None and e.inputs[0].shape[-1] == width:
            return True
    return False


def _fmt_scale(value) -> str:
    return "vector" if value == "vector" else f"{value:.4g}"


def analyse(model, batch) -> dict[str, Any]:
    """The norm and placement fields of a survey row for ``model(**batch)`` (see the module docstring)."""
    stacks = trace.find_stacks(model)
    norms = trace.find_norms(model)
    events = trace.record(model, batch, stacks, norms)
    layers = trace.analyse(events)
    main = _main_stack(events, len(stacks))
    row: dict[str, Any] = {"stacks": []}
    for si, (path, mods) in enumerate(stacks):
        ls = [lt for lt in layers if lt.stack == si]
        if ls:
            labels = {lt.label for lt in ls}
            row["stacks"].append(
                {
                    "path": path,
                    "layers": len(mods),
                    "layer_class": type(mods[0]).__name__,
                    "placement": labels.pop() if len(labels) == 1 else "mixed",
                    "sublayers": [s.label for s in ls[0].sublayers],
                }
            )
    ls = [lt for lt in layers if lt.stack == main]
    if not ls:
        row.update(
            placement="unknown",
            norm=None,
            eps=None,
            zero_centered_weight=None,
            bias=None,
            final_norm=None,
            qk_norm=None,
            residual_scale=None,
        )
        return row
    labels = [lt.label for lt in ls]
    row["placement"] = labels[0] if len(set(labels)) == 1 else "mixed"
    row["stack"] = stacks[main][0]
    row["layers"] = len(stacks[main][1])
    row["sublayers"] = [s.label for s in ls[0].sublayers]
    stream_norms = {n for lt in ls for s in lt.sublayers for n in s.stream_norms + s.branch_norms}
    # post-norm: the norms that read the stream after an add are not in stream_norms; take every norm in the layers
    # of the main stack that saw the stream's width and is not a qk norm
    qk = {n for lt in ls for n in lt.qk_norms}
    prefix = stacks[main][0] + "."
    in_stack = {
        p
        for p, i in norms.info.items()
        if p.startswith(prefix) and p not in qk and (i is None or i.width in (None, ls[0].width))
    }
    used = {e.ref for e in events if e.kind == "norm"}
    chosen = sorted((stream_norms | in_stack) & used)
    infos = [norms.info[p] for p in chosen]
    kinds = sorted({i.kind if i else type(norms.modules[p]).__name__ for p, i in zip(chosen, infos)})
    row["norm"] = "+".join(kinds) if kinds else None
    probed = [i for i in infos if i is not None]
    eps = sorted({i.eps for i in probed if i.eps is not None})
    row["eps"] = eps[0] if len(eps) == 1 else (eps or None)
    row["zero_centered_weight"] = any(i.zero_centered_weight for i in probed) if probed else None
    row["bias"] = any(i.bias for i in probed) if probed else None
    row["final_norm"] = _final_norm(events, main, ls[0].width)
    row["qk_norm"] = bool(qk)
    scales = sorted(
        {f"skip*{_fmt_scale(s.skip_scale)}" for lt in ls for s in lt.sublayers if s.skip_scale is not None}
        | {f"branch*{_fmt_scale(s.branch_scale)}" for lt in ls for s in lt.sublayers if s.branch_scale is not None}
    )
    row["residual_scale"] = ", ".join(scales) or None
    row["norm_classes"] = sorted({type(norms.modules[p]).__name__ for p in chosen})
    return row


def _outputs(model, batch) -> torch.Tensor | None:
    from addnorm.diagnostics.blocks import first_tensor

    torch.manual_seed(0)  # models that draw random numbers in forward (ViT-MAE's masking, VITS) draw the same ones
    with torch.no_grad():
        out = model(**batch)
    h = getattr(out, "last_hidden_state", None)
    return h if isinstance(h, torch.Tensor) else first_tensor(out)


def _hf_apply(model, batch) -> dict[str, Any]:
    """What hf.apply does to the model, and whether the output is unchanged (fp32, within 1e-5 of its scale, or as
    accurate as the unpatched model against a float64 run: :func:`_as_accurate_as_eager`).

    Only fused layers that made a fused call in the survey's forward count as checked: a vision tower of a
    vision-language model does not run on text alone, and a rewritten forward may fuse only a branch the config does
    not take (GPT-NeoX's non-parallel one), so those layers are listed apart (``hf_fused_not_run``) and do not make
    the row "fused"."""
    from addnorm.integrations import hf
    from addnorm.integrations.hf import handoff, rewrite, unfused

    ref = _outputs(model, batch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.apply(model)
    except ValueError as e:
        return {"hf_apply": "unsupported", "hf_apply_reason": str(e)}
    ran, handles = rewrite.record_fused_layers(model)  # layers that made a fused call, not only ran
    try:
        before = handoff.fused_ops()
        got = _outputs(model, batch)
        ops = [op for op, n in handoff.fused_ops().items() if n > before[op]]  # which fused ops the layers called
        err = (got.double() - ref.double()).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        fused = hf.fused_layer_classes(model)
        out = {"hf_apply": "fused" if ran else "norms", "hf_apply_rel_err": err, "hf_fused_layers": sorted(ran)}
        out["hf_ops"] = ops
        if set(fused) - ran:
            out["hf_fused_not_run"] = sorted(set(fused) - ran)
        if not ran:
            out["hf_apply_reason"] = unfused.unfused_reason(model)
    finally:
        for h in handles:
            h.remove()
        hf.revert(model)
    if not err <= 1e-5 and not _as_accurate_as_eager(model, batch, ref, got, out):
        out["hf_apply_reason"] = f"output differs from the unpatched model (relative error {err:.3g})"
        out["hf_apply"] = "mismatch"
    return out


# The float64 run is a fair judge only when it takes the same path as the fp32 one (same random draws, same
# discrete choices): then the fp32 model's own distance from it is its rounding error, well under this.
_FP64_COMPARABLE = 1e-3


def _as_accurate_as_eager(model, batch, ref, got, out) -> bool:
    """Whether a patched output further than 1e-5 of its scale from the unpatched one is still as accurate. A model
    that amplifies rounding (VITS: flows and a HiFi-GAN vocoder after its text encoder's norms) turns an ulp of
    difference in a norm into ~1e-4 of its waveform's scale; what matters is that the patched model is no further
    from the float64 computation of the same (unpatched, reverted) model than the fp32 unpatched model is, within a
    factor 2. Both distances are recorded in the row. False when the float64 run cannot be made or is not
    comparable (then the row stays a mismatch)."""
    try:
        model64 = copy.deepcopy(model).double()
        batch64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
        truth = _outputs(model64, batch64)
    except Exception:  # noqa: BLE001 - a model without float64 support: no judge, the mismatch stands
        return False
    if truth is None or truth.shape != ref.shape:
        return False
    scale = max(truth.abs().max().item(), 1e-30)
    eager = (ref.double() - truth).abs().max().item() / scale
    patched = (got.double() - truth).abs().max().item() / scale
    out["eager_fp64_err"], out["hf_apply_fp64_err"] = eager, patched
    return eager <= _FP64_COMPARABLE and patched <= 2 * eager


def _doctor(model, batch) -> list[dict]:
    from addnorm.diagnostics.doctor.diagnosis import diagnose

    findings = diagnose(model, batch)
    return [{"code": f.code, "severity": f.severity, "module": f.module} for f in findings if f.code != "summary"]


def survey_one(model_type: str, *, doctor: bool = True, time_limit: float | None = TIME_LIMIT_S) -> dict[str, Any]:
    """One row of the survey for ``model_type`` (see the module docstring); never raises for a model's failure."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"model_type": model_type}
    stage = "build"
    try:
        with _time_limit(time_limit), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = build(model_type)
            row["model_class"] = type(built.model).__name__
            row["role"] = built.role
            stage = "forward"
            row.update(analyse(built.model, built.batch))
            stage = "hf.apply"
            row.update(_hf_apply(built.model, built.batch))
            if doctor:
                stage = "doctor"
                try:
                    row["doctor"] = _doctor(built.model, built.batch)
                except Exception as e:  # noqa: BLE001 - a doctor crash is a finding about the doctor, listed
                    row["doctor_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["status"] = "ok"
    except SkipModel as e:
        row.update(status="skipped", reason=str(e))
    except SurveyTimeout as e:
        row.update(status="skipped", reason=f"{stage}: {e}")
    except Exception as e:  # noqa: BLE001 - the architecture's own code failed on the tiny config
        if stage == "build" or stage == "forward" and "placement" not in row:
            row.update(
                status="skipped",
                reason=f"{stage} failed on the tiny config: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
            )
        else:
            row.update(status="ok", **{f"{stage}_error": f"{type(e).__name__}: {str(e)[:200]}"})
            if stage == "hf.apply":
                row["hf_apply"] = "error"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def survey(
    only: list[str] | None = None,
    *,
    doctor: bool = True,
    progress: Callable[[str], None] | None = None,
    time_limit: float | None = TIME_LIMIT_S,
) -> dict[str, Any]:
    """The survey of the installed transformers: ``{"transformers": VERSION, "torch": ..., "models": [row, ...]}``.

    ``only`` restricts it to these model types (each must be one of :func:`model_types`); ``progress`` is called
    with each model type before it is surveyed."""
    import transformers

    types = model_types()
    if only:
        unknown = [t for t in only if t not in types]
        if unknown:
            raise ValueError(f"only: unknown model type(s) {', '.join(unknown)}; see addnorm survey --list")
        types = [t for t in types if t in set(only)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only wait for each other
    transformers.logging.set_verbosity_error()
    rows = []
    t0 = time.perf_counter()
    try:
        for mt in types:
            if progress:
                progress(mt)
            rows.append(survey_one(mt, doctor=doctor, time_limit=time_limit))
    finally:
        torch.set_num_threads(threads)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "models": rows,
    }
