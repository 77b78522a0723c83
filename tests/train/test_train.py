"""Training: schedules, optimizer math, z-loss, the synthetic language, the loop, checkpoints, the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from addnorm.train.config import TrainConfig
from addnorm.train.data import MarkovLanguage, TextData, batch_generator
from addnorm.train.loop import build_optimizer, detect_spikes, train, z_loss
from addnorm.train.schedules import lr_multiplier, make_scheduler


def tiny_model(seed: int = 0, **overrides):
    from addnorm.nn import TransformerConfig, TransformerLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=16, backend="torch")
    return TransformerLM(TransformerConfig.preset("gpt2", **{**kw, **overrides}))


def tiny_cfg(**kw) -> TrainConfig:
    base = dict(steps=12, batch_size=4, seq_len=8, lr=1e-2, warmup=2, eval_batches=1)
    return TrainConfig(**{**base, **kw})


LANG = MarkovLanguage(vocab_size=16, order=1, branching=2, seed=3)


# ---- schedules ------------------------------------------------------------------------------------------------


def test_warmup_is_linear_and_never_zero():
    assert [lr_multiplier(s, schedule="cosine", warmup=4, total=20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_key_points():
    kw = dict(schedule="cosine", warmup=10, total=111, min_lr_ratio=0.1)
    assert lr_multiplier(10, **kw) == pytest.approx(1.0)  # end of warmup: the peak
    assert lr_multiplier(60, **kw) == pytest.approx(0.55)  # halfway through decay: (1 + r) / 2
    assert lr_multiplier(110, **kw) == pytest.approx(0.1)  # last step: r


def test_inverse_sqrt_and_constant():
    assert lr_multiplier(9, schedule="inverse_sqrt", warmup=10, total=100) == pytest.approx(1.0)
    assert lr_multiplier(39, schedule="inverse_sqrt", warmup=10, total=100) == pytest.approx(0.5)
    assert lr_multiplier(50, schedule="constant", warmup=10, total=100) == 1.0
    assert lr_multiplier(0, schedule="inverse_sqrt", warmup=0, total=100) == 1.0


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = make_scheduler(opt, schedule="cosine", warmup=2, total=10, min_lr_ratio=0.0)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1.0) and lrs[1] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(schedule="linear"), "schedule"),
        (dict(warmup=-1), "warmup"),
        (dict(total=0), "total"),
        (dict(min_lr_ratio=2.0), "min_lr_ratio"),
    ],
)
def test_schedule_bad_input(kw, match):
    args = {**dict(schedule="cosine", warmup=1, total=10), **kw}
    with pytest.raises(ValueError, match=match):
        lr_multiplier(0, **args)


# ---- optimizer and losses -------------------------------------------------------------------------------------


@pytest.mark.parametrize("independent", [False, True])
def test_weight_decay_math(independent):
    """With zero gradients Adam's update is 0, so one step only decays: matrices by wd*m (independent) or
    lr*wd*m (torch's coupled AdamW), never biases."""
    lin = torch.nn.Linear(3, 3)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    cfg = tiny_cfg(lr=0.5, weight_decay=0.1, independent_wd=independent, warmup=4, steps=10)
    opt = build_optimizer(lin, cfg)
    sched = make_scheduler(opt, schedule=cfg.schedule, warmup=cfg.warmup, total=cfg.steps)
    m = lr_multiplier(0, schedule="cosine", warmup=4, total=10)  # 0.25
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sched.step()
    factor = 1 - 0.1 * m if independent else 1 - 0.5 * m * 0.1
    torch.testing.assert_close(lin.weight.detach(), w0 * factor)
    torch.testing.assert_close(lin.bias.detach(), b0)


def test_z_loss_value():
    logits = torch.tensor([[[0.0, 0.0], [1.0, 2.0]]])
    zl, logz = z_loss(logits)
    expected = [math.log(2.0), math.log(math.e + math.e**2)]
    assert float(zl) == pytest.approx((expected[0] ** 2 + expected[1] ** 2) / 2)
    assert float(logz) == pytest.approx(sum(expected) / 2)


def test_z_loss_enters_the_gradient():
    """The CE loss is shift-invariant in the logits; only z-loss moves their mean, so its gradient must show."""
    data = LANG
    g = {}
    for coef in (0.0, 1.0):
        model = tiny_model()
        res = train(model, data, tiny_cfg(steps=1, z_loss=coef, clip=None, lr=1e-9))
        g[coef] = res.grad_norms[0]
    assert g[1.0] > g[0.0] * 1.5


def test_detect_spikes_flags_the_outlier_and_nan():
    rng = np.random.default_rng(0)
    values = list(2.0 + 0.01 * rng.standard_normal(60))
    values[40] = 5.0
    values[50] = float("nan")
    assert detect_spikes(values, window=32, sigma=6.0) == [40, 50]


# ---- synthetic language ---------------------------------------------------------------------------------------


def _h(p):
    return -sum(x * math.log(x) for x in p if x > 0)


def test_two_state_chain_entropy_rate_closed_form():
    a, b = 0.2, 0.6
    lang = MarkovLanguage.from_table([[1 - a, a], [b, 1 - b]], order=1)
    np.testing.assert_allclose(lang.stationary, [b / (a + b), a / (a + b)], atol=1e-12)
    expected = (b * _h([a, 1 - a]) + a * _h([b, 1 - b])) / (a + b)
    assert lang.entropy_rate == pytest.approx(expected, abs=1e-12)
    assert lang.optimum(10) == pytest.approx(expected, abs=1e-12)  # order 1: every prediction has full context


def test_entropy_rate_matches_monte_carlo_order2():
    lang = MarkovLanguage(vocab_size=6, order=2, branching=3, smoothing=0.05, seed=1)
    x = lang.sample(200, 400, batch_generator(0, 9, 0))
    nll = -lang.log_prob(x)
    assert float(nll.mean()) == pytest.approx(lang.entropy_rate, abs=0.02)
    # the first prediction lacks one token of context, so the sequence optimum is a little above h
    assert lang.optimum(4) > lang.optimum(64) > lang.entropy_rate
    assert lang.optimum(10_000) == pytest.approx(lang.entropy_rate, abs=1e-3)


def test_samples_follow_the_stationary_distribution():
    lang = MarkovLanguage(vocab_size=4, order=1, branching=2, smoothing=0.1, seed=2)
    x = lang.sample(4000, 2, batch_generator(0, 1, 0))
    freq = np.bincount(x[:, 0].numpy(), minlength=4) / 4000
    np.testing.assert_allclose(freq, lang.stationary, atol=0.03)


def test_batches_are_a_function_of_the_step():
    a, b = LANG.batch(5, 4, 8), LANG.batch(5, 4, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][:, :-1], a[0][:, 1:])
    assert not torch.equal(LANG.batch(6, 4, 8)[0], a[0])
    assert not torch.equal(LANG.batch(5, 4, 8, split="val")[0], a[0])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(vocab_size=1), "vocab_size"),
        (dict(order=0), "order"),
        (dict(branching=99), "branching"),
        (dict(smoothing=1.0), "smoothing"),
        (dict(seed=-1), "seed"),
    ],
)
def test_language_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        MarkovLanguage(**kw)


