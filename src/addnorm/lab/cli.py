"""``addnorm lab``: run the stability lab and write its report; ``addnorm lab merge``: combine shard outputs."""

from __future__ import annotations

import argparse
import json
import sys

_DESCRIPTION = """\
Run the stability lab: small experiments that test published claims about residual connections, norm placement
and normalization numerics on this machine, each with a verdict (reproduced / not reproduced / inconclusive) from
a criterion fixed in its code before it runs. Writes OUT/index.html (one self-contained page), OUT/report.md,
OUT/results.json and the figures. Finished experiments are cached in OUT/runs/, so running again is fast and a
killed run resumes where it stopped.

  addnorm lab                        the default suite
  addnorm lab --quick                smaller sizes, for a first look
  addnorm lab --only ln-vs-rms       one experiment
  addnorm lab --shard 1/2 --out a    half of the suite (run 2/2 elsewhere into b), then:
  addnorm lab merge a b --out all    one report from both halves
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lab", help="run the stability lab experiments and write an HTML/Markdown/JSON report",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the experiments (name, claim, source) and exit")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these experiments (see --list)")
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes, for a first look: about 4x faster (about 40 s instead of about 3 minutes on 2 "
                        "CPU cores); cached apart from the default-size results")  # fmt: skip
    p.add_argument("--out", default="addnorm-report", metavar="DIR",
                   help="output directory for the report, figures and cache (default: addnorm-report/)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0,
                   help="random seed every experiment starts from, 0 <= SEED < 2**32 (default: 0)")  # fmt: skip
    p.add_argument("--device", default="auto",
                   help="torch device to run on: auto (cuda if present, else cpu), cpu, cuda, cuda:N")  # fmt: skip
    p.add_argument("--fresh", action="store_true", help="ignore cached results and recompute everything selected")
    p.add_argument("--json", action="store_true",
                   help="print results.json to stdout at the end (the verdict table then goes to stderr)")  # fmt: skip
    p.add_argument("--shard", metavar="K/N",
                   help="run only part K of N of the selected experiments (a fixed split, K in 1..N); combine the "
                        "parts with `addnorm lab merge`")  # fmt: skip
    p.add_argument("--threads", type=int, metavar="N", default=1,
                   help="torch intra-op threads for the run (default 1: the experiments' tensors are tiny, and "
                        "threads waiting on each other made the suite several times slower on 2 cores; 0 keeps "
                        "torch's own setting)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_lab)

    sub = p.add_subparsers(dest="lab_command", metavar="merge")
    m = sub.add_parser(
        "merge", help="combine the output directories of `addnorm lab --shard K/N` runs into one report",
        description="Combine shard output directories into one report. Fails if two directories disagree on an "
                    "experiment's result, or were run with different --quick/--seed/--device or addnorm versions.",
    )  # fmt: skip
    m.add_argument("dirs", nargs="+", metavar="DIR", help="output directories of the shard runs")
    m.add_argument("--out", required=True, metavar="DIR", help="directory for the merged report")
    m.add_argument("--json", action="store_true", help="print the merged results.json to stdout")
    m.set_defaults(func=_merge)


def _list() -> int:
    from addnorm.lab.runner import load_experiments

    registry = load_experiments()
    width = max((len(n) for n in registry), default=10)
    for name, exp in registry.items():
        print(f"{name:<{width}}  {exp.claim}")
        print(f"{'':<{width}}  source: {exp.source}")
    return 0


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
        return _list()
    from pathlib import Path

    from addnorm.lab.report import load_results
    from addnorm.lab.runner import RunOptions, parse_shard, run

    try:
        shard = parse_shard(args.shard) if args.shard else None
        options = RunOptions(out=args.out, only=args.only, quick=args.quick, seed=args.seed, device=args.device,
                             fresh=args.fresh, shard=shard, progress=not args.no_progress,
                             threads=args.threads or None)  # fmt: skip
        summary = run(options)
    except ValueError as err:
        print(f"addnorm lab: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, permissions, ...: finished experiments stay cached
        print(f"addnorm lab: error: cannot write the results into {args.out}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Finished experiments are already on disk (each written atomically), so this is a pause, not a loss.
        print(f"\naddnorm lab: interrupted; finished experiments are kept in {Path(args.out) / 'runs'}; run the same "
              "command again to resume", file=sys.stderr)  # fmt: skip
        return 130
    _finish(load_results(options.out), args.json)
    if not args.json:
        print(f"report: {options.out / 'index.html'}")
    return 1 if summary.failed else 0


def _merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from addnorm.lab.report import load_results
    from addnorm.lab.runner import merge

    try:
        merge([Path(d) for d in args.dirs], Path(args.out))
    except (ValueError, OSError) as err:
        print(f"addnorm lab merge: error: {err}", file=sys.stderr)
        return 2
    _finish(load_results(args.out), args.json)
    if not args.json:
        print(f"report: {Path(args.out) / 'index.html'}")
    return 0
