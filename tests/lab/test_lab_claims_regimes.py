"""The regimes and controls changed on 2026-12-02 (issue 35): reordered-norm's negative control (a known-worse arm
the claim's margin must reject), fp16-layernorm's regime, z-loss's and layernorm-scaling's positive controls. Each
control is shown to fail on a planted null: the experiment's own run function, its training tasks replaced by a
fake mapper that returns planted per-run numbers (no training)."""

from __future__ import annotations

import pytest

from addnorm.lab.core import Context
from addnorm.lab.experiments import olmo2
from addnorm.lab.runner import load_experiments


def _context(name: str, mapper, tmp_path, seed: int = 0) -> Context:
    exp = load_experiments()[name]
    return Context(seed=seed, config=dict(exp.config), mapper=mapper, figure_dir=tmp_path, engine="sequential")


# ---- reordered-norm: the negative control ------------------------------------------------------------------------
def _grid_run(excess: float, lr: float) -> dict:
    """A planted run: the loss a run of this excess ends at (optimum 1.0, initial loss 3.5)."""
    return {
        "initial_loss": 3.5,
        "final_loss": 1.0 + excess,
        "excess": excess,
        "diverged": False,
        "spikes": 0,
        "lr": lr,
    }


def _reordered_mapper(worse_extra: dict[float, float]):
    """Planted runs of reordered-norm: Pre-LN + QK-norm hurt by the top of the grid, reordered + QK-norm a little
    less, and Pre-LN without QK-norm that plus ``worse_extra[lr]`` nats (0 everywhere: a null arm, no worse)."""

    def mapper(fn, tasks):
        out = []
        for t in tasks:
            lr, seed, model = t["train"]["lr"], t["train"]["seed"], t["model"]
            base = 0.05 + 0.01 * (seed % 3) + (0.5 if lr >= 1.0 else 0.2 if lr >= 0.3 else 0.0)
            if model["placement"] == "branch-output":
                base -= 0.02 if lr >= 0.3 else 0.0
            elif not model["qk_norm"]:
                base += worse_extra.get(lr, 0.0)
            out.append(_grid_run(base, lr))
        return out

    return mapper


def test_reordered_norm_trains_the_known_worse_arm_on_the_same_grid_and_seeds(tmp_path):
    seen = []

    def mapper(fn, tasks):
        seen.extend(tasks)
        return _reordered_mapper({})(fn, tasks)

    olmo2.reordered_norm(_context("reordered-norm", mapper, tmp_path))
    grid = load_experiments()["reordered-norm"].config["grid"]
    arms = {(t["model"]["placement"], t["model"]["qk_norm"]) for t in seen}
    assert arms == {("pre", True), ("branch-output", True), ("pre", False)}
    worse = [t for t in seen if not t["model"]["qk_norm"]]
    assert sorted({t["train"]["lr"] for t in worse}) == sorted(grid) and len(worse) == 3 * len(grid)
    assert all(t["model"]["norm"] == "rmsnorm" for t in worse)


def test_reordered_norm_negative_control_rejects_a_planted_null_arm(tmp_path):
    """Pre-LN without QK-norm planted as no worse than Pre-LN + QK-norm: the margin rejects nothing, so the
    parity verdict is refused (inconclusive), though the claim's own rule holds."""
    r = olmo2.reordered_norm(_context("reordered-norm", _reordered_mapper({}), tmp_path))
    assert r.verdict == "inconclusive" and "negative control" in r.reason and "without QK-norm" in r.reason
    assert r.metrics["rules"]["no-more-sensitive"]["verdict"] == "reproduced"
    assert r.metrics["rules"]["margin-rejects-no-qk"]["verdict"] != "reproduced"


def test_reordered_norm_negative_control_met_when_the_known_worse_arm_is_worse(tmp_path):
    # without QK-norm the top two LRs hurt 1.5 nats more: its sensitivity is (2 x 1.5) / 6 = 0.5 nats higher
    r = olmo2.reordered_norm(_context("reordered-norm", _reordered_mapper({0.3: 1.5, 1.0: 1.5}), tmp_path))
    assert r.verdict == "reproduced", r.reason
    est = r.metrics["rules"]["margin-rejects-no-qk"]["estimate"]
    assert est == pytest.approx(0.5, abs=1e-9)
    assert "negative control" in r.summary


def test_reordered_units_pair_the_known_worse_arm():
    with pytest.raises(ValueError, match="paired"):
        olmo2.reordered_units([0.1] * 3, [0.1] * 3, [0.1] * 3, [0.1] * 3, [0.3] * 3, [0.5] * 2)
    u = olmo2.reordered_units([0.1] * 3, [0.1] * 3, [0.1] * 3, [0.1] * 3, [0.3] * 3, [0.5, None, 0.4])
    assert u["margin-rejects-no-qk"] == [pytest.approx(0.4), None, pytest.approx(0.3)]
    rule = next(r for r in olmo2.RULES if r.name == "margin-rejects-no-qk")
    assert rule.role == "negative" and rule.op == ">" and rule.threshold == olmo2.NO_WORSE


# ---- fp16-layernorm: the regime (lr 2e-2) -------------------------------------------------------------------------
def _fp16_mapper(sumsq: float, fp16_breaks: bool, seen: list | None = None):
    """Planted fp16_task results: the fp32 arm's largest sum of squares ``sumsq``, trained (excess 0.1); the fp16
    arm NaN or not."""

    def mapper(fn, tasks):
        assert fn.__name__ == "fp16_task"
        if seen is not None:
            seen.extend(tasks)
        out = []
        for t in tasks:
            broke = t["stats"] == "fp16" and fp16_breaks
            out.append(
                {
                    "initial_loss": 3.5,
                    "final_loss": None if broke else 1.1,
                    "excess": 0.1,
                    "diverged": broke,
                    "steps_done": 10,
                    "loss_curve": [3.5, 1.1],
                    "overflows": 5 if t["stats"] == "fp16" and sumsq > 65504 else 0,
                    "first_overflow_step": None,
                    "max_sumsq": sumsq,
                }
            )
        return out

    return mapper


