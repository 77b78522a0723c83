"""The lab runner: cache, resume after a kill, atomic writes, shard + merge, report content, CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from addnorm.lab import cache, outdir, runner
from addnorm.lab.core import Context, Experiment, Result, verdict_from
from addnorm.lab.merge import MergeConflictError, merge
from addnorm.lab.report import render_html, terminal_table
from addnorm.lab.runner import RunOptions, atomic_write_text, parse_shard, run, select

# A 1x1 PNG, so fake experiments can emit a figure without matplotlib.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5f6a1d50000000049454e44ae426082"
)


def make_registry(calls: dict[str, int], *, fail: set[str] = frozenset(), n: int = 4) -> dict[str, Experiment]:
    """Fake experiments that count their calls; their metrics depend on the seed and quick so caching is visible."""

    def make(name: str):
        def fn(ctx: Context) -> Result:
            calls[name] = calls.get(name, 0) + 1
            if name in fail:
                raise RuntimeError(f"{name} broke")
            ctx.figure_path("fig.png").write_bytes(PNG)
            value = ctx.seed * 10 + len(name) + (0.5 if ctx.quick else 0) + ctx.config["offset"]
            return Result(
                verdict=verdict_from(value > 3),
                metrics={"value": value, "criterion": "value > 3"},
                figures=["fig.png"],
                summary=f"value {value}",
            )

        return fn

    reg = {}
    for i in range(n):
        name = f"fake-{i}"
        reg[name] = Experiment(name=name, claim=f"claim {i}", source="test", run=make(name), config={"offset": i})
    return reg


def opts(out: Path, **kw) -> RunOptions:
    return RunOptions(out=out, progress=False, device="cpu", **kw)


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


def test_threads_option_applies_during_the_run_and_is_restored(tmp_path):
    seen = []
    reg = {
        "t": Experiment(
            name="t",
            claim="c",
            source="s",
            run=lambda ctx: seen.append(torch.get_num_threads()) or Result(verdict="reproduced", metrics={}),
        )
    }
    before = torch.get_num_threads()
    s = run(opts(tmp_path, threads=1), reg)
    assert seen == [1] and s.meta["torch_threads"] == 1 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        RunOptions(threads=0)


def test_failing_experiment_is_inconclusive_not_cached_and_the_run_continues(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, fail={"fake-1"})
    s = run(opts(tmp_path), reg)
    rec = {r["name"]: r for r in s.records}
    assert rec["fake-1"]["verdict"] == "inconclusive" and "fake-1 broke" in rec["fake-1"]["error"]
    assert s.failed == ["fake-1"] and rec["fake-2"]["verdict"] in ("reproduced", "not reproduced")
    run(opts(tmp_path), reg)
    assert calls["fake-1"] == 2 and calls["fake-0"] == 1  # retried; the others reused


def test_keyboard_interrupt_keeps_finished_results_and_rerun_resumes(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls)
    stop = {"on": True}
    inner = reg["fake-2"].run

    def interrupted(ctx):
        if stop["on"]:
            raise KeyboardInterrupt
        return inner(ctx)

    reg["fake-2"].run = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(opts(tmp_path), reg)
    stop["on"] = False
    s = run(opts(tmp_path), reg)
    assert sorted(s.reused) == ["fake-0", "fake-1"] and s.ran == ["fake-2", "fake-3"]
    assert calls == {"fake-0": 1, "fake-1": 1, "fake-2": 1, "fake-3": 1}


RESUME_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from addnorm.lab.core import Experiment, Result

    COUNT = Path(os.environ["LAB_COUNT_DIR"])

    def make(name):
        def fn(ctx):
            (COUNT / name).write_text(str(int((COUNT / name).read_text()) + 1 if (COUNT / name).exists() else 1))
            if name == "b" and os.environ.get("LAB_DIE") == "1":
                os._exit(3)  # killed midway: no cleanup, no exception handling
            return Result(verdict="reproduced", metrics={"name": name})
        return fn

    REGISTRY = {n: Experiment(name=n, claim="c", source="s", run=make(n)) for n in ("a", "b", "c")}

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu"), REGISTRY)
    """
)