def test_text_data_split_and_batches(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) * 4)
    data = TextData(f, val_fraction=0.25)
    assert len(data.train_data) == 768 and len(data.val_data) == 256
    x, y = data.batch(0, 3, 16)
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    with pytest.raises(ValueError, match="does not exist"):
        TextData(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="seq_len"):
        data.batch(0, 1, 300, split="val")


# ---- the loop -------------------------------------------------------------------------------------------------


def test_training_moves_towards_the_optimum():
    model = tiny_model()
    res = train(model, LANG, tiny_cfg(steps=60, batch_size=8, seq_len=16, lr=1e-2, warmup=5, eval_batches=2))
    opt = LANG.optimum(16)
    assert res.optimum == pytest.approx(opt)
    assert not res.diverged and len(res.losses) == 60
    assert res.final_loss - opt < 0.5 * (res.initial_loss - opt)


def test_bad_train_config():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="resume"):
        TrainConfig(resume=True)


def test_divergence_stops_the_run():
    model = tiny_model()
    res = train(model, LANG, tiny_cfg(steps=30, lr=1e-2, diverge_factor=0.5))  # any loss "diverges"
    assert res.diverged and res.steps_done == 1 and math.isnan(res.final_loss)
    assert res.summary()["final_loss"] is None


def test_monitor_records_every_step():
    model = tiny_model(n_layers=2)
    res = train(model, LANG, tiny_cfg(steps=3, monitor=True))
    assert [r["step"] for r in res.records] == [0, 1, 2]
    assert len(res.records[0]["layers"]) == 2 and res.records[0]["layers"][1]["grad_norm"] > 0


