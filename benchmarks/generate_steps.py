"""bench_generate.py's paired per-step measurement and its profile of prefill and decode.

Paired steps: every variant (unpatched, fused, norms) has its own model and its own KV cache, fed the same prompt.
Two copies of one model, run alternately, differ by up to +-3% a step on this machine, the same for as long as each
keeps its weights where they are and different once they move: so every round makes new copies of the models, and
every ``block`` steps their weights move to new allocations; a block is the unit the bootstrap resamples
(generate_stats.py). One set of copies for the whole run would be a bias that no number of steps removes. A
round is one prefill of each variant, then ``steps`` greedy decode steps of each; the variants take turns within
every prefill and every step (unpatched, fused, norms, ...), the order rotated by one at each step and, for the
prefills, at each round, so that a change of load hits all of them within a few tens of milliseconds and each
variant runs first, second and third equally often (the prefills: when the rounds are a multiple of three).
Each step is timed twice, by the wall clock (``time.perf_counter``) and by the calling thread's CPU time
(``time.thread_time``): with one torch thread (and the cpu backend's numba kernels, which follow torch's thread
count) all the model's work runs in the calling thread, so the time other processes hold the core drops out of the
second; the process's CPU time over the loop is recorded too, to show that no other thread did the work.

A step is the model's forward (``logits_to_keep=1``, the cache, the attention mask and positions as generate() passes
them) and the greedy pick; generate()'s own bookkeeping, the same in every variant, is outside the timing, so the
paired ratio is of the model's step. The greedy tokens of every round are returned to be compared.

Profile: for the unpatched and the fused model, one prefill and a few decode steps (alternating) with forward hooks
around every norm module (the same modules by name in both: hf.apply keeps the names), timed with the clock the
verdict uses; the residual adds outside norm modules (two a layer unpatched; those the fused model's norms did not
take, counted from the calls that passed a residual) are timed alone at the step's shape.
"""

from __future__ import annotations

import inspect
import statistics
import time

CLOCK_FUNCTIONS = {"wall": time.perf_counter, "thread": time.thread_time}


