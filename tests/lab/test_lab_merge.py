"""``addnorm lab merge``: shard outputs combine into the unsharded run's report; conflicting results, mismatched
runs and figures outside runs/ are refused."""

from __future__ import annotations

import json
import time

import pytest

from addnorm.lab.core import Context, Experiment, Result
from addnorm.lab.merge import MergeConflictError, merge
from addnorm.lab.runner import run
from tests.lab.lab_fakes import make_registry, opts


def test_shards_merged_equal_the_unsharded_run(tmp_path):
    reg = make_registry({}, n=5)
    whole = run(opts(tmp_path / "whole"), reg)
    for k in (1, 2):
        run(opts(tmp_path / f"s{k}", shard=(k, 2)), reg)
    merged = merge([tmp_path / "s2", tmp_path / "s1"], tmp_path / "merged")
    strip = lambda recs: [{k: r[k] for k in ("name", "verdict", "metrics", "key")} for r in recs]  # noqa: E731
    assert strip(merged.records) == strip(whole.records)
    doc = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert strip(doc["experiments"]) == strip(whole.records)
    for e in doc["experiments"]:
        assert all((tmp_path / "merged" / f).is_file() for f in e["figures"])
    # the merged directory is itself a cache: running there recomputes nothing
    calls: dict[str, int] = {}
    again = run(opts(tmp_path / "merged"), make_registry(calls, n=5))
    assert calls == {} and len(again.reused) == 5


def test_merge_rejects_conflicting_results_and_mismatched_runs(tmp_path):
    reg = make_registry({}, n=2)
    run(opts(tmp_path / "a"), reg)
    run(opts(tmp_path / "b"), reg)
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    doc["experiments"][0]["metrics"]["value"] = -1
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    with pytest.raises(MergeConflictError, match="fake-0.*metrics"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    run(opts(tmp_path / "c", seed=5), reg)
    with pytest.raises(MergeConflictError, match="seed"):
        merge([tmp_path / "a", tmp_path / "c"], tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="results.json"):
        merge([tmp_path / "a", tmp_path / "nothing"], tmp_path / "m")


def test_merge_ignores_timings_and_seconds_but_not_metrics_or_reason(tmp_path):
    def timed(ctx: Context) -> Result:
        return Result(
            verdict="inconclusive", metrics={"v": 1}, reason="control failed", timings={"step_ms": time.perf_counter()}
        )

    reg = {"timed": Experiment(name="timed", claim="c", source="s", run=timed)}
    run(opts(tmp_path / "a", jobs=1), reg)
    run(opts(tmp_path / "b", jobs=1), reg)
    a = json.loads((tmp_path / "a" / "results.json").read_text())["experiments"][0]
    b = json.loads((tmp_path / "b" / "results.json").read_text())["experiments"][0]
    assert a["timings"] != b["timings"]
    merged = merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert merged.records[0]["reason"] == "control failed" and merged.meta["computed_seconds"] is not None
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    doc["experiments"][0]["reason"] = "another reason"
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    with pytest.raises(MergeConflictError, match="timed.*reason"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m2")


@pytest.mark.parametrize(
    "figures, needle", [(["../../secret.png"], "outside"), ([3], "list of file names"), (["/etc/passwd"], "outside")]
)
def test_merge_refuses_figures_outside_the_runs_folder(tmp_path, figures, needle):
    run(opts(tmp_path / "a", jobs=1), make_registry({}, n=1))
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    doc["experiments"][0]["figures"] = figures
    (tmp_path / "a" / "results.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=needle):
        merge([tmp_path / "a"], tmp_path / "m")
    doc["experiments"][0].update(figures=[], verdict="totally")
    (tmp_path / "a" / "results.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="totally"):
        merge([tmp_path / "a"], tmp_path / "m")


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{", "not a readable results file"),
        ("[]", "not an `addnorm lab`"),
        ('{"experiments": [{"x": 1}]}', "not an `addnorm lab`"),
    ],
)
def test_cli_merge_names_a_corrupt_results_file(tmp_path, capsys, content, needle):
    from addnorm.cli import main

    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "results.json").write_text(content)
    assert main(["lab", "merge", str(tmp_path / "shard"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(tmp_path / "shard" / "results.json") in err


@pytest.mark.parametrize("field", ["key", "name"])
def test_merge_refuses_a_record_whose_key_or_name_leaves_out(tmp_path, field):
    """A key like "<key>/../../../evil" made merge copy the cached record outside --out."""
    reg = make_registry({}, n=2)
    run(opts(tmp_path / "a"), reg)
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    doc["experiments"][0][field] = doc["experiments"][0][field] + "/../../../evil"
    (tmp_path / "a" / "results.json").write_text(json.dumps(doc))
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=f"{field} .*evil"):
        merge([tmp_path / "a"], tmp_path / "deep" / "er" / "merged")
    assert sorted(p for p in tmp_path.rglob("*")) == before