def test_resume_gives_the_same_losses(tmp_path):
    full = train(tiny_model(), LANG, tiny_cfg(steps=12, out_dir=str(tmp_path / "full")))
    part = tiny_cfg(steps=12, checkpoint_every=4, out_dir=str(tmp_path / "run"))
    first = train(tiny_model(), LANG, part, stop_at=6)  # "interrupted" after step 6 (checkpoint written then)
    assert first.steps_done == 6
    assert not list((tmp_path / "run").glob(".*tmp*"))  # atomic write left no temporary behind
    resumed_cfg = tiny_cfg(steps=12, checkpoint_every=4, out_dir=str(tmp_path / "run"), resume=True)
    resumed = train(tiny_model(seed=123), LANG, resumed_cfg)  # a different init: the checkpoint must overwrite it
    assert resumed.losses == full.losses
    assert resumed.final_loss == full.final_loss
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(12))
    again = train(tiny_model(seed=5), LANG, resumed_cfg)  # resuming a finished run: nothing left to do
    assert again.losses == full.losses and again.final_loss == full.final_loss
    assert len(again.evals) == len(resumed.evals)


def test_resume_with_dropout_restores_rng(tmp_path):
    full = train(tiny_model(dropout=0.2), LANG, tiny_cfg(steps=8))
    part = tiny_cfg(steps=8, out_dir=str(tmp_path))
    train(tiny_model(dropout=0.2), LANG, part, stop_at=3)
    resumed = train(tiny_model(seed=9, dropout=0.2), LANG, tiny_cfg(steps=8, out_dir=str(tmp_path), resume=True))
    assert resumed.losses == full.losses


# ---- the CLI --------------------------------------------------------------------------------------------------

CLI_SMALL = [
    "--set",
    "d_model=16",
    "--set",
    "n_layers=1",
    "--set",
    "n_heads=2",
    "--set",
    "backend=torch",
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--seq-len",
    "8",
    "--warmup",
    "2",
    "--quiet",
]