def _cache_name(model) -> str:
    """The forward's keyword for the KV cache: ``cache`` in transformers 5, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers before 4.56 took no config
        return DynamicCache()


class Decoder:
    """One variant's greedy decoding state: its model, its cache, the attention mask and the tokens so far."""

    def __init__(self, model, ids):
        import torch

        self.model, self.ids = model, ids
        self.cache_kw = _cache_name(model)
        self.cache = _new_cache(model)
        self.mask = torch.ones_like(ids)
        self.tokens = []  # the tokens fed, one (batch, 1) tensor per forward
        self.next = None
        self.feed = None  # the token the next step runs on, when not its own pick (set by paired_steps)
        self.agree = 0  # steps fed another decoder's token at which this one's own greedy pick was the same
        self.fed = 0

    def _forward(self, input_ids):
        import torch

        seen = self.mask.shape[1] - input_ids.shape[1]
        positions = torch.arange(seen, self.mask.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        # generate() casts the last logits to fp32 before its argmax; the first maximum wins either way
        self.next = out.logits[:, -1].float().argmax(-1, keepdim=True)  # the cache grew in place

    def prefill(self):
        self._forward(self.ids)

    def step(self):
        """One decode step on its own greedy pick, or on ``self.feed`` (the unpatched decoder's pick: every variant
        then sees the same inputs, and a near tie that a bf16 ulp turns the other way cannot send one variant down
        another sequence for the rest of the round); whether its own pick agreed is counted."""
        import torch

        token = self.next
        if self.feed is not None:
            self.fed += 1
            self.agree += bool(torch.equal(self.next, self.feed))
            token = self.feed
        self.tokens.append(token)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self._forward(token)

    def generated(self):
        """The prompt and the tokens chosen so far, as generate() returns them."""
        import torch

        return torch.cat([self.ids, *self.tokens, self.next], dim=1)


def _timed(fn, sync) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of fn(), the device synchronized on both sides."""
    sync()
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    sync()
    return time.perf_counter() - w0, time.thread_time() - c0


def _rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def reallocate(model) -> None:
    """Move every parameter and buffer of ``model`` to a new allocation (same values, same Parameter objects, so
    modules that share one keep sharing it): where its weights lie in memory is drawn again."""
    import torch

    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.data = t.data.clone()


def paired_steps(make_models, ids, rounds: int, steps: int, sync, progress=lambda: None, block: int = 0) -> dict:
    """Round-robin prefills and decode steps. ``make_models(i)`` gives round i its own models (name -> model; the
    first name is the baseline). Every ``block`` decode steps (0: never) each model's weights move to a new
    allocation (:func:`reallocate`), so that where they landed is one block's draw, not the whole run's.

    Returns, per name, the prefill timings (one (wall, cpu) pair a round), the decode timings (a list of (wall, cpu)
    pairs a block, index j of every name's block one pair), the greedy tokens of each round, and the loop's process
    and thread CPU time."""
    import torch

    if rounds < 1 or steps < 1 or block < 0:
        raise ValueError(f"rounds and steps must be >= 1 and block >= 0, got {rounds}, {steps} and {block}")
    prefill, decode, tokens, agreement = {}, {}, {}, {}
    p0, t0 = time.process_time(), time.thread_time()
    k = 0  # decode steps so far: their rotation continues across rounds
    for i in range(rounds):
        models = make_models(i)
        names = list(models)
        reference = "unpatched" if "unpatched" in models else names[0]
        with torch.inference_mode():
            dec = {n: Decoder(models[n], ids) for n in names}
            for n in _rotated(names, i):  # by round: every variant prefills first once in len(names) rounds
                prefill.setdefault(n, []).append(_timed(dec[n].prefill, sync))
            for j in range(steps):
                if j == 0 or (block and j % block == 0):
                    if j:
                        for n in _rotated(names, k):
                            reallocate(models[n])
                    for n in names:
                        decode.setdefault(n, []).append([])
                for n in names:  # every variant runs on the unpatched model's pick of the last step
                    dec[n].feed = None if n == reference else dec[reference].next
                for n in _rotated(names, k):
                    decode[n][-1].append(_timed(dec[n].step, sync))
                k += 1
            for n in names:
                tokens.setdefault(n, []).append(dec[n].generated())
                agreement.setdefault(n, []).append((dec[n].agree, dec[n].fed))
        del dec, models  # the next round's copies take their place
        progress()
    return dict(
        prefill=prefill,
        decode=decode,
        tokens=tokens,
        agreement=agreement,
        process_cpu_s=time.process_time() - p0,
        thread_cpu_s=time.thread_time() - t0,
    )


def norm_module_names(model) -> list[str]:
    """The names of ``model``'s norm modules: torch's LayerNorm/RMSNorm and any class named ...RMSNorm/LayerNorm."""
    from torch import nn

    kinds = (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, kinds) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
    ]


class _NormHooks:
    """Forward hooks around the named norm modules: time inside them and calls that passed a residual."""

    def __init__(self, model, names, clock, sync):
        self.spent, self.fused_calls, self._start = 0.0, 0, []
        self.clock, self.sync = clock, sync
        self.handles = []
        for name in names:
            m = model.get_submodule(name)
            self.handles += [m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post)]

    def _pre(self, _m, args):
        self.fused_calls += len(args) > 1 and args[1] is not None  # norm(x, residual): the add is inside
        self.sync()
        self._start.append(self.clock())

    def _post(self, _m, _args, _out):
        self.sync()
        self.spent += self.clock() - self._start.pop()

    def take(self) -> tuple[float, int]:
        out = self.spent, self.fused_calls
        self.spent, self.fused_calls = 0.0, 0
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def add_seconds(shape, dtype, device, clock, sync, reps: int) -> float:
    """Time of one ``x + r`` at ``shape``, timed alone."""
    import torch

    x = torch.randn(shape, dtype=dtype, device=device)
    r = torch.randn_like(x)
    with torch.inference_mode():
        for _ in range(max(2, reps // 10)):
            x + r
        sync()
        t0 = clock()
        for _ in range(reps):
            x + r
        sync()
        return (clock() - t0) / reps


def profile(unpatched, fused, ids, steps: int, sync, clock: str) -> dict:
    """phase -> the unpatched step, its norm and add time, the fused model's, and the share and cost they give."""
    import torch

    tick = CLOCK_FUNCTIONS[clock]
    names = norm_module_names(unpatched)
    models = {"unpatched": unpatched, "fused": fused}
    hooks = {n: _NormHooks(m, names, tick, sync) for n, m in models.items()}
    per = {phase: {n: [] for n in models} for phase in ("prefill", "decode")}  # (step, norms, fused calls)
    try:
        with torch.inference_mode():
            dec = {n: Decoder(m, ids) for n, m in models.items()}
            for k in range(steps + 1):
                phase = "prefill" if k == 0 else "decode"
                for n in _rotated(list(models), k):
                    hooks[n].take()
                    sync()
                    t0 = tick()
                    dec[n].prefill() if k == 0 else dec[n].step()
                    sync()
                    step = tick() - t0
                    per[phase][n].append((step, *hooks[n].take()))
    finally:
        for h in hooks.values():
            h.remove()
    cfg = unpatched.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    out = {}
    for phase, rows in per.items():
        shape = (ids.shape[0], ids.shape[1] if phase == "prefill" else 1, hidden)
        add = add_seconds(shape, unpatched.dtype, ids.device, tick, sync, 20 if phase == "prefill" else 200)
        step = statistics.median(r[0] for r in rows["unpatched"])
        norms = statistics.median(r[1] for r in rows["unpatched"])
        fused_norms = statistics.median(r[1] for r in rows["fused"])
        fused_calls = rows["fused"][0][2]
        eager = norms + 2 * layers * add  # two residual adds a layer
        fused_work = fused_norms + (2 * layers - fused_calls) * add  # the adds its norms did not take
        out[phase] = dict(
            step_s=step,
            norm_share=norms / step,
            add_share=2 * layers * add / step,
            share=min(1.0, eager / step),
            cost=fused_work / eager,
            norm_modules=len(names),
            fused_calls=fused_calls,
            clock=clock,
            samples=len(rows["unpatched"]),
        )
    return out