def test_run_killed_by_os_exit_in_a_subprocess_resumes(tmp_path, monkeypatch):
    script = tmp_path / "lab_resume_script.py"
    script.write_text(RESUME_SCRIPT)
    counts, out = tmp_path / "counts", tmp_path / "out"
    counts.mkdir()
    env = dict(os.environ, LAB_COUNT_DIR=str(counts), LAB_DIE="1")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert len(list((out / "runs").glob("a-*/result.json"))) == 1
    assert not list((out / "runs").glob("b-*/result.json"))

    import importlib.util

    monkeypatch.setenv("LAB_COUNT_DIR", str(counts))
    monkeypatch.setenv("LAB_DIE", "0")
    spec = importlib.util.spec_from_file_location("lab_resume_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = run(opts(out), mod.REGISTRY)
    assert s.reused == ["a"] and s.ran == ["b", "c"]
    assert {p.name: p.read_text() for p in counts.iterdir()} == {"a": "1", "b": "2", "c": "1"}


def test_atomic_write_leaves_the_old_file_when_replace_fails(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    atomic_write_text(target, "old")

    def boom(src, dst):
        raise OSError("disk full")

    import addnorm.io

    monkeypatch.setattr(addnorm.io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left behind


def test_record_is_written_last_so_a_partial_run_dir_is_not_a_cache_hit(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=1)
    s = run(opts(tmp_path), reg)
    rec_file = next((tmp_path / "runs").glob("fake-0-*/result.json"))
    rec_file.write_text(rec_file.read_text()[:20])  # a torn write (what atomic writes prevent)
    run(opts(tmp_path), reg)
    assert calls["fake-0"] == 2 and json.loads(rec_file.read_text())["key"] == s.records[0]["key"]


def test_report_files_schema_and_self_contained_html(tmp_path):
    reg = make_registry({}, fail={"fake-3"})
    run(opts(tmp_path, quick=True, seed=2), reg)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [e["name"] for e in doc["experiments"]] == list(reg)
    for e in doc["experiments"]:
        assert {"name", "claim", "source", "verdict", "metrics", "figures"} <= set(e)
        assert e["verdict"] in ("reproduced", "not reproduced", "inconclusive")
        for f in e["figures"]:
            assert (tmp_path / f).read_bytes() == PNG
    assert doc["meta"]["quick"] is True and doc["meta"]["seed"] == 2 and doc["meta"]["addnorm"]
    assert doc["meta"]["torch"] and doc["meta"]["date"]
    assert sum(doc["counts"].values()) == len(reg)
    page = (tmp_path / "index.html").read_text()
    for name in reg:
        assert f'id="{name}"' in page and f"claim {name[-1]}" in page
    assert page.count("data:image/png;base64,") == 3  # the failed one has none
    assert "http://" not in page and "https://" not in page
    assert "fake-3 broke" in page and "quick" in page
    md = (tmp_path / "report.md").read_text()
    assert all(f"## {name}" in md for name in reg) and "![fig](runs/" in md
    table = terminal_table(doc)
    assert all(name in table for name in reg) and "RuntimeError: fake-3 broke" in table


def test_html_escapes_text(tmp_path):
    doc = {
        "experiments": [
            {
                "name": "x",
                "claim": "<script>alert(1)</script>",
                "source": "s",
                "verdict": "reproduced",
                "metrics": {"a<b": 1.0},
                "figures": [],
            }
        ],
        "meta": {},
        "counts": {},
    }
    page = render_html(doc, tmp_path)
    assert "<script>" not in page and "&lt;script&gt;" in page and "a&lt;b" in page


@pytest.mark.skipif(
    not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
    reason="no headless browser installed",
)
def test_page_renders_in_a_headless_browser(tmp_path):
    reg = make_registry({}, n=2)
    run(opts(tmp_path), reg)
    browser = next(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b))
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (tmp_path / "index.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert all(f'id="{n}"' in proc.stdout for n in reg) and "data:image/png;base64," in proc.stdout


def test_shard_split_is_a_partition_in_order():
    reg = make_registry({}, n=5)
    parts = [select(None, (k, 3), reg) for k in (1, 2, 3)]
    indices = sorted(i for p in parts for i, _ in p)
    assert indices == list(range(5))
    assert [e.name for _, e in parts[0]] == ["fake-0", "fake-3"]
    assert [e.name for _, e in select(["fake-4", "fake-1"], None, reg)] == ["fake-1", "fake-4"]  # registry order
    with pytest.raises(ValueError, match="unknown experiment"):
        select(["nope"], None, reg)
    for bad in ("0/2", "3/2", "a/b", "2", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


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


# ----------------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def fake_cli(monkeypatch):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=3)
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    return calls


def test_cli_run_json_shard_and_merge(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main(["lab", "--out", str(tmp_path / "w"), "--no-progress", "--device", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [e["name"] for e in doc["experiments"]] == ["fake-0", "fake-1", "fake-2"]
    assert "fake-0" in err and "reproduced" in err  # the verdict table goes to stderr with --json
    for k in (1, 2):
        assert (
            main(["lab", "--shard", f"{k}/2", "--out", str(tmp_path / f"s{k}"), "--no-progress", "--device", "cpu"])
            == 0
        )
    capsys.readouterr()
    assert main(["lab", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "fake-2" in out and "index.html" in out
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [e["metrics"] for e in merged["experiments"]] == [e["metrics"] for e in doc["experiments"]]
    assert fake_cli == {"fake-0": 2, "fake-1": 2, "fake-2": 2}  # once whole, once in its shard


def test_cli_only_and_errors(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main(["lab", "--only", "fake-1", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    assert fake_cli == {"fake-1": 1}
    assert "fake-1" in capsys.readouterr().out
    assert main(["lab", "--only", "nope", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "unknown experiment" in capsys.readouterr().err
    assert main(["lab", "--shard", "3/2", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "shard" in capsys.readouterr().err
    assert main(["lab", "merge", str(tmp_path / "none"), "--out", str(tmp_path / "m")]) == 2
    for seed in ("-5", str(2**64)):  # numpy refuses negative seeds, torch overflows: fail before running anything
        assert main(["lab", "--seed", seed, "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
        assert "--seed" in capsys.readouterr().err
    assert main(["lab", "--device", "bogus", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["lab", "--device", "cuda", "--out", str(tmp_path), "--no-progress"]) == 2
        assert "cuda" in capsys.readouterr().err
    assert fake_cli == {"fake-1": 1}  # bad arguments ran nothing


def test_cli_list_names_every_registered_experiment(capsys):
    from addnorm.cli import main
    from addnorm.lab.core import EXPERIMENTS

    assert main(["lab", "--list"]) == 0
    out = capsys.readouterr().out
    mine = [
        "residual-gradient-flow",
        "xiong-init-gradients",
        "deepnet-update-size",
        "admin-output-change",
        "ln-vs-rms",
        "half-precision-stats",
        "batchnorm-vs-layernorm",
        "residual-stream-growth",
    ]
    for name in set(mine) | set(EXPERIMENTS):
        assert name in out
        assert EXPERIMENTS[name].claim[:30] in out


def test_cli_help_explains_every_flag(capsys):
    from addnorm.cli import main

    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--list",
        "--only",
        "--quick",
        "--out",
        "--seed",
        "--device",
        "--fresh",
        "--json",
        "--shard",
        "--threads",
        "--jobs",
        "torchrun",
        "addnorm-report-quick",
        "doc",
    ):
        assert flag in text
    with pytest.raises(SystemExit):
        main(["lab", "merge", "--help"])
    assert "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["lab", "doc", "--help"])
    assert "--output" in capsys.readouterr().out


def test_cli_out_that_is_a_file_is_an_error_naming_out(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    a_file = tmp_path / "report.txt"
    a_file.write_text("not a directory")
    assert main(["lab", "--out", str(a_file), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err and "Traceback" not in err
    assert main(["lab", "--out", str(a_file / "sub"), "--no-progress", "--device", "cpu"]) == 2
    assert "--out" in capsys.readouterr().err
    assert fake_cli == {}  # nothing ran
    assert main(["lab", "--out", str(tmp_path / "ok"), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["lab", "merge", str(tmp_path / "ok"), "--out", str(a_file)]) == 2
    assert "--out" in capsys.readouterr().err


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


def test_cli_ctrl_c_exits_130_with_a_resume_hint_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    from addnorm.cli import main

    calls: dict[str, int] = {}
    reg = make_registry(calls, n=3)
    inner = reg["fake-1"].run

    def interrupted_once(ctx):
        if "stopped" not in calls:
            calls["stopped"] = 1
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return inner(ctx)

    reg["fake-1"].run = interrupted_once
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    argv = ["lab", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "again to resume" in err and str(tmp_path / "runs") in err
    assert main(argv) == 0
    assert calls == {"fake-0": 1, "stopped": 1, "fake-1": 1, "fake-2": 1}  # fake-0 came from the cache


def test_results_are_strict_json_with_non_finite_values_kept_as_strings(tmp_path, capsys, monkeypatch):
    """An fp16 overflow (inf) is a result: stored as "inf", because Infinity/NaN literals are not JSON (jq rejects
    them) and `addnorm lab --json` output must parse anywhere."""
    from addnorm.cli import main

    def overflow(ctx: Context) -> Result:
        return Result(
            verdict="reproduced",
            summary="inf",
            metrics={"var": float("inf"), "pair": [float("nan"), 1.5], "t": torch.tensor([-math.inf])},
        )

    reg = {"overflow": Experiment(name="overflow", claim="c", source="s", run=overflow)}
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)

    def no_constants(name):
        raise AssertionError(f"non-standard JSON literal {name}")

    for attempt in range(2):  # computed, then from the cache
        assert main(["lab", "--out", str(tmp_path), "--no-progress", "--device", "cpu", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out, parse_constant=no_constants)
        json.loads((tmp_path / "results.json").read_text(), parse_constant=no_constants)
        assert doc["experiments"][0]["metrics"] == {"var": "inf", "pair": ["nan", 1.5], "t": ["-inf"]}
        assert doc["experiments"][0]["cached"] is bool(attempt)
    assert '<td class="v">inf</td>' in (tmp_path / "index.html").read_text()


def test_a_cuda_index_beyond_the_devices_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runner.resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="cuda:3.*1 CUDA device"):
        runner.resolve_device("cuda:3")


def test_cli_disk_full_is_an_error_message(tmp_path, fake_cli, capsys, monkeypatch):
    import errno

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    import addnorm.io

    monkeypatch.setattr(addnorm.io, "atomic_write_text", full)
    monkeypatch.setattr(addnorm.io, "atomic_write", lambda path, write, binary: full(path, ""))
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the results" in err and "No space left" in err and "Traceback" not in err


def main_lab(argv):
    from addnorm.cli import main

    return main(["lab", *argv])


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


# ------------------------------------------------------------------------------------------ one run per --out
def test_a_second_run_on_a_locked_out_is_refused_with_a_message(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    with outdir.out_lock(tmp_path):  # what a run in progress holds
        assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "in use by another `addnorm lab` run" in err and f"pid {os.getpid()}" in err
        assert "Traceback" not in err
        assert main(["lab", "merge", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert fake_cli == {}
    # a lock file left by a killed run does not block: flock locks die with their process
    assert (tmp_path / ".lock").exists()
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0


SLOW_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from addnorm.lab.core import Experiment, Result

    def slow(ctx):
        Path(sys.argv[2]).write_text("started")
        time.sleep(float(sys.argv[3]))
        ctx.figure_path("f.png").write_bytes(b"png")
        return Result(verdict="reproduced", metrics={"v": 1}, figures=["f.png"])

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        reg = {"slow": Experiment(name="slow", claim="c", source="s", run=slow)}
        run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu", jobs=1), reg)
    """
)


def test_two_concurrent_runs_on_one_out_the_second_is_refused_and_the_first_completes(tmp_path, fake_cli, capsys):
    script, started, out = tmp_path / "slow_lab.py", tmp_path / "started", tmp_path / "out"
    script.write_text(SLOW_SCRIPT)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(runner.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    first = subprocess.Popen(
        [sys.executable, str(script), str(out), str(started), "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        assert main_lab(["--out", str(out), "--no-progress", "--device", "cpu"]) == 2
        assert "in use by another `addnorm lab` run" in capsys.readouterr().err
    finally:
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    doc = json.loads((out / "results.json").read_text())
    assert [e["name"] for e in doc["experiments"]] == ["slow"]
    assert all((out / f).is_file() for e in doc["experiments"] for f in e["figures"])
    assert fake_cli == {}


# ------------------------------------------------------------------------------------------------- merge
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


# ---------------------------------------------------------------------------------------- --jobs, --quick, doc
def test_cli_jobs_flag_is_validated_and_recorded(tmp_path, fake_cli, capsys):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err and fake_cli == {}
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--jobs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["jobs"] == 1
    with pytest.raises(ValueError, match="jobs"):
        RunOptions(jobs=0)


def test_cli_quick_writes_to_its_own_folder_and_says_it_is_a_smoke_run(tmp_path, fake_cli, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main_lab(["--quick", "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "addnorm-report-quick" / "results.json").is_file()
    assert not (tmp_path / "addnorm-report").exists()
    assert "smoke run" in out and "not evidence" in out
    for name in ("index.html", "report.md"):
        assert (
            "smoke run for checking the installation, not evidence"
            in (tmp_path / "addnorm-report-quick" / name).read_text()
        )
    assert main_lab(["--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    assert (tmp_path / "addnorm-report" / "results.json").is_file()
    assert "smoke run" not in capsys.readouterr().out
    assert "smoke run" not in (tmp_path / "addnorm-report" / "report.md").read_text()
    assert main_lab(["--quick", "--out", "mine", "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    assert (tmp_path / "mine" / "results.json").is_file()


def test_cli_doc_renders_a_run_and_names_what_is_missing(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main_lab(["--out", str(tmp_path / "r"), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    capsys.readouterr()
    assert main(["lab", "doc", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Stability lab results") and "fake-2" in text and "--jobs 1" in text
    target = tmp_path / "docs" / "lab-results.md"
    assert main(["lab", "doc", str(tmp_path / "r"), "--output", str(target)]) == 0
    assert target.read_text() == text and oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert main(["lab", "doc", str(tmp_path / "none")]) == 2
    assert "has no results.json" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("[]")
    assert main(["lab", "doc", str(tmp_path / "bad")]) == 2
    assert "not an `addnorm lab` results file" in capsys.readouterr().err
    assert main(["lab", "doc", str(tmp_path / "r"), "--output", str(tmp_path)]) == 2
    assert "--output" in capsys.readouterr().err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
