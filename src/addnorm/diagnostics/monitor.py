"""Per-layer training telemetry for any PyTorch model, through removable hooks.

What is recorded, per step (``Monitor.step`` after ``loss.backward()``):

- global: ``step``, ``loss``, ``grad_norm`` (L2 norm of every parameter gradient, as ``clip_grad_norm_`` computes
  it), ``output_logz`` (mean over positions of log sum_v exp(logits_v): the quantity z-loss keeps near 0,
  Wortsman et al. 2023), and, every ``probe_every`` steps when a probe batch is given, ``update_size`` =
  ||F(x, theta_t) - F(x, theta_0)|| on that fixed batch (the model-update measure of DeepNet, Wang et al. 2022);
- per block (``record["layers"]``, in order): ``grad_norm`` of the block's parameters, ``residual_rms`` =
  sqrt(mean(h^2)) of the block's output stream in the last forward, ``norm_input_rms`` (largest RMS of an input of
  a norm module inside the block: LayerNorm's Jacobian shrinks like sqrt(d)/||x||, Xiong et al. 2020), and
  ``max_attn_logit`` when the block's attention module exposes it.

Per-step cost is kept to a few tensor ops per block and a single device-to-host copy (one ``.tolist()``), so
recording every step stays cheap (see ``benchmarks/monitor_overhead.py``). Under sharded training (FSDP, tensor
parallel) the values are those of the local shards on each rank; they are not reduced across ranks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from addnorm.diagnostics.blocks import call_model, find_blocks, first_tensor, is_norm_module, output_logits

__all__ = ["Monitor", "layer_series"]

# Attribute names an attention module may use to expose the largest pre-softmax logit of its last forward.
MAX_ATTN_LOGIT_ATTRS = ("max_attn_logit", "last_max_logit", "max_logit")


def _l2(t: Tensor) -> Tensor:
    """L2 norm as a 0-d fp32 tensor, accumulated in fp32 whatever t's dtype (one kernel, no copy of t)."""
    return torch.linalg.vector_norm(t) if t.dtype == torch.float32 else torch.linalg.vector_norm(t, dtype=torch.float32)


def _batched_norms(tensors: list[Tensor], all_fp32: bool = False) -> list[Tensor]:
    """L2 norm of each tensor (fp32), one fused call where torch offers it (the path clip_grad_norm_ takes)."""
    if not tensors:
        return []
    foreach = getattr(torch, "_foreach_norm", None)
    if foreach is not None:
        try:
            if all_fp32:
                return list(foreach(tensors))
            return list(foreach(tensors, 2, dtype=torch.float32))  # bf16 grads: fp32 accumulation and result
        except (RuntimeError, TypeError):  # sparse grads, mixed devices, older torch: one norm per tensor
            pass
    return [_l2(t.coalesce().values() if t.is_sparse else t) for t in tensors]


def _stack_scalars(tensors: list[Tensor], device: torch.device, cat: bool = False) -> Tensor:
    """Stack (or cat) small fp32 tensors; moves them to ``device`` only when they are not all there already."""
    join = torch.cat if cat else torch.stack
    try:
        return join(tensors)
    except RuntimeError:  # different devices or dtypes (model split over devices): gather them first
        return join([t.to(device=device, dtype=torch.float32) for t in tensors])


