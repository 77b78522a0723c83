"""What the training experiments share: the tiny model and language, the training task run through ``ctx.map``
and the grid of (arm, seed) tasks, excess loss, the seed-agreement rules every verdict applies (a strict majority,
a control), and figure helpers.

A training run is the module-level task :func:`train_task`: plain arguments in (model and TrainConfig keywords,
the language's seed), a JSON-able dict out (losses, optimum, a subsampled curve, log Z, the LR schedule actually
used, the max attention logit, the monitor's record at initialization). The lab's executor can therefore run the
runs of an experiment on worker processes or torchrun ranks, in any order, and get the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from addnorm.lab.core import Context, experiment

VOCAB, D_MODEL, HEADS, SEQ, BATCH = 32, 32, 2, 32, 8
# A run "trains" when its excess loss is below this. The runs that fail to train here sit at about 1.03 nats of
# excess (Post-LN stuck at every depth with lr 4e-3, the variant runs of 2026-11-30); the optimum is 0. Half the stuck level separates the
# two with room on both sides; the controls of every experiment use it.
TRAINED_EXCESS = 0.5


def seeds_needed(n: int) -> int:
    """How many of ``n`` seeds must agree for a verdict: a strict majority, and at least 2 (never more than n)."""
    return min(n, max(2, n // 2 + 1))


def settings(ctx: Context) -> dict:
    """The run's settings, read from the experiment's registered config only (``ctx.config``, which the runner
    fills and the cache key hashes), so the config shown in the report is exactly what ran: its shared entries
    with the "quick" or "default" sizes merged in."""
    mode = "quick" if ctx.quick else "default"
    if mode not in ctx.config:
        raise ValueError(
            f"ctx.config has no {mode!r} sizes: pass the experiment's registered config "
            "(Context(config=EXPERIMENTS[name].config)) or run it through addnorm.lab.runner"
        )
    shared = {k: v for k, v in ctx.config.items() if k not in ("quick", "default")}
    return {**shared, **ctx.config[mode]}


def seed_list(ctx: Context, n: int) -> list[int]:
    """The run's ``n`` model seeds: disjoint across lab seeds (:func:`addnorm.lab.seeds.model_seeds`), and in a
    second stage the ones it adds (``Context.model_seeds``)."""
    return ctx.model_seeds(n)


def finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------ the language
_LANGS: dict[tuple[int, int], Any] = {}


def language(seed: int, vocab: int = VOCAB):
    """The Markov language of the experiments (order 1, 3 successors per token). Every seed of an experiment
    trains on the language of the lab's seed: seeds vary the init and the batches, not the task."""
    from addnorm.train.data import MarkovLanguage

    key = (seed, vocab)
    if key not in _LANGS:
        _LANGS[key] = MarkovLanguage(vocab_size=vocab, order=1, branching=3, seed=seed)
    return _LANGS[key]


class CachedBatches:
    """A language whose batches are memoized in this process: the arms of an experiment at one seed see the same
    batches, and sampling the chain costs ~10% of a tiny model's step. Batches are a pure function of their
    arguments, so the cache changes no number."""

    _cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    MAX_ENTRIES = 8000  # ~2 KB each at B = 8, T = 32

    def __init__(self, lang):
        self.lang = lang
        self.vocab_size = lang.vocab_size

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"):
        key = (self.lang.seed, self.lang.vocab_size, step, batch_size, seq_len, seed, split)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            hit = self._cache[key] = self.lang.batch(step, batch_size, seq_len, seed=seed, split=split)
        return hit

    def optimum(self, seq_len: int) -> float:
        return self.lang.optimum(seq_len)

    def reference_loss(self, inputs, targets) -> float:
        return self.lang.reference_loss(inputs, targets)

    def describe(self, seq_len: int) -> dict:
        return self.lang.describe(seq_len)


def model_config(**overrides):
    """The tiny LM of every experiment: Xavier init (the papers' assumption), plain-PyTorch norms (fastest here)."""
    from addnorm.nn import TransformerConfig

    kw = dict(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=2,
        n_heads=HEADS,
        max_seq_len=SEQ,
        norm="layernorm",
        placement="pre",
        ffn="gelu",
        init="xavier",
        backend="torch",
    )
    kw.update(overrides)
    if kw["placement"] == "dyt":  # DyT is a norm kind: Pre-LN placement with tanh instead of the norm
        kw.update(placement="pre", norm="dyt")
    return TransformerConfig(**kw)


