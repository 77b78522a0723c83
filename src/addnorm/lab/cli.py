"""``addnorm lab``: run the stability lab and write its report; ``addnorm lab merge``: combine shard outputs;
``addnorm lab doc``: render a run's results as the Markdown of docs/lab-results.md."""

from __future__ import annotations

import argparse
import json
import os
import sys

_DESCRIPTION = """\
Run the stability lab: small experiments that test published claims about residual connections, norm placement
and normalization numerics on this machine, each with a verdict (reproduced / not reproduced / inconclusive) from
a criterion fixed in its code before it runs. Writes OUT/index.html (one self-contained page), OUT/report.md,
OUT/results.json and the figures. Finished experiments, and the finished tasks of unfinished ones, are cached in
OUT/runs/, so running again is fast and a killed run resumes where it stopped (Ctrl-C exits 130, SIGTERM 143).
The experiments' tasks run on --jobs worker processes; the results are the same for any --jobs or torchrun ranks.

  addnorm lab                        the core suite (the default, --suite core), into addnorm-report/
  addnorm lab --suite all            every experiment: the core suite and the extended one
  addnorm lab --quick                smaller sizes: a smoke run of the installation, into addnorm-report-quick/
  addnorm lab --only ln-vs-rms       one experiment
  addnorm lab --jobs 4               four worker processes (default: one per CPU core)
  addnorm lab --engine batched       train runs of one architecture as one stacked computation: faster, equal
                                     to the default (sequential) engine's numbers up to float rounding
  addnorm lab --shard 1/2 --out a    half of the suite (run 2/2 elsewhere into b), then:
  addnorm lab merge a b --out all    one report from both halves
  addnorm lab doc --output docs/lab-results.md   the results as the repository's Markdown page
  addnorm lab seeds s0 s1 s2 --output docs/lab-seeds.json   record the runs at --seed 0, 1, 2 (s0, s1, s2)
  addnorm lab doc s0 --seed-record docs/lab-seeds.json --output docs/lab-results.md   the pooled verdicts' page
  addnorm lab criteria               every experiment's pre-registered rules, when fixed, and its change log
  torchrun --nproc_per_node 2 -m addnorm lab     the ranks split the tasks; rank 0 writes the report
"""

