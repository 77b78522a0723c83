"""The "What the seeds say" section: every statement names real experiments, and every reading is computed from
the results it is shown with (change a number and the text changes; without the run, "not tested in this run"),
including the deep Pre-LN arm of depth-sweep, layernorm-scaling's Pre-LN half and the fusion speed read from
benchmarks/results/generate.md."""

import re

from addnorm.lab.core import EXPERIMENTS
from addnorm.lab.docs import render_results_doc
from addnorm.lab.evidence import Rule, evidence, units
from addnorm.lab.pooled import pool_record
from addnorm.lab.report import render_markdown
from addnorm.lab.seeds_advice import (
    ADVICE,
    GENERATE_RESULTS,
    Sources,
    deep_pre_ln,
    fusion_reading,
    pre_ln_depth,
    seeds_section,
)

GAP = Rule(name="gap", statistic="Post-LN excess without warmup minus with warmup", op=">", threshold=0.1)


def _record(name, values, rules=(GAP,), **extra):
    us = units(values, list(range(len(values))), 0)
    ev = evidence(rules, {r.name: us for r in rules})
    return {"name": name, "verdict": "reproduced", "kind": "empirical", "evidence": ev, **extra}


def _src(*records, generate_md=None, pooled=None):
    return Sources(records={r["name"]: r for r in records}, pooled=pooled or {}, generate_md=generate_md)


def _row(lines, where):
    return next(ln for ln in lines if ln.startswith(f"| {where} |"))


def test_every_experiment_named_by_the_seeds_section_exists():
    import addnorm.lab.experiments  # noqa: F401

    for _, _, names, _ in ADVICE:
        for name in names:
            assert name in EXPERIMENTS, name


def test_readings_are_computed_from_the_evidence_and_change_with_it():
    low = seeds_section([_record("warmup", [0.5, 0.6, 0.7])], generate_md=None)
    high = seeds_section([_record("warmup", [1.5, 1.6, 1.7])], generate_md=None)
    row_low, row_high = _row(low, "003, 4.5 point 1"), _row(high, "003, 4.5 point 1")
    assert "= 0.6 [" in row_low and "= 1.6 [" in row_high  # the mean of the units, with its interval
    assert "Post-LN excess without warmup minus with warmup" in row_low  # the rule's own statistic, not prose
    assert row_low != row_high


def test_without_the_run_every_experiment_reading_says_not_tested():
    lines = seeds_section([], generate_md=None)
    for where, _, names, _ in ADVICE:
        row = _row(lines, where)
        for name in names:
            assert f"{name}: not tested in this run" in row, (where, name)


def test_an_experiment_without_rules_reads_its_own_summary():
    rec = {"name": "warmup", "verdict": "not reproduced", "summary": "Post-LN 1.07 vs 0.06"}
    row = _row(seeds_section([rec], generate_md=None), "003, 4.5 point 1")
    assert "warmup: not reproduced (this run; no pre-registered rules yet): Post-LN 1.07 vs 0.06" in row


def test_pooled_verdicts_are_read_when_the_page_pools():
    page = {"meta": {"seed": 0}, "experiments": [_record("warmup", [0.5, 0.6, 0.7], code="c")]}
    other = _record("warmup", [0.9, 1.0, 1.1])["evidence"]
    for us in other["units"].values():
        for u in us:
            u["lab_seed"] = 1
    record = {"version": 2, "experiments": {"warmup": {"1": {"verdict": "reproduced", "code": "c", "evidence": other}}}}
    pooled = pool_record(record, {"warmup": "c"}, page)
    row = _row(seeds_section(page["experiments"], pooled, generate_md=None), "003, 4.5 point 1")
    assert "pooled, 2 lab seeds x 3 model seeds (units) each" in row and "= 0.8 [" in row


def test_seed_003_twelve_layers_reads_the_deep_pre_ln_arm_or_says_it_is_missing():
    shallow = {"name": "depth-sweep", "verdict": "reproduced", "metrics": {"per_seed": {"post excess L=6": [0.1]}}}
    assert "no Pre-LN arm at 12 or 24 layers in this run: not tested in this run" in deep_pre_ln(_src(shallow))
    assert deep_pre_ln(_src()) == "depth-sweep: not tested in this run"
    per_seed = {"pre excess L=24": [0.2, 0.4], "post excess L=24": [1.0, 3.0], "pre excess L=6": [0.1, 0.1]}
    deep = {"name": "depth-sweep", "verdict": "reproduced", "metrics": {"per_seed": per_seed}}
    text = deep_pre_ln(_src(deep))
    assert "pre excess L=24: mean 0.3 over 2 seeds" in text and "post excess L=24: mean 2 over 2 seeds" in text
    assert "L=6" not in text