class Monitor:
    """Record per-layer gradient norms, residual-stream RMS and friends at every ``step()``; hooks are removable.

    Usage::

        mon = Monitor(model, jsonl="run.jsonl")
        for batch in data:
            loss = model(batch).loss; loss.backward()
            rec = mon.step(loss=loss)        # after backward, before optimizer.zero_grad()
            opt.step(); opt.zero_grad()
        mon.detach()                         # or: with Monitor(model) as mon: ...

    Args:
        model: any ``nn.Module``.
        blocks: which modules are "the layers" (see :func:`find_blocks`); found automatically by default.
        probe: a fixed batch (tensor, tuple or dict of inputs) for ``update_size``; F(probe, theta_0) is taken at
            attach time, in eval mode and without gradients.
        jsonl: path of a JSON-lines file, one record per recorded step, flushed each time (truncated at attach).
        tensorboard: a log directory for ``torch.utils.tensorboard.SummaryWriter`` (``pip install
            'addnorm[tensorboard]'``): scalars ``addnorm/<key>`` and ``addnorm/<key>/<layer index>`` per record.
        record_every: record every N-th step; other steps cost nothing beyond the hook calls and return None.
        probe_every: compute ``update_size`` every N-th recorded step (a full extra forward).
        logz_rows: ``output_logz`` averages log Z over at most this many positions, evenly strided (a full
            log-sum-exp over (B*T, V) logits costs about as much as the loss itself on CPU); None: all positions.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        blocks: Any = None,
        probe: Any = None,
        jsonl: str | os.PathLike | None = None,
        tensorboard: str | os.PathLike | None = None,
        record_every: int = 1,
        probe_every: int = 10,
        logz_rows: int | None = 256,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(record_every, int) or record_every < 1:
            raise ValueError(f"record_every must be a positive int, got {record_every!r}")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be a positive int, got {probe_every!r}")
        self.model = model
        self.record_every = record_every
        self.probe_every = probe_every
        if logz_rows is not None and (not isinstance(logz_rows, int) or logz_rows < 1):
            raise ValueError(f"logz_rows must be a positive int or None, got {logz_rows!r}")
        self.logz_rows = logz_rows
        self.history: list[dict] = []
        self.blocks = find_blocks(model, blocks)
        self._steps = 0  # step() calls so far; the forward of step k happens while _steps == k
        self._paused = False  # set while the monitor runs its own probe forward
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._jsonl = None
        self._tb = None
        n = len(self.blocks)
        # Per forward, per block: L2 norms (0-d tensors, still on the device) with the element count they cover;
        # RMS = norm / sqrt(count) is taken on the host after the one transfer in step().
        self._residual: list[tuple[Tensor, int] | None] = [None] * n
        self._norm_in: list[list[tuple[Tensor, int]]] = [[] for _ in range(n)]
        self._logz: Tensor | None = None
        self._seg_cache: dict[tuple, Tensor] = {}

        # Parameters: each assigned to the first block holding it (segment i), the rest to segment n.
        seg_of: dict[int, int] = {}
        for i, (_, block) in enumerate(self.blocks):
            for p in block.parameters():
                seg_of.setdefault(id(p), i)
        self._params: list[nn.Parameter] = []
        self._segment: list[int] = []
        for p in model.parameters():  # .parameters() already skips shared duplicates
            self._params.append(p)
            self._segment.append(seg_of.get(id(p), n))
        self._all_fp32 = all(p.dtype == torch.float32 for p in self._params)

        self._attn_modules: list[list[nn.Module]] = []
        for i, (_, block) in enumerate(self.blocks):
            self._handles.append(block.register_forward_hook(self._make_block_hook(i)))
            for m in block.modules():
                if m is not block and is_norm_module(m):
                    self._handles.append(m.register_forward_hook(self._make_norm_hook(i)))
            attn = [m for m in block.modules() if any(hasattr(m, a) for a in MAX_ATTN_LOGIT_ATTRS)]
            if not attn:  # the attribute may appear only after a forward: remember attention-looking modules
                attn = [
                    m
                    for m in block.modules()
                    if "attn" in type(m).__name__.lower() or "attention" in type(m).__name__.lower()
                ]
            self._attn_modules.append(attn)
        self._handles.append(model.register_forward_pre_hook(self._model_pre_hook))
        self._handles.append(model.register_forward_hook(self._model_hook))

        self._probe = probe
        self._probe_ref: Tensor | None = None
        try:  # the hooks are attached: any failure from here on must take them off again
            if probe is not None:
                self._probe_ref = self._probe_output()
                if self._probe_ref is None:
                    raise ValueError("probe: the model's output on the probe batch has no floating-point tensor")
            if jsonl is not None:
                self._jsonl = open(jsonl, "w", encoding="utf-8")  # noqa: SIM115 - closed in detach()
            if tensorboard is not None:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as e:
                    raise ImportError(
                        "Monitor(tensorboard=...) needs the tensorboard package: pip install 'addnorm[tensorboard]'"
                    ) from e
                self._tb = SummaryWriter(log_dir=str(tensorboard))
        except BaseException:
            self.detach()
            raise

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _armed(self) -> bool:
        return not self._paused and self._steps % self.record_every == 0

    def _make_block_hook(self, i: int) -> Callable:
        def hook(module, args, output):
            if not self._armed():
                return
            h = first_tensor(output)
            if h is not None and h.is_floating_point() and h.numel() > 0:
                self._residual[i] = (_l2(h.detach()), h.numel())

        return hook

    def _make_norm_hook(self, i: int) -> Callable:
        def hook(module, args, output):
            if not self._armed() or not args or not isinstance(args[0], Tensor) or not args[0].is_floating_point():
                return
            x = args[0]
            if len(args) > 1 and isinstance(args[1], Tensor):
                # The fused form norm(x, residual) normalizes x + residual and returns it as its second output;
                # reading it there saves recomputing the sum.
                if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], Tensor):
                    x = output[1]
                elif args[1].shape == x.shape:
                    x = x + args[1]
            if x.numel() > 0:
                self._norm_in[i].append((_l2(x.detach()), x.numel()))

        return hook

    def _model_pre_hook(self, module, args):
        # Values describe the last forward (gradient accumulation runs several per step): start afresh.
        if self._armed():
            n = len(self.blocks)
            self._residual = [None] * n
            self._norm_in = [[] for _ in range(n)]
            self._logz = None

    def _model_hook(self, module, args, output):
        if not self._armed():
            return
        logits = output_logits(output)
        if logits is not None and logits.numel() > 0:
            rows = logits.detach().reshape(-1, logits.shape[-1])
            if self.logz_rows is not None and rows.shape[0] > self.logz_rows:
                rows = rows[:: -(-rows.shape[0] // self.logz_rows)]  # evenly strided subset of positions
            self._logz = torch.logsumexp(rows.float(), dim=-1).mean()

    # ---- probe ---------------------------------------------------------------------------------------------------
    def _probe_output(self) -> Tensor | None:
        was_training = self.model.training
        self._paused = True
        try:
            self.model.eval()
            with torch.no_grad():
                out = call_model(self.model, self._probe)
        finally:
            self.model.train(was_training)
            self._paused = False
        t = output_logits(out)
        if t is None:
            t = first_tensor(out)
        return None if t is None or not t.is_floating_point() else t.detach().float().clone()

    # ---- the per-step record ---------------------------------------------------------------------------------------
    def step(self, loss: Tensor | float | None = None, **extra: Any) -> dict | None:
        """Close the current step: build its record (after backward), append it to ``history``, write it out.

        Returns the record, or None on steps skipped by ``record_every``. Extra keyword values (lr=...) are copied
        into the record as they are.
        """
        step = self._steps
        self._steps += 1
        if step % self.record_every:
            return None
        n = len(self.blocks)
        device = self._params[0].device if self._params else torch.device("cpu")

        # Gradient norms: one fused norm per tensor, then squared sums per segment (blocks, then "other").
        # (A plain loop: this runs every step, and per-parameter Python work is most of the Monitor's cost.)
        grads, seg = [], []
        for p, s in zip(self._params, self._segment):
            g = p.grad
            if g is not None:
                grads.append(g)
                seg.append(s)
        with torch.no_grad():
            sq = torch.zeros(n + 1, dtype=torch.float32, device=device)
            if grads:
                key = tuple(seg)
                index = self._seg_cache.get(key)
                if index is None:
                    index = self._seg_cache[key] = torch.tensor(seg, device=device)
                norms = _stack_scalars(_batched_norms(grads, self._all_fp32), device)
                sq.index_add_(0, index, norms * norms)

        # Everything goes to the host in one transfer (one sync); unpacked below in the same order.
        scalars: list[Tensor] = [sq]
        loss_t = loss.detach().float().reshape(1) if isinstance(loss, Tensor) else None
        if loss_t is not None:
            scalars.append(loss_t)
        if self._logz is not None:
            scalars.append(self._logz.reshape(1))
        counts: list[int] = []  # element counts for the residual and norm-input norms, in order
        for r in self._residual:
            if r is not None:
                scalars.append(r[0].reshape(1))
                counts.append(r[1])
        for entries in self._norm_in:
            for t, c in entries:
                scalars.append(t.reshape(1))
                counts.append(c)
        attn = [self._attn_logit(i) for i in range(n)]
        scalars += [a.reshape(1) for a in attn if a is not None]
        values = _stack_scalars(scalars, device, cat=True).tolist()

        pos = n + 1
        sq_v = values[:pos]
        total = math.sqrt(sum(sq_v))
        loss_v = None
        if loss_t is not None:
            loss_v, pos = values[pos], pos + 1
        elif loss is not None:
            loss_v = float(loss)
        logz_v = None
        if self._logz is not None:
            logz_v, pos = values[pos], pos + 1
        k = 0
        res_v: list[float | None] = []
        for r in self._residual:
            if r is None:
                res_v.append(None)
            else:
                res_v.append(values[pos] / math.sqrt(counts[k]))
                pos, k = pos + 1, k + 1
        norm_v: list[float | None] = []
        for entries in self._norm_in:
            rms = [values[pos + j] / math.sqrt(counts[k + j]) for j in range(len(entries))]
            pos, k = pos + len(entries), k + len(entries)
            norm_v.append(max(rms) if rms else None)

        layers = []
        for i, (name, _) in enumerate(self.blocks):
            entry = {"index": i, "name": name, "grad_norm": math.sqrt(sq_v[i]), "residual_rms": res_v[i]}
            if norm_v[i] is not None:
                entry["norm_input_rms"] = norm_v[i]
            if attn[i] is not None:
                entry["max_attn_logit"], pos = values[pos], pos + 1
            layers.append(entry)

        record: dict[str, Any] = {"step": step, "loss": loss_v, "grad_norm": total, "output_logz": logz_v}
        if self._probe is not None and (step // self.record_every) % self.probe_every == 0:
            out = self._probe_output()
            record["update_size"] = float(torch.linalg.vector_norm(out - self._probe_ref)) if out is not None else None
        record.update(extra)
        record["layers"] = layers
        self.history.append(record)
        self._write(record)
        # Stale values must not leak into a later record if a forward skips a block (early exit, layer drop).
        self._residual = [None] * n
        self._norm_in = [[] for _ in range(n)]
        self._logz = None
        return record

    def _attn_logit(self, i: int) -> Tensor | None:
        best = None
        for m in self._attn_modules[i]:
            attrs = m.__dict__  # plain attributes; nn.Module.__getattr__ is slow for names that are not there
            for attr in MAX_ATTN_LOGIT_ATTRS:
                v = attrs.get(attr)
                if v is None:
                    v = m._buffers.get(attr)
                if isinstance(v, Tensor) and v.numel() == 1:
                    v = v.detach().float().reshape(())
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    v = torch.tensor(float(v))
                else:
                    continue
                best = v if best is None else torch.maximum(best, v.to(best.device))
                break
        return best

    def _write(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            step = record["step"]
            for key in ("loss", "grad_norm", "output_logz", "update_size"):
                if isinstance(record.get(key), (int, float)):
                    self._tb.add_scalar(f"addnorm/{key}", record[key], step)
            for entry in record["layers"]:
                for key in ("grad_norm", "residual_rms", "norm_input_rms", "max_attn_logit"):
                    if isinstance(entry.get(key), (int, float)):
                        self._tb.add_scalar(f"addnorm/{key}/{entry['index']:03d}", entry[key], step)
            self._tb.flush()

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook and close the output files; the model runs exactly as before attaching."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def layer_series(self, key: str = "grad_norm") -> tuple[list[int], list[list[float | None]]]:
        """(steps, values[step][layer]) of one per-layer quantity over ``history``."""
        return layer_series(self.history, key)


def layer_series(history: Sequence[dict] | Iterable[dict], key: str = "grad_norm"):
    """(steps, rows) with rows[k][i] the value of ``key`` for layer i at the k-th record (None when absent)."""
    steps, rows = [], []
    for rec in history:
        if "layers" not in rec:
            raise ValueError(f"history: every record needs a 'layers' list, got keys {sorted(rec)}")
        steps.append(rec.get("step", len(steps)))
        rows.append([entry.get(key) for entry in rec["layers"]])
    return steps, rows