# ------------------------------------------------------------------------------------------------ the task
def excess(final_loss: float | None, initial_loss: float, reference: float) -> float:
    """Final validation loss minus ``reference`` (the best possible loss on the same validation tokens), a
    diverged run (no finite final loss) counted at its initial loss, and never above it (Wortsman et al.'s
    min(loss, loss_0))."""
    final = final_loss if finite(final_loss) else initial_loss
    return min(final, initial_loss) - reference


def _subsample(values: Sequence[float], points: int) -> list[float | None]:
    """``points`` means of equal consecutive chunks of ``values`` (a curve for a figure; non-finite -> None)."""
    n = len(values)
    if n == 0:
        return []
    points = min(points, n)
    out = []
    for i in range(points):
        chunk = [v for v in values[i * n // points : (i + 1) * n // points] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def _num(x) -> float | None:
    return float(x) if finite(x) else None


@torch.no_grad()
def hidden_stats(net, x: torch.Tensor) -> list[dict]:
    """Per block of ``net`` (a TransformerLM), statistics of its output (the residual stream) on tokens ``x``: RMS,
    max |h|, and max |h| / median |h| (Sun et al. 2024's "massive activations" are thousands of times the
    median)."""
    outs: list[torch.Tensor] = []

    def grab(module, args, out):
        outs.append((out[0] if isinstance(out, (tuple, list)) else out).detach().float())

    hooks = [block.register_forward_hook(grab) for block in net.blocks]
    was_training = net.training
    net.eval()
    try:
        net(x)
    finally:
        for h in hooks:
            h.remove()
        net.train(was_training)
    stats = []
    for h in outs:
        a = h.abs()
        med = float(a.median())
        stats.append(
            {
                "rms": _num(float(h.pow(2).mean().sqrt())),
                "max_abs": _num(float(a.max())),
                "max_over_median": _num(float(a.max()) / med) if med > 0 else None,
            }
        )
    return stats


def build_run(*, model: dict, train: dict, lang_seed: int, vocab: int = VOCAB):
    """A run's TrainConfig, its model initialised as every run's is (``torch.manual_seed(cfg.seed)``, then the
    TransformerLM) and its data: what :func:`train_task` and the batched engine's group task both start from."""
    from addnorm.nn import TransformerLM
    from addnorm.train.config import TrainConfig

    cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "eval_batches": 2, **train})
    torch.manual_seed(cfg.seed)
    net = TransformerLM(model_config(**{"vocab_size": vocab, **model}))
    return cfg, net, CachedBatches(language(lang_seed, vocab))


def probe_batch(data, cfg) -> torch.Tensor:
    """The tokens :func:`hidden_stats` reads: the run's first validation batch."""
    return data.batch(0, cfg.batch_size, cfg.seq_len, seed=cfg.seed, split="val")[0]


def run_outcome(res, reference: float, curve_points: int) -> dict:
    """The fields every training task returns first: losses, the reference they are scored against, the excess,
    whether it diverged, steps done and the subsampled loss curve (``res``: a TrainResult)."""
    return {
        "initial_loss": _num(res.initial_loss),
        "final_loss": _num(res.final_loss),
        "optimum": _num(res.optimum),
        "reference": _num(reference),
        "excess": _num(excess(res.final_loss, res.initial_loss, reference)),
        "diverged": bool(res.diverged),
        "steps_done": res.steps_done,
        "loss_curve": _subsample(res.losses, curve_points),
    }


def train_task(
    *,
    model: dict,
    train: dict,
    lang_seed: int,
    vocab: int = VOCAB,
    curve_points: int = 50,
    init_record: bool = False,
    hidden_probe: bool = False,
    track_mean_logit: bool = False,
    layer_grads: bool = False,
    probe: str | None = None,
) -> dict:
    """One training run of the tiny LM, as a ``ctx.map`` task. ``model``: TransformerConfig overrides (a
    ``vocab_size`` there makes the model's vocabulary larger than the language's: unused tokens); ``train``:
    TrainConfig keywords (``seed`` sets the model init and the batches); ``lang_seed``: the language.
    With ``train["monitor"]`` the monitor's records give the max attention logit (needs ``record_logits``) and,
    with ``init_record``, the per-layer record at step 0 is returned. ``hidden_probe``: :func:`hidden_stats` on
    the first validation batch before and after training. ``track_mean_logit``: the mean output logit of every
    training step (over positions and the whole vocabulary), as a curve and its late value. ``layer_grads`` (with
    ``train["monitor"]``): each layer's gradient norm averaged over the monitor's records after step 0. ``probe``:
    the name "module:function" of a measurement, called as ``function(net, data, cfg)`` before training (it may
    hook the model); what it returns is called as ``finish(net, result)`` after training, and its JSON-able dict
    is returned under "probe" (a name, not a callable, so the task stays JSON and cacheable). "spikes" counts the
    loss spikes of the training loop's rule (OLMo-core's: above mean + 6 std of the last 128 steps)."""
    from addnorm.train.loop import train as run

    cfg, net, data = build_run(model=model, train=train, lang_seed=lang_seed, vocab=vocab)
    probe_x = probe_batch(data, cfg)
    hidden_init = hidden_stats(net, probe_x) if hidden_probe else None
    mean_logits: list[float] = []
    hook = None
    if track_mean_logit:

        def record_mean(module, args, out):
            if torch.is_grad_enabled():  # training steps only, not the evaluations
                mean_logits.append(float(out.detach().float().mean()))

        hook = net.lm_head.register_forward_hook(record_mean)
    finish = None
    if probe is not None:
        import importlib

        module, _, function = probe.partition(":")
        finish = getattr(importlib.import_module(module), function)(net, data, cfg)
    try:
        res = run(net, data, cfg)
    finally:
        if hook is not None:
            hook.remove()
    return run_output(
        res,
        cfg,
        net,
        lang_seed=lang_seed,
        vocab=vocab,
        curve_points=curve_points,
        init_record=init_record,
        hidden=(hidden_init, probe_x) if hidden_probe else None,
        layer_grads=layer_grads,
        finish=finish,
        mean_logits=mean_logits if track_mean_logit else None,
    )


