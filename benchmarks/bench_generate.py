"""generate() end to end: transformers causal LMs built from configs, unpatched vs hf.apply, prefill and decode.

Each model (random weights, nothing downloaded: Llama with RMSNorm and Llama's cast order, GPT-2 with LayerNorm;
with ``--family``, OLMo 2's branch-output layers and Gemma 2's sandwich layers) is deep-copied three times and run as

    unpatched   the transformers model as it is
    fused       addnorm.integrations.hf.apply(model): addnorm norms, residual add + norm fused where recognised
    norms       hf.apply(model, fuse_residual=False): addnorm norms, the model's own residual adds

Two measurements, one after the other:

generate() rows (what a user sees): each sample is one greedy ``generate()`` of T new tokens after a prompt of P
tokens; a logits processor stamps the time after every forward, so one call gives the prefill (the first forward: P
tokens per sequence) and the decode steps (the remaining T - 1 forwards, one token each). The variants run
round-robin (their order rotated each round); ratios are paired per round, their median reported with the range.
A whole generate() is too coarse a unit to resolve the 2-3% that fusion can give on a CPU: one sample swings by more.

Paired steps (what the verdicts use, ``generate_steps.py``): each variant keeps its own model and KV cache; a round
is a prefill of each variant, then ``--steps`` greedy decode steps of each, the variants taking turns at every step
(order rotated by one at each), every step timed by the wall clock and by the thread's CPU time. The per-step ratios
(unpatched / variant: above 1 is faster) give a median and a bootstrap 95% interval (``generate_stats.py``).

generate()'s greedy tokens of every variant must equal the unpatched model's, and the paired loop's unpatched
tokens must equal generate()'s: a difference is an error (exit 1). In the paired loop every variant is fed the
unpatched model's tokens, so all run on the same inputs; the steps at which a variant's own pick differed are
counted in its table (in bf16 a near tie, turned by an ulp of a norm, can go either way after many steps).

The profile gives, for prefill and decode, the share of an unpatched step spent in the norm modules (forward hooks)
and the residual adds (``x + r`` at the step's shape, timed alone, times the adds per step), and what the fused
model spends on the same work: what fusing can save at most. The verdict of each (case, phase) compares the fused
model's interval with issue 25's done-when (decode >= 1.00x; prefill >= 1.05x in bf16): "met", "not met" or "not
resolved", and says so when the measured share puts the target (or the seed's 5%) out of reach.

    python benchmarks/bench_generate.py                               # CPU: llama + gpt2, batch 1 and 8, fp32, bf16
    python benchmarks/bench_generate.py --family llama --batch 1 --json
    python benchmarks/bench_generate.py --family llama --batch 1 --layers 6 --prompt 256 --new 24 --repeats 3 \\
        --rounds 3 --steps 96 --control                               # issue 25's setting, resolving ~2%
    python benchmarks/bench_generate.py --family olmo2,gemma2 --batch 1 --hidden 512 --layers 4 --heads 8 \\
        --control                                                     # norm_add / norm_add_norm layers
    python benchmarks/bench_generate.py --compile                     # + a torch.compile'd forward of each variant
    python benchmarks/bench_generate.py --device cuda --dtype bf16 --hidden 4096 --layers 8 --heads 32 \\
        --prompt 512 --new 64 --out benchmarks/results/gpu/generate.md    # static cache + compiled forward

On CUDA every variant also runs as serving does: ``cache_implementation="static"``, with which generate() compiles the
forward itself (transformers' CompileConfig: ``torch.compile(mode="reduce-overhead")``, CUDA graphs), labelled
"+graphs". On CPU ``--compile`` compiles each
variant's forward with ``torch.compile(dynamic=True)`` (the dynamic cache; no graphs on CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import generate_steps  # the helpers beside this script (its folder is on sys.path when it runs)
from generate_report import CONTROL, paired_markdown, paired_rows

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "generate.md"
VARIANTS = ("unpatched", "fused", "norms")
FAMILIES = ("llama", "gpt2", "olmo2", "gemma2")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be integers >= 1, got {text!r}")
    return values


def _choices(allowed):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return values

    return parse


def build_model(family: str, a, dtype, device):
    """A causal LM from a config, random weights (seeded), in eval mode."""
    import torch

    try:
        import transformers
    except ImportError:
        raise SystemExit("bench_generate.py needs transformers: pip install 'addnorm[hf]'") from None
    torch.manual_seed(0)
    positions = a.prompt + max(a.new, (a.steps or 0) + 1) + 8
    decoder = dict(
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        vocab_size=a.vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    elif family == "olmo2":  # branch-output layers: x + N(F(x)), addnorm.norm_add
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**decoder))
    elif family == "gemma2":  # sandwich layers: x + N_post(F(N_pre(x))), addnorm.norm_add_norm
        head_dim = a.hidden // a.heads
        cfg = transformers.Gemma2Config(**decoder, head_dim=head_dim, query_pre_attn_scalar=head_dim)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            n_embd=a.hidden, n_layer=a.layers, n_head=a.heads, vocab_size=a.vocab, n_positions=positions
        )
        model = transformers.GPT2LMHeadModel(cfg)
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def variants(model, compile_forward: str | None):
    """name -> model: the unpatched copy and the two hf.apply copies (and their compiled forms)."""
    from addnorm.integrations import hf

    out = {"unpatched": model, "fused": hf.apply(copy.deepcopy(model)), "norms": hf.apply(copy.deepcopy(model), False)}
    if compile_forward is None:
        return out
    import torch

    if compile_forward == "graphs":
        # the same models, run with cache_implementation="static": on CUDA generate() then compiles the forward
        # itself (transformers' CompileConfig: torch.compile mode "reduce-overhead", i.e. CUDA graphs), which is how
        # transformers serves decode; compiling it here as well would nest two compilations
        return {**out, **{f"{name}+graphs": m for name, m in out.items()}}
    compiled = {}
    for name, m in out.items():
        c = copy.deepcopy(m) if name == "unpatched" else m
        c.forward = torch.compile(c.forward, dynamic=True)
        compiled[f"{name}+compile"] = c
    return {**out, **compiled}


def fresh_copies(model, i: int = 0, control: bool = False) -> dict:
    """New copies of the paired loop's variants, made in an order rotated by ``i`` (allocation order is one more
    thing that should not always favour the same variant). ``control`` adds a second unpatched copy: the pairs of
    two identical models show what the measurement resolves."""
    from addnorm.integrations import hf

    make = {
        "unpatched": lambda: copy.deepcopy(model),
        "fused": lambda: hf.apply(copy.deepcopy(model)),
        "norms": lambda: hf.apply(copy.deepcopy(model), False),
        CONTROL: lambda: copy.deepcopy(model),
    }
    names = VARIANTS + ((CONTROL,) if control else ())
    order = names[i % len(names) :] + names[: i % len(names)]
    made = {n: make[n]() for n in order}
    return {n: made[n] for n in names}


def hf_is_applied(model) -> bool:
    from addnorm.integrations import hf

    return hf.is_applied(model)


class _Stamps:
    """A logits processor that records the time after each forward (it runs once per generated token)."""

    def __init__(self, sync):
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


def generate_once(model, ids, new: int, sync, static: bool):
    """(tokens, prefill seconds, decode seconds per token) of one greedy generate()."""
    import torch
    from transformers import LogitsProcessorList

    stamps = _Stamps(sync)
    kw = dict(cache_implementation="static") if static else {}
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
            **kw,
        )
    t = stamps.times
    decode = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
    return out, t[0] - t0, decode


def run_case(family, batch, dtype_name, a, progress) -> dict:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build_model(family, a, dtype, device)
    compile_kind = "graphs" if device.type == "cuda" else ("compile" if a.compile else None)
    models = variants(model, compile_kind)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, a.vocab, (batch, a.prompt), generator=g).to(device)
    names = list(models)
    static = {n: n.endswith("+graphs") for n in names}
    tokens, samples = {}, {n: [] for n in names}
    for n in names:  # warm-up (and compilation), and the tokens each variant generates
        tokens[n] = generate_once(models[n], ids, a.new, sync, static[n])[0]
        progress()
    mismatched = [n for n in names if not torch.equal(tokens[n], tokens[names[0]])]
    for i in range(a.repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            samples[n].append(generate_once(models[n], ids, a.new, sync, static[n])[1:])
            progress()
    case = dict(family=family, batch=batch, dtype=dtype_name)
    rows = []
    for n in names:
        base = "unpatched+graphs" if static[n] else ("unpatched+compile" if "+" in n else "unpatched")
        pre = [s[0] for s in samples[n]]
        dec = [s[1] for s in samples[n]]
        pre_ratio = [b[0] / s[0] for s, b in zip(samples[n], samples[base])]  # > 1: faster than the baseline
        dec_ratio = [b[1] / s[1] for s, b in zip(samples[n], samples[base])]
        rows.append(
            dict(
                **case,
                variant=n,
                baseline=base,
                prefill_tok_s=batch * a.prompt / statistics.median(pre),
                prefill_ms=statistics.median(pre) * 1e3,
                prefill_ms_range=(min(pre) * 1e3, max(pre) * 1e3),
                decode_ms_per_token=statistics.median(dec) * 1e3,
                decode_ms_range=(min(dec) * 1e3, max(dec) * 1e3),
                prefill_speedup=statistics.median(pre_ratio),
                prefill_speedup_range=(min(pre_ratio), max(pre_ratio)),
                decode_speedup=statistics.median(dec_ratio),
                decode_speedup_range=(min(dec_ratio), max(dec_ratio)),
                same_tokens=n not in mismatched,
            )
        )
    steps = a.steps or a.new - 1  # the paired loop: the eager variants (compiled ones only above), new copies a round
    loop = generate_steps.paired_steps(
        lambda i: fresh_copies(model, i, a.control), ids, a.rounds, steps, sync, progress, a.block
    )
    # the norms' share of a decode step is a few percent: 32 hooked steps of each model for a stable median
    prof = generate_steps.profile(models["unpatched"], models["fused"], ids, min(steps, 32), sync, a.clock)
    progress()
    paired, verdicts = paired_rows(case, loop, prof, a.clock, tokens["unpatched"])
    profiles = [dict(**case, phase=phase, **p) for phase, p in prof.items()]
    cpu = dict(**case, process_cpu_s=loop["process_cpu_s"], thread_cpu_s=loop["thread_cpu_s"])
    timings = dict(**case, prefill=loop["prefill"], decode=loop["decode"])  # (wall, cpu) a pair, for --json
    return dict(rows=rows, paired=paired, profiles=profiles, verdicts=verdicts, loop_cpu=cpu, timings=timings)


def _env(a) -> dict:
    import torch

    dev = torch.device(a.device)
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command=" ".join(["python", "benchmarks/bench_generate.py", *sys.argv[1:]]),
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        python=platform.python_version(),
        loadavg=os.getloadavg(),
    )


def markdown(result: dict) -> str:
    env, a = result["env"], result["args"]
    load = ", ".join(f"{v:.1f}" for v in env["loadavg"])
    lines = [
        f"`{env['command']}`: {env['date']} - {env['device']}, {env['cores']} cores, {env['torch_threads']} torch "
        f"thread(s), torch {env['torch']}, transformers {env['transformers']}; load average at the end {load}.",
        f"Models: hidden {a['hidden']}, {a['layers']} layers, {a['heads']} heads, vocab {a['vocab']}, random "
        f"weights; prompt {a['prompt']} tokens, {a['new']} new tokens (greedy), {a['repeats']} round-robin samples.",
        "",
        "| model | batch | dtype | variant | prefill tok/s | prefill vs baseline | decode ms/token (range) | "
        "decode vs baseline (range) | same tokens |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        dlo, dhi = r["decode_ms_range"]
        slo, shi = r["decode_speedup_range"]
        lines.append(
            f"| {r['family']} | {r['batch']} | {r['dtype']} | {r['variant']} | {r['prefill_tok_s']:.0f} | "
            f"{r['prefill_speedup']:.3f}x | {r['decode_ms_per_token']:.2f} ({dlo:.2f}-{dhi:.2f}) | "
            f"{r['decode_speedup']:.3f}x ({slo:.3f}-{shi:.3f}) | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join([*lines, "", paired_markdown(result)])


def _write(path: str, text: str, partial: tuple[int, int] | None = None) -> None:
    from addnorm.io import atomic_write_text

    note = f"(partial: {partial[0]} of {partial[1]} cases so far)\n\n" if partial else ""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), "# generate() end to end (benchmarks/bench_generate.py)\n\n" + note + text + "\n")


def verdict_clock(requested: str, device_type: str, threads: int) -> tuple[str, str]:
    """The clock the verdicts use ("wall" or "thread") and why; ``requested`` is --clock (auto, wall or thread)."""
    if device_type != "cpu":
        if requested == "thread":
            raise ValueError("--clock thread: on a GPU the work is the device's, not the calling thread's")
        return "wall", "on a GPU the work is the device's, not the calling thread's (each step synchronized)"
    if threads != 1:
        if requested == "thread":
            raise ValueError(
                f"--clock thread needs --threads 1: with {threads} torch threads one thread's CPU "
                "time misses the others' work"
            )
        return "wall", f"{threads} torch threads: one thread's CPU time would miss the others' work"
    if requested == "wall":
        return "wall", "asked for (--clock wall)"
    return "thread", (
        "one torch thread, so all compute runs in the calling thread and the time other processes hold the core "
        "drops out (the caches they share do not)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--family",
        type=_choices(FAMILIES),
        default=["llama", "gpt2"],
        help="llama,gpt2 (default); olmo2 (branch-output layers), gemma2 (sandwich layers)",
    )
    p.add_argument("--batch", type=_int_list, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--dtype", type=_choices(("fp32", "bf16")), default=["fp32", "bf16"], help="fp32,bf16")
    p.add_argument("--hidden", type=_positive, default=1024, help="hidden size (default 1024)")
    p.add_argument("--layers", type=_positive, default=4, help="decoder layers (default 4)")
    p.add_argument("--heads", type=_positive, default=16, help="attention heads (default 16)")
    p.add_argument("--vocab", type=_positive, default=4096, help="vocabulary (default 4096)")
    p.add_argument("--prompt", type=_positive, default=64, help="prompt tokens P (default 64)")
    p.add_argument("--new", type=_positive, default=16, help="new tokens T (default 16; >= 2 to time decode)")
    p.add_argument(
        "--repeats", type=_positive, default=5, help="round-robin generate() samples per variant (default 5)"
    )
    p.add_argument("--rounds", type=_positive, default=3, help="paired rounds: a prefill, then --steps (default 3)")
    p.add_argument("--steps", type=int, default=0, help="decode steps a paired round (default 0: --new - 1)")
    p.add_argument("--block", type=int, default=8, help="move the weights every BLOCK steps (default 8; 0: never)")
    p.add_argument("--control", action="store_true", help="paired loop: + a second unpatched model (A/A)")
    p.add_argument(
        "--clock",
        choices=("auto", "thread", "wall"),
        default="auto",
        help="clock of the verdicts (default auto: thread CPU time with one torch thread on CPU)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1; 0 keeps torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--compile", action="store_true", help="CPU: also torch.compile'd forwards (CUDA: always)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown file ('' writes nothing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(argv)
    if a.new < 2:
        p.error("--new must be >= 2: decode is timed between the first and the last forward")
    if a.steps < 0:
        p.error(f"--steps must be >= 0 (0: --new - 1), got {a.steps}")
    if a.block < 0:
        p.error(f"--block must be >= 0 (0: never), got {a.block}")
    if a.hidden % a.heads:
        p.error(f"--hidden ({a.hidden}) must be a multiple of --heads ({a.heads})")
    import torch

    try:
        device = torch.device(a.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if device.type == "cpu" and a.threads > 0:
        torch.set_num_threads(a.threads)
    try:
        name, why = verdict_clock(a.clock, device.type, torch.get_num_threads())
    except ValueError as e:
        p.error(str(e))
    a.clock = name
    cases = [(f, b, d) for f in a.family for b in a.batch for d in a.dtype]
    per_case = (2 if a.compile or device.type == "cuda" else 1) * len(VARIANTS) * (a.repeats + 1) + a.rounds + 1
    total, done = len(cases) * per_case, [0]

    def progress():
        done[0] += 1
        if not a.no_progress:
            bar = "#" * (30 * done[0] // total)
            print(f"\r[{bar:<30}] {done[0]}/{total} runs", end="", file=sys.stderr, flush=True)

    result = dict(args=vars(a), clock=dict(name=name, why=why), rows=[], paired=[], profiles=[], verdicts=[])
    result.update(loop_cpu=[], timings=[])
    for i, case in enumerate(cases, 1):
        got = run_case(*case, a, progress)
        for key in ("rows", "paired", "profiles", "verdicts"):
            result[key] += got[key]
        result["loop_cpu"].append(got["loop_cpu"])
        result["timings"].append(got["timings"])
        result["env"] = _env(a)
        if a.out and i < len(cases):  # a long run on a busy machine keeps what it measured so far
            _write(a.out, markdown(result), (i, len(cases)))
    if not a.no_progress:
        print(file=sys.stderr)
    text = markdown(result)
    if a.out:
        _write(a.out, text)
    print(json.dumps(result, indent=1) if a.json else text)
    bad = [f"{r['family']} b{r['batch']} {r['dtype']} {r['variant']}" for r in result["rows"] if not r["same_tokens"]]
    # the paired loop feeds every variant the unpatched model's tokens: a differing pick there is counted in its
    # table (a bf16 near tie can go either way), the same-tokens check is generate()'s, above
    if bad:
        print(f"error: greedy tokens differ from the unpatched model's: {', '.join(bad)}", file=sys.stderr)
    loop = [f"{r['family']} b{r['batch']} {r['dtype']}" for r in result["paired"] if not r["like_generate"]]
    if loop:
        names = ", ".join(dict.fromkeys(loop))
        print(f"error: the paired loop's greedy tokens differ from generate()'s: {names}", file=sys.stderr)
    return 1 if bad or loop else 0


if __name__ == "__main__":
    sys.exit(main())
