"""benchmarks/bench_generate.py as users run it, at tiny sizes: every variant, the paired ratios, the same greedy
tokens, the profile, the verdicts, the markdown file and --json; the paired loop against generate(); the pairing,
bootstrap and verdict on synthetic timings; bad arguments refused."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_generate  # noqa: E402
import generate_stats  # noqa: E402
import generate_steps  # noqa: E402

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "128", "--prompt", "6", "--new", "3"]


def _args(**over):
    """The namespace build_model reads, at tiny sizes."""
    import argparse

    a = dict(hidden=64, layers=2, heads=4, vocab=128, prompt=6, new=4, steps=0)
    return argparse.Namespace(**{**a, **over})


def test_tiny_run_rows_tokens_profile_verdicts_and_files(tmp_path, capsys):
    out = tmp_path / "generate.md"
    argv = [*TINY, "--batch", "1,2", "--dtype", "fp32", "--repeats", "2", "--rounds", "2", "--json", "--out", str(out)]
    assert bench_generate.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"env", "args", "clock", "rows", "paired", "profiles", "verdicts", "loop_cpu", "timings"}
    for t in result["timings"]:  # every step's (wall, thread CPU) seconds, per variant, for a reader to re-analyse
        assert {t["family"], t["batch"]} <= {"llama", "gpt2", 1, 2} and t["dtype"] == "fp32"
        for v in bench_generate.VARIANTS:  # prefill: a pair a round; decode: a list of pairs a round
            assert len(t["prefill"][v]) == 2 and [len(r) for r in t["decode"][v]] == [2, 2]
        assert all(len(pair) == 2 and pair[0] > 0 for r in t["decode"]["fused"] for pair in r)
    assert result["clock"]["name"] == "thread" and "one torch thread" in result["clock"]["why"]
    rows = result["rows"]
    seen = {(r["family"], r["batch"], r["variant"]) for r in rows}
    assert seen == {(f, b, v) for f in ("llama", "gpt2") for b in (1, 2) for v in bench_generate.VARIANTS}
    for r in rows:
        assert r["same_tokens"] is True
        assert r["prefill_tok_s"] > 0 and r["decode_ms_per_token"] > 0
        lo, hi = r["decode_speedup_range"]
        assert lo <= r["decode_speedup"] <= hi
        if r["variant"] == "unpatched":
            assert r["decode_speedup"] == 1.0 and r["prefill_speedup"] == 1.0  # its own baseline
    paired = result["paired"]
    keys = {(r["family"], r["batch"], r["phase"], r["variant"]) for r in paired}
    assert keys == {(f, b, ph, v) for f in ("llama", "gpt2") for b in (1, 2) for ph in ("prefill", "decode")
                    for v in ("fused", "norms")}  # fmt: skip
    for r in paired:
        assert r["same_tokens"] is True and r["like_generate"] is True
        for clock in ("wall", "thread"):
            s = r[clock]
            assert s["lo"] <= s["ratio"] <= s["hi"] and s["ms"] > 0 and s["baseline_ms"] > 0
            assert s["pairs"] == (2 if r["phase"] == "prefill" else 2 * 2)  # rounds, rounds x (new - 1) steps
            assert s["groups"] == 2 and s["group_range"][0] <= s["group_range"][1]  # a block a round (8 > 2 steps)
    assert len(result["profiles"]) == 8  # (family, batch) x phase
    for p in result["profiles"]:
        assert p["phase"] in ("prefill", "decode") and p["step_s"] > 0 and p["cost"] > 0
        assert 0 < p["share"] <= 1 and 0 <= p["norm_share"] and 0 < p["add_share"]
        assert p["norm_modules"] == 2 * 2 + 1  # two a layer and the final one
        assert p["fused_calls"] == 2  # one norm a layer takes the residual add (the other add stays)
    verdicts = result["verdicts"]
    assert {(v["family"], v["batch"], v["phase"]) for v in verdicts} == {
        (f, b, ph) for f in ("llama", "gpt2") for b in (1, 2) for ph in ("prefill", "decode")
    }
    for v in verdicts:
        assert v["variant"] == "fused" and v["clock"] == "thread" and v["control"] is None  # no --control
        if v["phase"] == "decode":
            assert v["target"] == 1.0 and v["status"] in ("met", "not met", "not resolved")
        else:
            assert v["target"] is None and v["status"] == "no target"  # fp32 prefill: the done-when sets none
    text = out.read_text()
    assert "| llama | 1 | fp32 | fused |" in text and "| gpt2 | 2 | fp32 | norms |" in text
    assert "| llama | 2 | fp32 | decode | fused |" in text and "thread CPU time" in text
    assert "residual adds" in text and "round-robin" in text and "Verdicts" in text


def test_paired_loop_gives_generates_greedy_tokens():
    import torch

    for family in ("llama", "gpt2"):
        a = _args()
        model = bench_generate.build_model(family, a, torch.float32, torch.device("cpu"))
        models = bench_generate.variants(model, None)  # the generate() rows' models
        ids = torch.randint(3, a.vocab, (2, a.prompt), generator=torch.Generator().manual_seed(1))
        made = []

        def make(i, model=model, made=made):
            made.append(i)
            return bench_generate.fresh_copies(model, i)

        loop = generate_steps.paired_steps(make, ids, rounds=2, steps=a.new - 1, sync=lambda: None, block=2)
        assert made == [0, 1]  # new copies for every round
        for name, m in models.items():
            expected = bench_generate.generate_once(m, ids, a.new, lambda: None, False)[0]
            assert len(loop["tokens"][name]) == 2
            for got in loop["tokens"][name]:
                assert torch.equal(got, expected), (family, name)
            assert len(loop["prefill"][name]) == 2
            assert [len(r) for r in loop["decode"][name]] == [2, 1, 2, 1]  # blocks of 2 steps: 3 steps a round
            assert all(w > 0 and c >= 0 for r in loop["decode"][name] for w, c in r)
        assert loop["process_cpu_s"] >= 0.99 * loop["thread_cpu_s"] > 0  # (two clocks, read one after the other)


class _Scripted:
    """In place of generate_steps._timed: each variant's k-th decode step 'takes' a scripted time, and the order
    of the turns is logged."""

    def __init__(self, speed):
        self.speed, self.turns, self.count = speed, [], {}

    def __call__(self, fn, sync):
        fn()
        name = fn.__self__.model.name
        k = self.count[name] = self.count.get(name, 0) + 1
        self.turns.append(name)
        base = 0.01 * (1 + k % 7) * (1 + 5 * (k > 6))  # load that changes from step to step, and jumps
        return base / self.speed[name], 2 * base / self.speed[name]


def test_steps_are_paired_by_index_and_the_order_rotates(monkeypatch):
    import torch

    a = _args(new=5)
    model = bench_generate.build_model("llama", a, torch.float32, torch.device("cpu"))
    models = bench_generate.variants(model, None)
    for name, m in models.items():
        m.name = name
    speed = {"unpatched": 1.0, "fused": 1.03, "norms": 0.98}
    scripted = _Scripted(speed)
    monkeypatch.setattr(generate_steps, "_timed", scripted)
    ids = torch.randint(3, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    loop = generate_steps.paired_steps(lambda i: models, ids, rounds=2, steps=4, sync=lambda: None)
    turns = [scripted.turns[i : i + 3] for i in range(0, len(scripted.turns), 3)]
    assert len(turns) == 2 * (1 + 4)  # a prefill and four steps a round, every variant once in each
    names = list(models)
    assert turns[0] == names and turns[5] == names[1:] + names[:1]  # the prefills rotate by round
    steps = turns[1:5] + turns[6:]
    for k, t in enumerate(steps):
        assert t == names[k % 3 :] + names[: k % 3]  # the steps rotate by one at each, across rounds
    for phase in ("prefill", "decode"):
        for name in ("fused", "norms"):
            for i in (0, 1):  # wall, thread
                if phase == "prefill":
                    base, mine = ([[t[i]] for t in loop[phase][v]] for v in ("unpatched", name))
                else:
                    base, mine = ([[t[i] for t in r] for r in loop[phase][v]] for v in ("unpatched", name))
                s = generate_stats.summarize(base, mine)
                # the load moves every time by up to 6x, but each pair shares it: every ratio is the speed
                assert s["ratio"] == pytest.approx(speed[name]) and s["lo"] == pytest.approx(speed[name])
                assert s["hi"] == pytest.approx(speed[name])


def test_paired_ratios_and_their_errors():
    assert generate_stats.paired_ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError, match="one baseline per variant sample, got 2 and 1"):
        generate_stats.paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="timings must be > 0 seconds, got 0.0"):
        generate_stats.paired_ratios([1.0], [0.0])


def test_bootstrap_interval_is_seeded_ordered_and_covers():
    import numpy as np

    rng = np.random.default_rng(0)
    values = list(1.02 * np.exp(rng.normal(0, 0.05, 301)))
    single = [[v] for v in values]  # groups of one: the ordinary bootstrap
    first = generate_stats.median_ci(single)
    assert first == generate_stats.median_ci(single)  # the fixed seed: the same interval on the same timings
    med, lo, hi = first
    assert med == pytest.approx(float(np.median(values)))
    assert lo < med < hi and 0.003 < hi - lo < 0.03  # ~2 x 1.96 x 1.25 x 0.05 / sqrt(301) = 0.014 wide
    assert generate_stats.median_ci([[1.5]]) == (1.5, 1.5, 1.5)
    # coverage: over many data sets, the 95% interval holds the true median about 95% of the time
    covered = 0
    for seed in range(200):
        data = list(np.exp(np.random.default_rng(seed + 1).normal(0, 0.05, 41)))
        _, lo, hi = generate_stats.median_ci([[v] for v in data], resamples=400)
        covered += lo <= 1.0 <= hi
    assert 0.88 <= covered / 200 <= 0.995
    with pytest.raises(ValueError, match="at least one group, each with at least one value"):
        generate_stats.median_ci([])
    # groups of unequal length (a shorter last block) are resampled the same way
    assert generate_stats.median_ci([[1.0, 1.0], [3.0]]) == (1.0, pytest.approx(1.0), pytest.approx(3.0))
    with pytest.raises(ValueError, match="resamples must be >= 1"):
        generate_stats.median_ci([[1.0]], resamples=0)


def test_bootstrap_resamples_rounds_whole():
    """Identical models whose copies differ by a few percent per round (where their weights landed): resampling
    steps alone excludes 1.00, resampling rounds does not."""
    import numpy as np

    rng = np.random.default_rng(3)
    offsets = [1.02, 0.985, 1.01, 0.99, 1.015, 0.98]  # one draw a round, mean 1.0
    rounds = [list(o * np.exp(rng.normal(0, 0.01, 64))) for o in offsets]
    _, lo_steps, hi_steps = generate_stats.median_ci([[v] for r in rounds for v in r])
    med, lo, hi = generate_stats.median_ci(rounds)
    assert hi - lo > 2 * (hi_steps - lo_steps)
    assert lo <= 1.0 <= hi and lo <= med <= hi
    s = generate_stats.summarize([[1.0] * 64 for _ in rounds], [[1 / v for v in r] for r in rounds])
    assert s["groups"] == 6 and s["pairs"] == 6 * 64
    assert s["group_range"] == pytest.approx((0.98, 1.02), abs=0.005)
    assert (s["ratio"], s["lo"], s["hi"]) == pytest.approx((med, lo, hi))
    with pytest.raises(ValueError, match="the same groups, got 2 and 1"):
        generate_stats.summarize([[1.0], [1.0]], [[1.0]])


def test_fresh_copies_are_new_models_with_the_same_weights():
    import torch

    from addnorm.integrations import hf

    model = bench_generate.build_model("llama", _args(), torch.float32, torch.device("cpu"))
    for i in range(3):
        copies = bench_generate.fresh_copies(model, i)
        assert list(copies) == list(bench_generate.VARIANTS)  # the baseline first, whatever the making order
        for name, m in copies.items():
            assert m is not model and hf.is_applied(m) == (name != "unpatched")
            w = m.model.layers[0].mlp.up_proj.weight
            assert torch.equal(w, model.model.layers[0].mlp.up_proj.weight)
            assert w.data_ptr() != model.model.layers[0].mlp.up_proj.weight.data_ptr()


def test_lag1_autocorrelation():
    import numpy as np

    iid = list(np.exp(np.random.default_rng(0).normal(0, 0.05, 2000)))
    assert abs(generate_stats.lag1_autocorrelation(iid)) < 0.1
    x, walk = 0.0, []
    for e in np.random.default_rng(1).normal(0, 0.05, 2000):
        x = 0.9 * x + e
        walk.append(math.exp(x))
    assert generate_stats.lag1_autocorrelation(walk) > 0.8
    assert generate_stats.lag1_autocorrelation([1.0, 1.0, 1.0]) == 0.0
    assert math.isnan(generate_stats.lag1_autocorrelation([1.0, 2.0]))


def test_targets_are_the_done_whens():
    assert generate_stats.target("decode", "fp32") == generate_stats.target("decode", "bf16") == 1.0
    assert generate_stats.target("prefill", "bf16") == 1.05
    assert generate_stats.target("prefill", "fp32") is None
    with pytest.raises(ValueError, match="phase must be 'prefill' or 'decode', got 'train'"):
        generate_stats.target("train", "fp32")


@pytest.mark.parametrize(
    "ratio, lo, hi, goal, status",
    [
        (1.02, 1.01, 1.03, 1.00, "met"),
        (1.01, 1.00, 1.02, 1.00, "met"),  # the interval's lower end on the target
        (0.98, 0.97, 0.995, 1.00, "not met"),
        (1.01, 0.99, 1.03, 1.00, "not resolved"),
        (1.04, 1.02, 1.06, 1.05, "not resolved"),
        (1.10, 1.06, 1.12, 1.05, "met"),
        (1.02, 1.01, 1.03, None, "no target"),
    ],
)
def test_verdict_status(ratio, lo, hi, goal, status):
    v = generate_stats.verdict(dict(ratio=ratio, lo=lo, hi=hi), goal, share=0.2, cost=0.5)
    assert v["status"] == status
    assert v["max_gain"] == pytest.approx(0.1) and v["max_speedup"] == pytest.approx(1 / 0.9)
    text = generate_stats.verdict_text(v)
    assert (f"**{status}**" in text) if goal is not None else text.startswith("no target")
    assert "out of reach" not in text  # 10% of the step: both the target and the seed's 5% within reach


def test_verdict_says_when_the_norms_share_is_too_small():
    stats = dict(ratio=1.01, lo=0.99, hi=1.03)
    # norms + adds 5% of the step, fused at 0.45x eager: at most 2.75% saved, 1.028x; 1.05x needs 4.76%
    v = generate_stats.verdict(stats, 1.05, share=0.05, cost=0.45)
    assert v["reachable"] is False and v["seed_reachable"] is False
    assert v["max_gain"] == pytest.approx(0.0275)
    text = generate_stats.verdict_text(v)
    assert "5.0% of an unpatched step" in text and "0.45x the time" in text and "at most 2.8% (ceiling 1.028x)" in text
    assert "less than the 4.8% the target needs: out of reach on this machine" in text
    assert "the seed's 5% (1.05x) is out of reach here" in text
    # decode's 1.00x is within reach whenever the fused calls cost less than eager's...
    assert generate_stats.verdict(stats, 1.0, share=0.05, cost=0.45)["reachable"] is True
    # ...and out of reach when they cost more: fusion then adds time
    slower = generate_stats.verdict(stats, 1.0, share=0.05, cost=1.5)
    assert slower["reachable"] is False and slower["max_gain"] == pytest.approx(-0.025)
    assert "adds 2.5% to the step" in generate_stats.verdict_text(slower)
    assert v["above_ceiling"] is False and slower["above_ceiling"] is True  # 0.99 is above 1/1.025 = 0.976
    # a ratio whose whole interval exceeds what the norms can give is flagged: something else differs
    above = generate_stats.verdict(dict(ratio=1.12, lo=1.10, hi=1.14), None, share=0.014, cost=0.9)
    assert above["above_ceiling"] is True and above["max_speedup"] == pytest.approx(1 / (1 - 0.0014))
    assert "the interval lies above that ceiling: more than the norms differs" in generate_stats.verdict_text(above)
    assert "control pair" not in generate_stats.verdict_text(above)  # no control run: nothing said
    assert "control pair of identical models missed 1.00x" in generate_stats.verdict_text({**above, "control": False})
    assert "control pair" not in generate_stats.verdict_text({**above, "control": True})
    with pytest.raises(ValueError, match="share must be in"):
        generate_stats.verdict(stats, 1.0, share=1.5, cost=0.5)


def test_verdict_clock():
    assert bench_generate.verdict_clock("auto", "cpu", 1)[0] == "thread"
    assert bench_generate.verdict_clock("wall", "cpu", 1)[0] == "wall"
    name, why = bench_generate.verdict_clock("auto", "cpu", 2)
    assert name == "wall" and "miss the others" in why
    assert bench_generate.verdict_clock("auto", "cuda", 1)[0] == "wall"
    with pytest.raises(ValueError, match="--clock thread needs --threads 1"):
        bench_generate.verdict_clock("thread", "cpu", 4)
    with pytest.raises(ValueError, match="on a GPU the work is the device's"):
        bench_generate.verdict_clock("thread", "cuda", 1)


def test_different_tokens_are_an_error(monkeypatch, capsys):
    real = bench_generate.generate_once

    def shifted(model, ids, new, sync, static):
        out, pre, dec = real(model, ids, new, sync, static)
        if model.__class__.__name__.startswith("Llama") and bench_generate.hf_is_applied(model):
            out = out.clone()
            out[:, -1] += 1  # a fused model that generated another token
        return out, pre, dec

    monkeypatch.setattr(bench_generate, "generate_once", shifted)
    argv = [*TINY, "--family", "llama", "--batch", "1", "--dtype", "fp32", "--repeats", "1", "--rounds", "1"]
    assert bench_generate.main([*argv, "--out", ""]) == 1
    assert "greedy tokens differ from the unpatched model's: llama b1 fp32 fused" in capsys.readouterr().err


def test_a_differing_pick_in_the_paired_loop_is_counted_and_the_variants_run_on_the_unpatched_tokens(
    monkeypatch, capsys
):
    """The paired loop feeds every variant the unpatched model's tokens (a bf16 near tie must not send one variant
    down another sequence) and counts the steps at which a variant's own pick differed; generate()'s rows keep
    the same-tokens check (exit 1 on a difference, tested above)."""
    import torch

    real = generate_steps.Decoder._forward
    seen: dict[int, tuple[object, list]] = {}  # per decoder: itself, the inputs of its decode steps

    def forward(self, input_ids):
        real(self, input_ids)
        if input_ids.shape[1] == 1:
            seen.setdefault(id(self), (self, []))[1].append(input_ids.clone())
        if bench_generate.hf_is_applied(self.model):
            self.next = self.next + 1  # the hf.apply'd models (fused and norms) pick another token

    monkeypatch.setattr(generate_steps.Decoder, "_forward", forward)
    argv = [*TINY, "--family", "llama", "--batch", "1", "--dtype", "fp32", "--repeats", "1", "--rounds", "1"]
    assert bench_generate.main([*argv, "--out", "", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    decode = [r for r in out["paired"] if r["phase"] == "decode"]
    assert {r["variant"] for r in decode} == {"fused", "norms"}
    for r in decode:
        assert not r["same_tokens"] and r["agree"][0] == 0 and r["agree"][1] > 0
    # the decode inputs of the patched models are exactly the unpatched model's tokens, not their own picks
    refs = [inputs for d, inputs in seen.values() if not bench_generate.hf_is_applied(d.model)]
    variants = [inputs for d, inputs in seen.values() if d.fed]
    assert len(variants) == 2 and all(bench_generate.hf_is_applied(d.model) for d, _ in seen.values() if d.fed)

    def same(x, y):
        return len(x) == len(y) and all(torch.equal(a, b) for a, b in zip(x, y))

    for inputs in variants:  # each ran on exactly the tokens of an unpatched model of the loop, not its own +1
        assert any(same(inputs, ref) for ref in refs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--new", "1"],
        ["--batch", "0"],
        ["--family", "opt"],
        ["--dtype", "fp16"],
        ["--hidden", "65"],
        ["--repeats", "0"],
        ["--rounds", "0"],
        ["--steps", "-1"],
        ["--block", "-1"],
        ["--clock", "cycles"],
        ["--clock", "thread", "--threads", "2"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as e:
            bench_generate.main(argv)
    finally:
        torch.set_num_threads(threads)  # main sets the thread count it is given
    assert e.value.code == 2
    if "--threads" in argv:
        assert "--clock thread needs --threads 1" in capsys.readouterr().err


def test_reallocate_moves_weights_and_keeps_sharing():
    import torch
    from torch import nn

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight  # tied, as embeddings and heads are
    model = nn.Sequential(a, b)
    model.register_buffer("scale", torch.arange(3.0))
    before = {n: (t.data_ptr(), t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    weight = a.weight
    generate_steps.reallocate(model)
    assert model[0].weight is weight and model[1].weight is weight  # the same Parameter, still shared
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.data_ptr() != before[n][0] and torch.equal(t, before[n][1]), n


def test_control_and_blocks_in_a_tiny_run(tmp_path, capsys):
    out = tmp_path / "generate.md"
    argv = [*TINY, "--family", "llama", "--batch", "1", "--dtype", "bf16", "--repeats", "1", "--rounds", "2"]
    assert bench_generate.main([*argv, "--block", "1", "--control", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    control = [r for r in result["paired"] if r["variant"] == bench_generate.CONTROL]
    assert [r["phase"] for r in control] == ["prefill", "decode"]
    for r in control:
        assert r["same_tokens"] is True
        assert r["thread"]["groups"] == (2 if r["phase"] == "prefill" else 2 * 2)  # a block a step
    assert [v["variant"] for v in result["verdicts"]] == ["fused", "fused"]  # no verdict for the control...
    for v in result["verdicts"]:  # ...but each verdict says whether the control's interval held 1.00x
        c = next(r["thread"] for r in control if r["phase"] == v["phase"])
        assert v["control"] is (c["lo"] <= 1.0 <= c["hi"])
    bf16_prefill = [v for v in result["verdicts"] if v["phase"] == "prefill"][0]
    assert bf16_prefill["target"] == 1.05
    text = out.read_text()
    assert "| llama | 1 | bf16 | decode | unpatched copy |" in text and "its interval should hold 1.000x" in text
    assert "weights moved to new memory every 1 steps" in text


def test_branch_output_and_sandwich_families_in_a_tiny_run(capsys):
    """OLMo 2 (norm_add) and Gemma 2 (norm_add_norm), issue 37: every variant generates the unpatched tokens and
    gets its paired rows; the fused model makes the chain's calls (the profile's hooks make it step aside, so they
    are counted here without hooks)."""
    import torch

    from addnorm.integrations import hf
    from addnorm.integrations.hf.handoff import fused_ops

    argv = [*TINY, "--family", "olmo2,gemma2", "--batch", "1", "--dtype", "fp32", "--repeats", "1", "--rounds", "1"]
    assert bench_generate.main([*argv, "--json", "--out", ""]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {(r["family"], r["variant"]) for r in result["rows"]} == {
        (f, v) for f in ("olmo2", "gemma2") for v in bench_generate.VARIANTS
    }
    assert all(r["same_tokens"] for r in result["rows"]) and all(r["same_tokens"] for r in result["paired"])
    ops = {"olmo2": {"norm_add", "norm_add_norm"}, "gemma2": {"norm_add_norm"}}
    for family, expected in ops.items():
        model = hf.apply(bench_generate.build_model(family, _args(), torch.float32, torch.device("cpu")))
        before = fused_ops()
        with torch.inference_mode():
            model(torch.randint(3, 128, (1, 6)))
        assert {op for op, n in fused_ops().items() if n > before[op]} == expected