DEFAULT_OUT = "addnorm-report"
QUICK_OUT = "addnorm-report-quick"  # a smoke run must not overwrite the default-size report


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lab",
        help="run the stability lab experiments and write an HTML/Markdown/JSON report",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list the experiments (name, suite, kind, claim, source) and exit; with --json as JSON",
    )
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these experiments, of either suite (see --list)")
    p.add_argument(
        "--suite",
        choices=("core", "all"),
        default="core",
        help="core (the default): the core suite, 6 min with --jobs 2 on an idle 2-core machine; all: every "
        "experiment, the extended suite included, 8-13 min there (docs/lab.md); --list shows each experiment's "
        "suite",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes: a smoke run that checks the installation, not evidence (its verdicts can "
        "differ from the default sizes'); written to addnorm-report-quick/ unless --out is "
        "given",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory for the report, figures and cache (default: addnorm-report/, or "
        "addnorm-report-quick/ with --quick); one run at a time per directory",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the experiments' tasks, one torch thread each (default: the number of "
        "CPU cores, divided among torchrun ranks on one machine; 1 runs them in this process, or in one worker "
        "under torchrun); the results are the same for any N",
    )
    p.add_argument(
        "--engine",
        choices=("sequential", "batched"),
        default="sequential",
        help="how the training experiments train their runs. sequential (the default): one model per task, "
        "bitwise the same results for any --jobs, cached or not; the recorded results (docs/lab-results.md) use it. "
        "batched: runs of one architecture (seeds, learning rates, warmups) train as one stacked computation, "
        "several times faster per run on a CPU; their numbers equal the sequential ones only up to float rounding, "
        "so a verdict whose numbers sit at its criterion's boundary can differ. Recorded in results.json and the "
        "report header; part of the cache key (docs/lab.md)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="random seed every experiment starts from, 0 <= SEED < 2**32 (default: 0)"
    )
    p.add_argument(
        "--device", default="auto", help="torch device to run on: auto (cuda if present, else cpu), cpu, cuda, cuda:N"
    )
    p.add_argument("--fresh", action="store_true", help="ignore cached results and recompute everything selected")
    p.add_argument(
        "--json",
        action="store_true",
        help="print results.json to stdout at the end (the verdict table then goes to stderr); an error or "
        "interrupt prints one JSON object {error, status: error/interrupted, exit_code} instead",
    )
    p.add_argument(
        "--shard",
        metavar="K/N",
        help="run only part K of N of the selected experiments (a fixed split, K in 1..N); combine the "
        "parts with `addnorm lab merge`",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        default=1,
        help="torch intra-op threads for the run (default 1: the experiments' tensors are tiny, and "
        "threads waiting on each other made the suite several times slower on 2 cores; 0 keeps "
        "torch's own setting; at most the number of CPU cores)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--seed-record",
        metavar="FILE",
        help="a record of runs at other --seed values (`addnorm lab seeds`, e.g. docs/lab-seeds.json): the report "
        "then shows each empirical verdict pooled over every recorded run of the current code and this run, and "
        "says what each rests on; without it every verdict rests on this run alone (and the report says so)",
    )
    p.set_defaults(func=_lab)

    sub = p.add_subparsers(dest="lab_command", metavar="{merge,doc,seeds,criteria}")
    m = sub.add_parser(
        "merge",
        help="combine the output directories of `addnorm lab --shard K/N` runs into one report",
        description="Combine shard output directories into one report. Fails if two directories disagree on an "
        "experiment's result, or were run with different --quick/--seed/--device or addnorm versions.",
    )
    m.add_argument("dirs", nargs="+", metavar="DIR", help="output directories of the shard runs")
    m.add_argument("--out", required=True, metavar="DIR", help="directory for the merged report")
    m.add_argument("--json", action="store_true", help="print the merged results.json to stdout")
    m.set_defaults(func=_merge)

    d = sub.add_parser(
        "doc",
        help="render a run's results.json as the Markdown of docs/lab-results.md",
        description="Render the results of a lab run (OUT/results.json) as Markdown: the machine (CPU, cores), torch "
        "version, date, wall time and --jobs, the empirical verdicts (pooled over the --seed-record's runs of the "
        "current code, with each rule's 95% interval, the per-lab-seed table, the pre-registration and change log; "
        "without a record, this run's alone) with each experiment's summary and per-seed numbers, the sanity "
        "checks and demonstrations apart, and what the seeds say. Prints it, or writes it to --output.",
    )
    d.add_argument(
        "dir",
        nargs="?",
        default=DEFAULT_OUT,
        metavar="OUT",
        help=f"the output directory of an `addnorm lab` run (default: {DEFAULT_OUT}/)",
    )
    d.add_argument("--output", metavar="FILE", help="write the Markdown here (e.g. docs/lab-results.md), not to stdout")
    d.add_argument(
        "--seed-record",
        metavar="FILE",
        help="the record of runs at every lab seed (written by `addnorm lab seeds`, e.g. docs/lab-seeds.json): each "
        "empirical verdict is pooled over every recorded run of the current code (with the rules' 95%% intervals "
        "and a per-lab-seed table), the headline counts the pooled verdicts; experiments whose runs stored no "
        "evidence show the majority of their seeds' verdicts, labelled 'not pooled'. OUT's run counts at its own lab "
        "seed: refused where the record holds a different run of the same code there (another --engine, verdict or "
        "evidence), and --output may not be this file",
    )
    d.set_defaults(func=_doc)

    c = sub.add_parser(
        "criteria",
        help="print every experiment's pre-registration: rules, controls, thresholds, when fixed, change log",
        description="Print the registry of pre-registered criteria: for every experiment its claim, its rules "
        "(claim and positive/negative controls with their thresholds), the date and commit they were fixed, its "
        "config and every change made after a run had been recorded. Experiments without rules show their "
        "criterion text.",
    )
    c.add_argument("--json", action="store_true", help="print it as JSON")
    c.set_defaults(func=_criteria)

    s = sub.add_parser(
        "seeds",
        help="record each empirical verdict of runs at several --seed values (for `lab doc --seed-record`)",
        description="Read the results.json of `addnorm lab` runs made at different --seed values (not --quick) "
        "and write, per empirical experiment and lab seed, the run's evidence (units and rules), verdict, the "
        "experiment's code identity, engine and date, as JSON (version 2; version 1 records are still read). "
        "Refused, naming the file: a seed that is not an integer in [0, 2**32), a run without meta.code or "
        "meta.quick, a date in the future, a run given twice, --output being one of the runs' results.json, --add "
        "with an --output that does not exist (leave out --add to start a new record), and two "
        "runs of the same code at one seed that disagree. The record holds one run per experiment and lab seed: "
        "with --add the runs are added to the existing record in --output, a newer run of other code at the same "
        "seed replaces an older one (the command lists each run it drops), and a run of the same code made with the "
        "other --engine is refused unless --replace. `addnorm lab doc --seed-record FILE` then pools every recorded "
        "run of the current code into one verdict per experiment.",
    )
    s.add_argument("dirs", nargs="+", metavar="DIR", help="output directories of `addnorm lab` runs")
    s.add_argument("--output", required=True, metavar="FILE", help="the record to write (e.g. docs/lab-seeds.json)")
    s.add_argument(
        "--add",
        action="store_true",
        help="add to the record already in --output instead of replacing it (refused when --output does not exist)",
    )
    s.add_argument(
        "--replace",
        action="store_true",
        help="where two runs of the same code at one lab seed were made with different --engine values (the record "
        "or another run given here holds the other), keep the newer one and list the one dropped, instead of "
        "refusing",
    )
    s.set_defaults(func=_seeds)


def _list(as_json: bool = False) -> int:
    from addnorm.lab.runner import load_experiments

    registry = load_experiments()
    if as_json:
        from addnorm.lab.registry import preregistration

        fields = ("name", "suite", "kind", "claim", "source", "criterion", "precondition", "second_stage")
        items = [{**{f: getattr(exp, f, None) for f in fields}, **preregistration(exp)} for exp in registry.values()]
        print(json.dumps(items, indent=2))
        return 0
    width = max((len(n) for n in registry), default=10)
    for name, exp in registry.items():
        print(f"{name:<{width}}  [{exp.suite}, {exp.kind}] {exp.claim}")
        print(f"{'':<{width}}  source: {exp.source}")
        if exp.rules:
            fixed = f", fixed {exp.fixed}" if exp.fixed else ""
            print(f"{'':<{width}}  rules: {len(exp.rules)}{fixed}; changes since: {len(exp.changes)} (lab criteria)")
    return 0


def _criteria(args: argparse.Namespace) -> int:
    from addnorm.lab.registry import criteria_json, criteria_text
    from addnorm.lab.runner import load_experiments

    registry = load_experiments()
    print(json.dumps(criteria_json(registry), indent=2) if args.json else criteria_text(registry))
    return 0


def current_codes() -> dict[str, str]:
    """Each registered empirical experiment's code identity now (what "the current code" is when pooling)."""
    from addnorm.lab.registry import code_identity
    from addnorm.lab.runner import load_experiments

    return {name: code_identity(exp) for name, exp in load_experiments().items() if exp.kind == "empirical"}


def _load_seed_record(path):
    from pathlib import Path

    from addnorm.lab.seed_record import load_record

    return None if path is None else load_record(Path(path))


def _failed(
    args: argparse.Namespace, command: str, message: str, code: int, status: str = "error", lead: str = ""
) -> int:
    """Exit ``code`` with ``message`` on stderr; with --json also one JSON object on stdout (``{"error": MESSAGE,
    "status": "error" | "interrupted", "exit_code": code}``), so a caller that runs json.loads on stdout gets the
    reason rather than an empty string (as ``addnorm doctor --json`` does)."""
    print(f"{lead}{command}: {'error: ' if status == 'error' else ''}{message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "status": status, "exit_code": code}, indent=2), flush=True)
    return code


def _os_message(err: OSError) -> str:
    """``err`` in words, with its own text after it when that says more (not twice when it has no errno)."""
    from addnorm.outpaths import describe_os_error

    described = describe_os_error(err)
    return described if str(err) in described else f"{described} ({err})"


def _finish(doc: dict, as_json: bool) -> None:
    from addnorm.lab.report import terminal_table

    table = terminal_table(doc)
    if as_json:
        print(table, file=sys.stderr)
        print(json.dumps(doc, indent=2))
    else:
        print(table)


def _lab(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args.json)
    from pathlib import Path

    from addnorm.lab.report import load_results
    from addnorm.lab.runner import RunOptions, parse_shard, run

    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    try:
        record = _load_seed_record(args.seed_record)  # before the run: a bad file should not wait for it
        shard = parse_shard(args.shard) if args.shard else None
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        options = RunOptions(
            out=args.out,
            only=args.only,
            quick=args.quick,
            seed=args.seed,
            device=args.device,
            fresh=args.fresh,
            shard=shard,
            progress=not args.no_progress,
            threads=args.threads or None,
            jobs=args.jobs,
            suite=args.suite,
            engine=args.engine,
        )
        summary = run(options)
    except ValueError as err:
        return _failed(args, "addnorm lab", str(err), 2)
    except OSError as err:  # disk full, permissions, ...: finished experiments stay cached
        message = f"cannot write the results into {args.out}: {_os_message(err)}"
        return _failed(args, "addnorm lab", message, 2)
    except KeyboardInterrupt as err:
        # Finished experiments and tasks are already on disk (each written atomically): a pause, not a loss.
        # Ctrl-C exits 130, SIGTERM (a Terminated, interrupt.py) 143: 128 + the signal, as a shell reports it.
        signum = getattr(err, "signum", 2)
        message = (
            f"interrupted{' (SIGTERM)' if signum == 15 else ''}; finished experiments and tasks are "
            f"kept in {Path(args.out) / 'runs'}; run the same command again to resume"
        )
        return _failed(args, "addnorm lab", message, 128 + signum, status="interrupted", lead="\n")
    if int(os.environ.get("RANK", "0") or 0) != 0:  # torchrun: rank 0 reports
        return 1 if summary.failed else 0
    doc = load_results(options.out)
    if record is not None:
        from addnorm.lab.pooled import page_conflicts, pool_record, pooled_headline
        from addnorm.lab.report import write_views

        pooled = pool_record(record, current_codes(), doc)
        write_views(options.out, doc, pooled)
        print(f"pooled with {args.seed_record}: {pooled_headline(pooled)}", file=sys.stderr)
        for line in page_conflicts(record, doc):  # this run counts at its seed, in place of the recorded one
            print(
                f"addnorm lab: warning: {line}; this run is pooled in place of the recorded one "
                f"(`addnorm lab seeds` would refuse to record it without --replace)",
                file=sys.stderr,
            )
    _finish(doc, args.json)
    if not args.json:
        print(f"report: {options.out / 'index.html'}")
    return 1 if summary.failed else 0


def _merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from addnorm.lab.merge import merge
    from addnorm.lab.report import load_results
    from addnorm.outpaths import out_dir

    try:
        out_dir(args.out, create=False)  # before Path("") turns an empty --out into the current folder
        merge([Path(d) for d in args.dirs], Path(args.out))
    except ValueError as err:
        return _failed(args, "addnorm lab merge", str(err), 2)
    except OSError as err:
        return _failed(args, "addnorm lab merge", _os_message(err), 2)
    _finish(load_results(args.out), args.json)
    if not args.json:
        print(f"report: {Path(args.out) / 'index.html'}")
    return 0


def _doc(args: argparse.Namespace) -> int:
    from pathlib import Path

    from addnorm import io
    from addnorm.lab.docs import render_results_doc
    from addnorm.lab.report import read_results
    from addnorm.outpaths import check_distinct, describe_os_error, out_file

    path = Path(args.dir) / "results.json"
    try:
        if args.output is not None:
            out_file(args.output, "--output")
            inputs = [(f"the run's {path}", path)]
            if args.seed_record is not None:  # the page written over the record it pools would lose the record
                inputs.append((f"--seed-record {args.seed_record}", args.seed_record))
            check_distinct([*inputs, ("--output", args.output)])
        if not path.is_file():
            raise ValueError(f"{args.dir} has no results.json: run `addnorm lab --out {args.dir}` first")
        record = _load_seed_record(args.seed_record)
        doc, codes = read_results(path), current_codes() if record is not None else None
        if record is not None:
            _refuse_conflicts(record, doc, path, args.seed_record)
        text = render_results_doc(doc, record, codes)
        if record is not None:
            _warn_stale(record, codes, doc)
        if args.output:
            io.atomic_write_text(Path(args.output), text)
        else:
            sys.stdout.write(text)
    except ValueError as err:
        print(f"addnorm lab doc: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"addnorm lab doc: error: cannot write {args.output}: {describe_os_error(err)}", file=sys.stderr)
        return 2
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _refuse_conflicts(record: dict, doc: dict, path, record_path: str) -> None:
    """``lab doc``: the page pools its own run at its lab seed in place of the record's entry there; refuse where
    those are runs of the same code that differ, so the page never pools a run its record does not hold."""
    from addnorm.lab.pooled import page_conflicts

    conflicts = page_conflicts(record, doc)
    if conflicts:
        raise ValueError(
            f"{path} and --seed-record {record_path} hold different runs of the same code at one lab seed: "
            f"{'; '.join(conflicts)}. The page would pool a run the record does not hold: give `lab doc` the run "
            "the record holds, or record this one first (`addnorm lab seeds RUN --output FILE --add`, with "
            "--replace for another --engine)"
        )


def _warn_stale(record: dict, codes: dict[str, str], doc: dict) -> None:
    """Say on stderr which experiments the record holds no run of the current code for (the code changed since
    the runs), so a page of stale verdicts is not written unnoticed."""
    from addnorm.lab.pooled import pool_record

    pooled = pool_record(record, codes, doc)
    stale = [n for n, p in pooled.items() if p.basis == "run"]
    older = [n for n, p in pooled.items() if p.older and p.basis != "run"]
    if stale:
        print(
            f"addnorm lab doc: warning: no recorded run of the current code for {', '.join(stale)} (their code changed "
            "since the runs): their verdicts rest on the page's run alone; rerun them and `addnorm lab seeds` again",
            file=sys.stderr,
        )
    if older:
        print(f"addnorm lab doc: note: runs of older code listed, not pooled, for {', '.join(older)}", file=sys.stderr)


def _seeds(args: argparse.Namespace) -> int:
    from pathlib import Path

    from addnorm import io
    from addnorm.lab.seed_record import build_record, load_record, run_file
    from addnorm.outpaths import describe_os_error, out_file

    replaced: list[str] = []
    try:
        out_file(args.output, "--output")
        for d in args.dirs:  # `--output s0/results.json` would write the record over the run it reads
            if os.path.realpath(run_file(Path(d))) == os.path.realpath(args.output):
                raise ValueError(
                    f"--output {args.output} is the results.json of the run {d}: writing the record there would "
                    "destroy the run; give the record its own file (e.g. docs/lab-seeds.json)"
                )
        if args.add and not Path(args.output).exists():  # a mistyped path would start a new record silently
            raise ValueError(
                f"--add: there is no record {args.output} to add to (is the path right?); leave out --add to start a "
                "new record there"
            )
        previous = load_record(Path(args.output)) if args.add else None
        record = build_record(
            [Path(d) for d in args.dirs],
            previous,
            replace=args.replace,
            previous_name=f"the record {args.output}",
            replaced=replaced,
        )
        io.atomic_write_text(Path(args.output), json.dumps(record, indent=1) + "\n")
    except ValueError as err:
        print(f"addnorm lab seeds: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"addnorm lab seeds: error: cannot write {args.output}: {describe_os_error(err)}", file=sys.stderr)
        return 2
    for line in replaced:  # never silently: each recorded run this command dropped, and which one it kept
        print(f"addnorm lab seeds: note: {line}", file=sys.stderr)
    flips = [n for n, by_seed in record["experiments"].items() if len({e["verdict"] for e in by_seed.values()}) > 1]
    with_ev = sum(any(e.get("evidence") for e in by_seed.values()) for by_seed in record["experiments"].values())
    print(
        f"wrote {args.output}: {len(record['experiments'])} experiments ({with_ev} with evidence to pool, the others "
        "verdicts only)" + (f"; verdicts that flip with --seed: {', '.join(flips)}" if flips else "; no verdict flips"),
        file=sys.stderr,
    )
    return 0
