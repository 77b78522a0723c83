"""bench_generate.py's report of the paired loop: its rows (each variant against the unpatched model, per phase, by
both clocks), the verdicts of the fused model, and their markdown."""

from __future__ import annotations

import statistics

import generate_stats

CONTROL = "unpatched copy"  # --control: a second unpatched model in the paired loop
CLOCK_NAMES = {"thread": "thread CPU time", "wall": "wall clock"}


def paired_rows(case: dict, loop: dict, prof: dict, clock: str, generated) -> tuple[list[dict], list[dict]]:
    """The paired loop's rows (each variant against the unpatched model, per phase, both clocks) and the verdict
    of the fused model per phase; ``generated`` is the unpatched generate()'s output, which the loop must repeat."""
    import torch

    ref = loop["tokens"]["unpatched"][0]
    width = min(ref.shape[1], generated.shape[1])
    like_generate = torch.equal(ref[:, :width], generated[:, :width])
    rows, verdicts = [], []
    for phase in ("prefill", "decode"):
        times = loop[phase]
        for n in list(loop["decode"])[1:]:  # fused, norms (and the control)
            row = dict(**case, phase=phase, variant=n, clock=clock, like_generate=like_generate)
            # every variant is fed the unpatched model's tokens (generate_steps.Decoder.step): what is compared is
            # its own greedy pick at each step, on the same inputs
            agree, fed = (sum(x) for x in zip(*loop["agreement"][n]))
            row["same_tokens"], row["agree"] = agree == fed, [agree, fed]
            for c, i in (("wall", 0), ("thread", 1)):
                if phase == "prefill":  # one prefill a round: groups of one
                    base, mine = ([[t[i]] for t in times[v]] for v in ("unpatched", n))
                else:
                    base, mine = ([[t[i] for t in r] for r in times[v]] for v in ("unpatched", n))
                row[c] = generate_stats.summarize(base, mine)
                row[c]["ms"] = statistics.median(x for r in mine for x in r) * 1e3
                row[c]["baseline_ms"] = statistics.median(x for r in base for x in r) * 1e3
            rows.append(row)
        fused = next(r for r in rows if r["phase"] == phase and r["variant"] == "fused")
        control = [r[clock] for r in rows if r["phase"] == phase and r["variant"] == CONTROL]
        p = prof[phase]
        v = generate_stats.verdict(fused[clock], generate_stats.target(phase, case["dtype"]), p["share"], p["cost"])
        # the A/A pair: two identical models whose interval misses 1.00x mean this run resolves less than it claims
        v["control"] = None if not control else (control[0]["lo"] <= 1.0 <= control[0]["hi"])
        verdicts.append(dict(**case, phase=phase, variant="fused", clock=clock, **fused[clock], **v))
    return rows, verdicts


def paired_markdown(result: dict) -> str:
    """The paired steps' table, the profile of both phases and the verdicts."""
    a, clock = result["args"], result["clock"]
    lines = [
        f"Paired steps ({a['rounds']} rounds, each with new copies of the models, a prefill and "
        f"{a['steps'] or a['new'] - 1} decode steps of every variant, every variant fed the unpatched model's "
        "greedy tokens (so all see the same inputs; 'same greedy picks' counts the steps at which its own pick was "
        "the same), the variants taking turns at every step, order "
        + (f"rotated; the weights moved to new memory every {a['block']} steps" if a["block"] else "rotated")
        + "): median of the per-step "
        "ratios (unpatched time / variant time) with a bootstrap 95% interval (blocks of steps resampled whole; a "
        "prefill is a block of one), the lowest and highest median of one block, and the lag-1 autocorrelation of "
        f"the log ratios. The verdicts use the {CLOCK_NAMES[clock['name']]}: {clock['why']}."
        + (f" `{CONTROL}` is a second unpatched model: its interval should hold 1.000x." if a["control"] else ""),
        "",
        "| model | batch | dtype | phase | variant | ms, unpatched / variant | thread CPU: x unpatched [95%] | "
        "wall: x unpatched [95%] | blocks x pairs | one block's median | lag-1 | same greedy picks |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["paired"]:
        c, t, w = r[r["clock"]], r["thread"], r["wall"]
        agree, fed = r["agree"]
        same = "yes" if r["same_tokens"] else f"{agree}/{fed} steps"
        same = same if r["like_generate"] else "NO (loop)"
        lo, hi = c["group_range"]
        lines.append(
            f"| {r['family']} | {r['batch']} | {r['dtype']} | {r['phase']} | {r['variant']} | "
            f"{c['baseline_ms']:.2f} / {c['ms']:.2f} | {t['ratio']:.3f}x [{t['lo']:.3f}, {t['hi']:.3f}] | "
            f"{w['ratio']:.3f}x [{w['lo']:.3f}, {w['hi']:.3f}] | {c['groups']} x {c['pairs'] / c['groups']:.3g} | "
            f"{lo:.3f}-{hi:.3f} | {c['autocorr']:.2f} | {same} |"
        )
    lines += [
        "",
        "Where the time goes (unpatched and fused models, hooks around the norm modules; adds timed alone):",
        "",
    ]
    for p in result["profiles"]:
        lines.append(
            f"- {p['family']} batch {p['batch']} {p['dtype']} {p['phase']}: norms {100 * p['norm_share']:.1f}% + "
            f"residual adds {100 * p['add_share']:.1f}% of a {1e3 * p['step_s']:.2f} ms unpatched step "
            f"({p['norm_modules']} norm modules); the fused model does that work in {p['cost']:.2f}x the time "
            f"({p['fused_calls']} norm calls take the residual add)"
        )
    other = [max(0.0, 1 - c["thread_cpu_s"] / c["process_cpu_s"]) for c in result["loop_cpu"] if c["process_cpu_s"]]
    if other:  # the thread clock counts only the calling thread: this shows it did (nearly) all the work
        lines.append(
            f"- during the paired loops, threads other than the timing one used {100 * min(other):.1f}-"
            f"{100 * max(other):.1f}% of the process's CPU time"
        )
    lines += ["", "Verdicts (the fused model, `hf.apply`, against issue 25's done-when):", ""]
    for v in result["verdicts"]:
        lines.append(
            f"- {v['family']} batch {v['batch']} {v['dtype']} {v['phase']}: {v['ratio']:.3f}x "
            f"[{v['lo']:.3f}, {v['hi']:.3f}] ({CLOCK_NAMES[v['clock']]}, {v['pairs']} pairs); "
            + generate_stats.verdict_text(v)
        )
    return "\n".join(lines)