def test_cli_train_json(tmp_path, capsys):
    from addnorm.cli import main

    rc = main(["train", "--preset", "gpt2", *CLI_SMALL, "--set", "z_loss=1e-4", "--out", str(tmp_path), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert s["steps"] == 6 and s["diverged"] is False and s["optimum"] == pytest.approx(MarkovLanguage().optimum(8))
    assert set(s) >= {"final_loss", "best_loss", "optimum", "spikes", "max_grad_norm", "diverged"}
    assert report["train"]["z_loss"] == 1e-4 and report["model"]["n_layers"] == 1
    assert report["model"]["vocab_size"] == 64 and len(report["losses"]) == 6
    assert (tmp_path / "summary.json").exists() and (tmp_path / "checkpoint.pt").exists()
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 6
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_cli_train_text_file(tmp_path, capsys):
    from addnorm.cli import main

    f = tmp_path / "corpus.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    rc = main(["train", "--preset", "llama", *CLI_SMALL, "--data", str(f), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"]["kind"] == "text" and report["model"]["vocab_size"] == 256
    assert report["summary"]["optimum"] is None and report["summary"]["final_loss"] > 0


def test_cli_train_human_summary_and_bad_input(capsys):
    from addnorm.cli import main

    assert main(["train", *CLI_SMALL]) == 0
    out = capsys.readouterr().out
    assert "final loss" in out and "diverged" in out and "optimum" in out
    assert main(["train", *CLI_SMALL, "--set", "n_layers"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["train", *CLI_SMALL, "--set", "not_a_field=1"]) == 2
    assert "not_a_field" in capsys.readouterr().err


def test_cli_resume_takes_the_run_flags_from_out_and_rejects_others(tmp_path, capsys):
    """README: `addnorm train --out runs/a --resume` alone continues a run started with other flags."""
    from addnorm.cli import main

    out = str(tmp_path / "a")
    first = ["--preset", "llama", *CLI_SMALL, "--lr", "3e-3", "--set", "checkpoint_every=3", "--out", out]
    assert main(["train", *first, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    ckpt = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 6
    assert main(["train", "--out", out, "--resume", "--json"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["preset"] == "llama" and resumed["train"]["lr"] == 3e-3 and resumed["model"]["n_layers"] == 1
    assert resumed["losses"] == full["losses"]
    assert main(["train", "--out", out, "--resume", "--lr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "--lr" in err and "0.003" in err and "Traceback" not in err


def test_resume_onto_other_settings_or_another_model_is_a_clear_error(tmp_path):
    from addnorm.train.config import TrainConfig
    from addnorm.train.loop import train

    base = dict(steps=4, batch_size=2, seq_len=8, warmup=1, out_dir=str(tmp_path))
    train(tiny_model(), LANG, TrainConfig(**base), stop_at=2)
    with pytest.raises(ValueError, match=r"lr=0.01 \(checkpoint: 0.001\)"):
        train(tiny_model(), LANG, TrainConfig(**base, lr=1e-2, resume=True))
    with pytest.raises(ValueError, match="different model"):
        train(tiny_model(n_layers=2), LANG, TrainConfig(**base, resume=True))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--set", "lr=abc"], "--set lr='abc': lr must be a finite number"),
        (["--set", "independent_wd=maybe"], "independent_wd"),
        (["--device", "nonsense"], "TrainConfig.device"),
        (["--data-seed", "-1"], "--data-seed"),
        (["--seed", str(2**64)], "TrainConfig.seed"),
    ],
)
def test_cli_bad_values_name_the_argument(capsys, argv, needle):
    from addnorm.cli import main

    assert main(["train", *CLI_SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_cuda_without_cuda_and_out_that_is_a_file(tmp_path, capsys):
    from addnorm.cli import main

    if not torch.cuda.is_available():
        assert main(["train", *CLI_SMALL, "--device", "cuda"]) == 2
        assert "cuda" in capsys.readouterr().err
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    assert main(["train", *CLI_SMALL, "--out", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err


def test_text_data_too_short_or_empty_fails_before_the_first_step(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        TextData(empty)
    f = tmp_path / "short.txt"
    f.write_bytes(b"x" * 300)  # train split 270 bytes: enough for seq_len 64; validation split 30: not enough
    steps = []
    with pytest.raises(ValueError, match="val split"):
        train(
            tiny_model(vocab_size=256, max_seq_len=64),
            TextData(f),
            tiny_cfg(steps=3, seq_len=64),
            callback=steps.append,
        )
    assert steps == []  # refused up front, not after training


def test_train_config_rejects_a_cuda_index_beyond_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert TrainConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="cuda:2.*2 CUDA device"):
        TrainConfig(device="cuda:2")


def test_cli_unavailable_backend_is_an_error_not_a_traceback(capsys, monkeypatch):
    import addnorm.train.loop as loop
    from addnorm.cli import main
    from addnorm.ops.backends import BackendUnavailableError

    def unavailable(*args, **kwargs):  # what ADDNORM_BACKEND=triton raises at the first forward on a CPU machine
        raise BackendUnavailableError("backend 'triton' is not available on cpu: no GPU")

    monkeypatch.setattr(loop, "train", unavailable)
    assert main(["train", *CLI_SMALL]) == 2
    assert "addnorm train: error: backend 'triton' is not available" in capsys.readouterr().err


def test_reference_loss_is_the_chains_own_loss_and_averages_to_the_optimum():
    lang = MarkovLanguage(vocab_size=6, order=2, branching=3, smoothing=0.05, seed=1)
    # short sequences, so the first prediction (one token of context) weighs in: its partial-context term matters
    vals = [lang.reference_loss(*lang.batch(i, 2000, 3)) for i in range(12)]  # standard error ~0.0025
    assert sum(vals) / len(vals) == pytest.approx(lang.optimum(3), abs=0.01)
    one = MarkovLanguage(vocab_size=8, order=1, branching=2, seed=4)
    x, y = one.batch(0, 4, 16)
    assert one.reference_loss(x, y) == pytest.approx(float(-one.log_prob(torch.cat([x[:, :1], y], 1)).mean()))


def test_excess_loss_is_paired_with_the_validation_tokens():
    """Near convergence the final loss can sit below the expected optimum by sampling noise alone; the excess is
    measured against the best possible loss on the same validation tokens instead."""
    from addnorm.train.loop import reference_eval_loss

    cfg = tiny_cfg(steps=3)
    res = train(tiny_model(), LANG, cfg)
    assert res.eval_optimum == pytest.approx(reference_eval_loss(LANG, cfg))
    assert res.eval_optimum != pytest.approx(res.optimum, abs=1e-9)  # 32 tokens: the noise is visible
    assert res.excess_loss == pytest.approx(res.final_loss - res.eval_optimum)
    assert res.summary()["eval_optimum"] == pytest.approx(res.eval_optimum)
    assert reference_eval_loss(TextData.__new__(TextData), cfg) is None  # text: no known optimum


def test_cli_disk_full_while_checkpointing_is_an_error_message(tmp_path, capsys, monkeypatch):
    import errno

    import addnorm.train.checkpoint as checkpoint
    from addnorm.cli import main

    def full(path, state):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "save_checkpoint", full)
    assert main(["train", *CLI_SMALL, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot write into --out" in err and "No space left" in err


# ---- faults: nothing to resume, corrupt checkpoints, torn logs, stale temporaries ----------------------------------


def test_cli_resume_without_a_run_is_an_error(tmp_path, capsys):
    """--resume on a missing or empty --out used to start a default 200-step run silently."""
    from addnorm.cli import main

    missing = tmp_path / "never_ran"
    assert main(["train", "--out", str(missing), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "does not exist" in err and not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--out", str(empty), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "checkpoint.pt" in err and list(empty.iterdir()) == []
    assert main(["train", "--resume", "--quiet"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


class _Runs:  # a pickled object that would run code when loaded: here, create a file
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_cli_corrupt_checkpoints_are_clear_errors(tmp_path, capsys):
    from addnorm.cli import main

    out = tmp_path / "run"
    assert main(["train", *CLI_SMALL, "--out", str(out)]) == 0
    capsys.readouterr()
    ckpt = out / "checkpoint.pt"
    good = ckpt.read_bytes()
    state = torch.load(ckpt, weights_only=True)  # what the run wrote is plain data
    marker = tmp_path / "code_ran"

    def save(obj):
        return lambda: torch.save(obj, ckpt)

    corruptions = {
        "empty": (lambda: ckpt.write_bytes(b""), "the file is empty"),
        "truncated": (lambda: ckpt.write_bytes(good[: len(good) // 2]), "torch.load failed"),
        "random bytes": (lambda: ckpt.write_bytes(np.random.default_rng(0).bytes(4096)), "torch.load failed"),
        "text": (lambda: ckpt.write_text("not a checkpoint\n"), "torch.load failed"),
        "a list": (save([1, 2, 3]), "holds a list"),
        "missing parts": (save({"model": state["model"]}), "missing optimizer"),
        "wrong type": (save({**state, "optimizer": 5}), "'optimizer' is a int"),
        "step beyond the run": (save({**state, "step": 1000}), "step 1000 is outside this run of 6 steps"),
        "negative step": (save({**state, "step": -1}), "outside this run"),
        "curve too short": (save({**state, "result": {**state["result"], "losses": []}}), "one value per step"),
        "bad rng": (save({**state, "rng": {**state["rng"], "torch": torch.zeros(3)}}), "cannot restore it"),
        "runs code": (save({**state, "model": _Runs(marker)}), "refuses: loading them could run code"),
    }
    for name, (corrupt, needle) in corruptions.items():
        corrupt()
        code = main(["train", "--out", str(out), "--resume", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, name
        assert err.startswith(f"addnorm train: error: {ckpt} is not a readable checkpoint ("), (name, err)
        assert needle in err and "Traceback" not in err, (name, err)
    assert not marker.exists()  # weights_only=True: the checkpoint's code never ran
    ckpt.write_bytes(good)
    assert main(["train", "--out", str(out), "--resume", "--quiet"]) == 0  # the intact one still resumes


def test_torn_last_log_line_is_skipped_on_resume(tmp_path):
    cfg = tiny_cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=4)
    full = train(tiny_model(), LANG, tiny_cfg(steps=8))
    train(tiny_model(), LANG, cfg, stop_at=6)  # log has steps 0-5; a checkpoint at step 6 (the end of the call)
    log = tmp_path / "log.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 6, "loss": 2.7')  # what a crash mid-write leaves
    resumed = train(tiny_model(), LANG, tiny_cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=4, resume=True))
    assert resumed.losses == full.losses
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(8))


def test_damaged_log_line_before_the_last_is_an_error_naming_it(tmp_path):
    cfg = tiny_cfg(steps=8, out_dir=str(tmp_path))
    train(tiny_model(), LANG, cfg, stop_at=4)
    log = tmp_path / "log.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = "garbage"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"log.jsonl line 2 is not a log record"):
        train(tiny_model(), LANG, tiny_cfg(steps=8, out_dir=str(tmp_path), resume=True))


def test_stale_checkpoint_temporaries_are_removed(tmp_path):
    """A kill during a checkpoint write left `.checkpoint.pt.tmp-<pid>` behind forever."""
    stale = [
        tmp_path / ".checkpoint.pt.tmp-12345",
        tmp_path / ".checkpoint.pt.k2j3h4.tmp",
        tmp_path / ".log.jsonl.abcd.tmp",
    ]
    for p in stale:
        p.write_bytes(b"x" * 100)
    keep = tmp_path / "notes.tmp"
    keep.write_text("mine")
    train(tiny_model(), LANG, tiny_cfg(steps=2, out_dir=str(tmp_path)))
    assert not any(p.exists() for p in stale) and keep.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "log.jsonl", "notes.tmp"]


def test_interrupted_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import addnorm.train.checkpoint as checkpoint

    train(tiny_model(), LANG, tiny_cfg(steps=4, out_dir=str(tmp_path)), stop_at=2)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def killed(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # some bytes are in the temporary when the interrupt comes
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_model(), LANG, tiny_cfg(steps=4, out_dir=str(tmp_path), resume=True))
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_checkpoints_by_default_every_50_steps(tmp_path):
    assert TrainConfig().checkpoint_every == 50

    def kill_at_55(entry):
        if entry["step"] == 55:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_model(), LANG, tiny_cfg(steps=60, out_dir=str(tmp_path)), callback=kill_at_55)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 50