def run_output(
    res,
    cfg,
    net,
    *,
    lang_seed: int,
    vocab: int,
    curve_points: int,
    init_record: bool = False,
    hidden: tuple | None = None,
    layer_grads: bool = False,
    finish=None,
    mean_logits: list[float] | None = None,
) -> dict:
    """The JSON-able dict of :func:`train_task` from a finished run: ``res`` (its TrainResult), ``net`` (trained);
    ``hidden`` = (the stats at init, the probe tokens) for ``hidden_probe``; ``finish`` the probe's finisher;
    ``mean_logits`` the per-step mean output logits for ``track_mean_logit``."""
    reference = res.eval_optimum
    if reference is None:  # a diverged run has no final evaluation: score its validation tokens anyway
        from addnorm.train.loop import reference_eval_loss

        reference = reference_eval_loss(CachedBatches(language(lang_seed, vocab)), cfg)
    n = len(res.losses)
    tail = max(1, n // 10)
    logz_tail = [v for v in res.logz[-tail:] if math.isfinite(v)]
    logits = [layer.get("max_attn_logit") for rec in res.records for layer in rec.get("layers", [])]
    logits = [v for v in logits if finite(v)]
    peak = cfg.lr
    out = {
        **run_outcome(res, reference, curve_points),
        "logz_curve": _subsample(res.logz, curve_points),
        "logz_init": _num(res.logz[0]) if res.logz else None,
        "logz_late": _num(sum(logz_tail) / len(logz_tail)) if logz_tail else None,
        "logz_min": _num(min(res.logz)) if res.logz else None,
        # steps trained at the peak LR (to float rounding): a warmup arm must get there and stay a while
        "steps_at_peak_lr": sum(1 for lr in res.lrs if abs(lr - peak) <= 1e-9 * peak),
        "max_grad_norm": _num(res.max_grad_norm),
        "max_attn_logit": max(logits) if logits else None,
        "spikes": len(res.spikes),
    }
    if init_record:  # the loop stores monitor records JSON-ready
        out["init_record"] = res.records[0] if res.records else None
    if hidden is not None:
        out["hidden_init"] = hidden[0]
        out["hidden_final"] = hidden_stats(net, hidden[1])
    if layer_grads:
        recs = [rec.get("layers", []) for rec in res.records if rec.get("step", 0) > 0]
        n_layers = min((len(r) for r in recs), default=0)
        out["layer_grad_mean"] = [
            _num(sum(r[i]["grad_norm"] for r in recs) / len(recs))
            if all(finite(r[i].get("grad_norm")) for r in recs)
            else None
            for i in range(n_layers)
        ]
    if finish is not None:
        out["probe"] = finish(net, res)
    if mean_logits is not None:
        late = [v for v in mean_logits[-tail:] if math.isfinite(v)]
        out["mean_logit_curve"] = _subsample(mean_logits, curve_points)
        out["mean_logit_late"] = _num(sum(late) / len(late)) if late else None
        out["mean_logit_min"] = _num(min(mean_logits)) if mean_logits else None
    return out


def grid_tasks(ctx: Context, arms: dict[str, dict], seeds: list[int], train: dict, **task_kw) -> tuple[list, list]:
    """One task per (arm, seed): ``arms[label]`` = (model overrides, TrainConfig overrides)."""
    keys, tasks = [], []
    for label, (model, extra) in arms.items():
        for s in seeds:
            keys.append((label, s))
            tasks.append({"model": model, "train": {**train, **extra, "seed": s}, "lang_seed": ctx.seed, **task_kw})
    return keys, tasks


def seed_values(runs: dict, label, seeds: list[int], key: str) -> list:
    return [runs[(label, s)][key] for s in seeds]


# ------------------------------------------------------------------------------------------------ verdicts
Verdict = tuple[bool | None, dict, str]  # (passed or None, details for the metrics, reason when None)


def majority(per_seed: Sequence[bool | None], what: str) -> Verdict:
    """Reproduced iff at least :func:`seeds_needed` seeds pass; inconclusive when too few seeds could decide."""
    n = len(per_seed)
    need = seeds_needed(n)
    decided = [p for p in per_seed if p is not None]
    wins = sum(1 for p in decided if p)
    details = {"seeds_agreeing": f"{wins}/{n}", "seeds_needed": need}
    if n == 0 or len(decided) < need:
        return None, details, f"only {len(decided)} of {n} seeds gave finite numbers for {what}"
    return wins >= need, details, ""


def paired(*series: Sequence) -> bool:
    """Whether the series (one value per seed for each arm or measure) all have the same, non-zero length."""
    return bool(series) and len(series[0]) > 0 and all(len(x) == len(series[0]) for x in series)


def control(holds: Sequence[bool], reason: str) -> str:
    """'' when the control holds at a strict majority of the seeds, else the reason (with the count)."""
    n = len(holds)
    ok = sum(1 for h in holds if h)
    return "" if n and ok >= seeds_needed(n) else f"{reason} (held at {ok} of {n} seeds)"


# ------------------------------------------------------------------------------------------------ figures
def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # figures are extras: metrics carry the results (pip install 'addnorm[lab]')
    return plt


def save(plt, fig, ctx: Context, name: str) -> list[str]:
    fig.tight_layout()
    fig.savefig(ctx.figure_path(name), dpi=100)
    plt.close(fig)
    return [name]


def curve_steps(curve: Sequence, steps: int) -> list[float]:
    """The x values (step at each chunk's middle) of a curve from :func:`_subsample`."""
    n = len(curve)
    return [(i + 0.5) * steps / n for i in range(n)]


def nan(x) -> float:
    return float(x) if finite(x) else float("nan")


def fmt(x) -> str:
    return "n/a" if not finite(x) else f"{x:.3f}"


def fmt_seeds(values: Sequence) -> str:
    return "/".join(fmt(v) for v in values)


SEED_STYLES = ("-", "--", ":", "-.")


def plot_curves(ax, runs: dict, labels: Sequence, seeds: list[int], steps: int, names=None) -> None:
    """One line per seed (line style), one colour per arm."""
    for i, label in enumerate(labels):
        for k, s in enumerate(seeds):
            curve = runs[(label, s)]["loss_curve"]
            ax.plot(
                curve_steps(curve, steps),
                [nan(v) for v in curve],
                SEED_STYLES[k % len(SEED_STYLES)],
                color=f"C{i}",
                lw=1,
                label=(names or {}).get(label, str(label)) if k == 0 else None,
            )


def plot_seed_profiles(ax, profiles: dict, arms: Sequence, names: dict, first_x: int = 0) -> None:
    """Per-layer (or per-block) profiles: ``profiles[arm][k]`` is seed k's list of values, plotted at x = first_x,
    first_x + 1, ...; one colour per arm, the seed's line style with markers."""
    for i, arm in enumerate(arms):
        for k, values in enumerate(profiles[arm]):
            ax.plot(
                range(first_x, first_x + len(values)),
                [nan(v) for v in values],
                "o" + SEED_STYLES[k % len(SEED_STYLES)],
                color=f"C{i}",
                lw=1,
                label=names[arm] if k == 0 else None,
            )


def registrar(criteria: dict[str, str], preconditions: dict[str, str], *, version: int):
    """The experiment decorator of one training module: each experiment's criterion and control are looked up by its
    name in the module's tables (so they stay written down in one place, before any run), and ``version`` is put into
    every config (raising it invalidates cached results when a setup changes)."""

    def register(
        name: str, *, claim: str, source: str, config: dict, kind: str = "empirical", suite: str = "core", **prereg
    ):
        """``prereg``: the experiment's ``rules``, ``fixed`` and ``changes`` (see :class:`addnorm.lab.core.Experiment`)."""
        return experiment(
            name,
            claim=claim,
            source=source,
            config={"version": version, **config},
            criterion=criteria[name],
            precondition=preconditions[name],
            kind=kind,
            suite=suite,
            **prereg,
        )

    return register
