"""The lab's result cache: a finished experiment is reused while its key (seed, quick, config, the library's code,
torch) matches, and a stored record that is torn, of the wrong shape or missing a figure is recomputed."""

from __future__ import annotations

import json

import pytest
import torch

from addnorm.lab import cache
from addnorm.lab.merge import MergeConflictError, merge
from addnorm.lab.runner import run
from tests.lab.lab_fakes import make_registry, opts


def test_second_run_reuses_cached_results_without_recomputing(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls)
    first = run(opts(tmp_path), reg)
    assert sorted(first.ran) == sorted(reg) and first.reused == []
    second = run(opts(tmp_path), reg)
    assert second.ran == [] and sorted(second.reused) == sorted(reg)
    assert all(c == 1 for c in calls.values())
    assert [r["metrics"] for r in first.records] == [r["metrics"] for r in second.records]
    assert all(r["cached"] for r in second.records)


def test_cache_key_changes_with_seed_quick_config_and_fresh_recomputes(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    run(opts(tmp_path), reg)
    run(opts(tmp_path, seed=1), reg)
    run(opts(tmp_path, quick=True), reg)
    assert calls["fake-0"] == 3
    reg["fake-0"].config["offset"] = 7  # a config change is a different result
    run(opts(tmp_path), reg)
    run(opts(tmp_path, fresh=True), reg)
    assert calls["fake-0"] == 5
    run(opts(tmp_path), reg)
    assert calls["fake-0"] == 5


def test_a_change_anywhere_in_the_library_invalidates_cached_results(tmp_path, monkeypatch):
    """Experiments run the library (models, norms, loop): a fixed bug there must not leave old verdicts cached."""
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    run(opts(tmp_path / "a"), reg)
    run(opts(tmp_path / "a"), reg)
    assert calls["fake-0"] == 1
    digest = cache.package_digest()
    assert len(digest) == 12 and cache.code_version(reg["fake-0"]).split("+")[1] == digest
    monkeypatch.setattr(cache, "package_digest", lambda: "edited-lib")  # what editing e.g. nn/norms.py does
    run(opts(tmp_path / "a"), reg)
    assert calls["fake-0"] == 2
    monkeypatch.setattr(torch, "__version__", "0.0.1")  # another torch: the header would misattribute old results
    run(opts(tmp_path / "a"), reg)
    assert calls["fake-0"] == 3
    run(opts(tmp_path / "b"), reg)  # a shard made with the edited library does not merge with one made before it
    monkeypatch.setattr(cache, "package_digest", lambda: digest)
    run(opts(tmp_path / "c"), reg)
    with pytest.raises(MergeConflictError, match="code"):
        merge([tmp_path / "b", tmp_path / "c"], tmp_path / "m")


def test_missing_figure_invalidates_the_cached_result(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    s = run(opts(tmp_path), reg)
    (tmp_path / s.records[0]["figures"][0]).unlink()
    run(opts(tmp_path), reg)
    assert calls["fake-0"] == 2


def test_record_is_written_last_so_a_partial_run_dir_is_not_a_cache_hit(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    s = run(opts(tmp_path), reg)
    rec_file = next((tmp_path / "runs").glob("fake-0-*/result.json"))
    rec_file.write_text(rec_file.read_text()[:20])  # a torn write (what atomic writes prevent)
    run(opts(tmp_path), reg)
    assert calls["fake-0"] == 2 and json.loads(rec_file.read_text())["key"] == s.records[0]["key"]


# ------------------------------------------------------------------------------ cache records of the wrong shape
def _record_edits():
    def drop(field):
        return lambda r: {k: v for k, v in r.items() if k != field}

    def put(field, value):
        return lambda r: dict(r, **{field: value})

    return {
        "list": lambda r: [],
        "null": lambda r: None,
        "number": lambda r: 42,
        "string": lambda r: "record",
        "figures=5": put("figures", 5),
        "figures=[null]": put("figures", [None]),
        "figures outside": put("figures", ["runs/../../../etc/passwd"]),
        "figures absolute": put("figures", ["/x"]),
        "verdict=42": put("verdict", 42),
        "verdict=totally": put("verdict", "totally"),
        "metrics=oops": put("metrics", "oops"),
        "metrics=null": put("metrics", None),
        "no verdict": drop("verdict"),
        "no metrics": drop("metrics"),
        "no figures": drop("figures"),
        "no key": drop("key"),
        "another name": put("name", "fake-9"),
        "seconds=x": put("seconds", "x"),
        "seconds=-1": put("seconds", -1),
        "timings=[]": put("timings", []),
        "summary=7": put("summary", 7),
        "reason=[]": put("reason", []),
        "kind=bogus": put("kind", "bogus"),
        "an error": put("error", "RuntimeError: x"),
    }


@pytest.mark.parametrize("edit", list(_record_edits()))
def test_a_cache_record_of_the_wrong_shape_is_recomputed_not_a_traceback(tmp_path, edit):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    first = run(opts(tmp_path, jobs=1), reg)
    rec_file = next((tmp_path / "runs").glob("fake-0-*/result.json"))
    record = json.loads(rec_file.read_text())
    rec_file.write_text(json.dumps(_record_edits()[edit](record)))
    second = run(opts(tmp_path, jobs=1), reg)
    assert calls["fake-0"] == 2 and second.ran == ["fake-0"]
    assert second.records[0]["verdict"] == first.records[0]["verdict"]
    assert json.loads(rec_file.read_text())["figures"] == record["figures"]  # rewritten whole


def test_the_unedited_record_is_a_cache_hit_so_the_shape_checks_accept_real_records(tmp_path):
    reg = make_registry({}, n=1)
    run(opts(tmp_path, jobs=1), reg)
    rec_file = next((tmp_path / "runs").glob("fake-0-*/result.json"))
    record = json.loads(rec_file.read_text())
    assert cache.valid_record(record, name="fake-0", key=record["key"])
    assert not cache.valid_record(record, name="fake-0", key="other")