def test_fp16_layernorm_runs_in_the_chosen_regime(tmp_path):
    from addnorm.lab.experiments import fp16_stats

    seen: list = []
    r = fp16_stats.fp16_layernorm(_context("fp16-layernorm", _fp16_mapper(2e5, True, seen), tmp_path))
    assert {t["train"]["lr"] for t in seen} == {2e-2} and {t["model"]["n_layers"] for t in seen} == {6}
    assert {t["stats"] for t in seen} == {"fp16", "fp32"} and r.verdict == "reproduced"


def test_fp16_layernorm_control_refuses_a_stream_that_never_overflows(tmp_path):
    """Planted null: the fp32 arm's sum of squares stays below 65504 (the lr 1e-2 regime at lab seeds 1-2), and
    the fp16 arm 'breaks' anyway: without the overflow regime the verdict is refused."""
    from addnorm.lab.experiments import fp16_stats

    r = fp16_stats.fp16_layernorm(_context("fp16-layernorm", _fp16_mapper(3e4, True), tmp_path))
    assert r.verdict == "inconclusive" and "overflow regime reached" in r.reason
    r = fp16_stats.fp16_layernorm(_context("fp16-layernorm", _fp16_mapper(2e5, False), tmp_path))
    assert r.verdict == "not reproduced"  # the regime reached, the fp16 arm trained on: the claim can fail


# ---- layernorm-scaling: no task where depth helps (what was tried is in the verdict's reason) ---------------------
def _lns_mapper(shallow_excess: float):
    """Planted language_task results: the deep arms end at excess 0.2 with a grown stream and a curse-of-depth skip
    profile; the 2-layer arm at ``shallow_excess``."""

    def mapper(fn, tasks):
        assert fn.__name__ == "language_task"
        out = []
        for t in tasks:
            layers = t["model"]["n_layers"]
            ex = shallow_excess if layers == 2 else 0.2
            skipped = [1.0 + (2.0 if i == 0 else 0.3 if i < layers // 2 else 0.1) for i in range(layers)]
            probe = {"full": 1.0, "skipped": skipped, "rms_init": [1.0] * layers, "rms_final": [4.0] * layers}
            out.append({"initial_loss": 3.5, "final_loss": 0.8 + ex, "excess": ex, "diverged": False, "probe": probe})
            out[-1]["loss_curve"] = [3.5, 0.8 + ex]
        return out

    return mapper


def test_layernorm_scaling_a_task_that_needs_no_depth_is_refused_with_what_was_tried(tmp_path):
    from addnorm.lab.experiments import layernorm_scaling

    r = layernorm_scaling.layernorm_scaling(_context("layernorm-scaling", _lns_mapper(0.18), tmp_path))
    assert r.verdict == "inconclusive" and "depth helps" in r.reason
    assert layernorm_scaling.DEPTH_TRIED in r.reason and r.metrics["tried"] == layernorm_scaling.DEPTH_TRIED
    r = layernorm_scaling.layernorm_scaling(_context("layernorm-scaling", _lns_mapper(0.6), tmp_path))
    # depth helps: the controls are met, and the planted LNS arm (no lower loss) is judged by the claim
    assert r.verdict == "not reproduced" and "LNS lowers the loss" in r.reason
    assert layernorm_scaling.DEPTH_TRIED not in r.reason


# ---- z-loss: the regime was not found (what was tried is in the verdict's reason) ---------------------------------
def _z_mapper(logz_without: float, logz_with: float):
    def mapper(fn, tasks):
        assert fn.__name__ == "train_task"
        out = []
        for t in tasks:
            z = logz_with if t["train"]["z_loss"] else logz_without
            out.append(
                {
                    "logz_min": z,
                    "logz_late": z,
                    "logz_init": 8.3,
                    "diverged": False,
                    "excess": 2.0,
                    "mean_logit_late": -14.0,
                    "mean_logit_min": -14.0,
                    "logz_curve": [8.3, z],
                    "mean_logit_curve": [0.0, -14.0],
                    "loss_curve": [8.3, 3.0],
                }
            )
        return out

    return mapper


def test_z_loss_no_instability_without_z_loss_is_refused_with_what_was_tried(tmp_path):
    """Planted null: log Z stays positive in both arms (what every probe showed)."""
    from addnorm.lab.experiments import z_loss

    r = z_loss.z_loss_experiment(_context("z-loss", _z_mapper(4.8, 4.7), tmp_path))
    assert r.verdict == "inconclusive" and "positive control" in r.reason and z_loss.Z_LOSS_TRIED in r.reason
    r = z_loss.z_loss_experiment(_context("z-loss", _z_mapper(-30.0, 0.5), tmp_path))
    assert r.verdict == "reproduced"  # the paper's picture: far negative without, near 0 with
    r = z_loss.z_loss_experiment(_context("z-loss", _z_mapper(-30.0, -20.0), tmp_path))
    assert r.verdict == "not reproduced" and z_loss.Z_LOSS_TRIED not in r.reason


def test_z_loss_still_registered_after_lr_sensitivity():
    names = list(load_experiments())
    assert names.index("z-loss") == names.index("lr-sensitivity") + 1