def test_seed_004_effective_depth_reads_layernorm_scalings_pre_ln_half_judged_on_its_own():
    ctrl = Rule(
        name="depth helps", statistic="excess(Pre-LN, 2) - excess(Pre-LN, L)", op=">", threshold=0.0, role="positive"
    )
    pre = Rule(name="Pre-LN's deep blocks contribute less", statistic="C_deep(Pre-LN) - C_shallow", op="<", threshold=0)
    lns = Rule(name="LNS lowers the loss", statistic="excess(LNS) - excess(Pre-LN)", op="<", threshold=0.0)
    values = {"depth helps": [0.3, 0.4, 0.35], pre.name: [-0.2, -0.3, -0.25], "LNS lowers the loss": [0.5, 0.6, 0.7]}
    rules = (ctrl, pre, lns)
    ev = evidence(rules, {r.name: units(values[r.name], [0, 1, 2], 0) for r in rules})
    rec = {"name": "layernorm-scaling", "verdict": "not reproduced", "evidence": ev}
    text = pre_ln_depth(_src(rec))
    # the half holds although the experiment as a whole (LNS's half fails) is not reproduced
    assert text.startswith("layernorm-scaling, its Pre-LN half: reproduced (this run): ")
    assert "C_deep(Pre-LN) - C_shallow = -0.25 [" in text and "excess(Pre-LN, 2) - excess(Pre-LN, L) = 0.35" in text
    assert "] (> 0: met)" in text and "] (< 0: reproduced)" in text  # the control met, the claim rule reproduced
    assert "LNS" not in text
    values["depth helps"] = [-0.3, -0.4, -0.35]  # the control fails: the half cannot be read
    ev = evidence(rules, {r.name: units(values[r.name], [0, 1, 2], 0) for r in rules})
    assert pre_ln_depth(_src(dict(rec, evidence=ev))).startswith("layernorm-scaling, its Pre-LN half: inconclusive")
    arms = {"name": "layernorm-scaling", "verdict": "inconclusive", "metrics": {"per_seed": {"pre-ln L=8": [1, 3]}}}
    assert "pre-ln L=8: mean 2 over 2 seeds" in pre_ln_depth(_src(arms))


GENERATE = """
`python benchmarks/bench_generate.py --x`: 2026-12-03 10:00:00 UTC - {device}, 1 GPU, torch 2.9

| model | batch | dtype | phase | variant | ms | thread CPU: x unpatched [95%] | wall: x unpatched [95%] |
|---|---:|---|---|---|---:|---:|---:|
| llama | 1 | bf16 | prefill | fused | 1 / 1 | 1.200x [1.100, 1.300] | 1.0x [1.0, 1.0] |
| llama | 1 | bf16 | decode | fused | 1 / 1 | {ratio} | 1.0x [1.0, 1.0] |
| llama | 1 | bf16 | decode | norms | 1 / 1 | 1.500x [1.400, 1.600] | 1.0x [1.0, 1.0] |
"""


def test_fusion_reading_comes_from_the_generate_table_and_says_where_it_was_measured():
    gpu = fusion_reading(GENERATE.format(device="cuda", ratio="1.070x [1.060, 1.080]"))
    assert "bf16 batch 1: 1.070x [1.060, 1.080] (at or above 1.05x)" in gpu and "measured on cuda" in gpu
    assert "1.200x" not in gpu and "1.500x" not in gpu  # prefill and norms-only rows are not the claim's
    assert "has not measured" not in gpu
    cpu = fusion_reading(GENERATE.format(device="cpu", ratio="1.010x [0.990, 1.020]"))
    assert "1.010x [0.990, 1.020] (below the seed's 1.05-1.10x)" in cpu
    assert "about GPU inference, which benchmarks/results/generate.md has not measured" in cpu
    assert "undecided" in fusion_reading(GENERATE.format(device="cpu", ratio="1.040x [1.000, 1.080]"))
    assert "not measured here" in fusion_reading(None) and "not measured here" in fusion_reading("# nothing")


def test_the_repository_generate_results_are_read():
    text = GENERATE_RESULTS.read_text(encoding="utf-8")
    decode = re.findall(r"^\| llama \| 1 \| (\w+) \| decode \| fused \| [^|]+ \| ([\d.]+x \[[\d., ]+\]) \|", text, re.M)
    reading = fusion_reading(text)
    dtype, ratio = decode[0]  # the newest measurement comes first in the file
    assert f"{dtype} batch 1: {ratio}" in reading


def test_xiong_is_cited_at_seed_000_section_4_3_point_1():
    (row,) = [a for a in ADVICE if "Xiong" in a[1]]
    assert row[0] == "000, section 4.3 point 1"


def test_the_section_is_in_the_results_page_and_the_report():
    record = {"name": "warmup", "verdict": "reproduced", "kind": "empirical", "claim": "c", "source": "s"}
    record.update(criterion="k", precondition="p", metrics={}, figures=[], summary="", reason="", timings={})
    doc = {"meta": {"seed": 0}, "experiments": [record]}
    for text in (render_results_doc(doc), render_markdown(doc)):
        assert "## What the seeds say" in text and "warmup: reproduced (this run" in text
