"""Training data without downloads: a synthetic language whose best achievable loss is known, or a user's text.

**Synthetic language** (:class:`MarkovLanguage`): a seeded random Markov chain of order k over V tokens. Each
context (the last k tokens) allows ``branching`` next tokens with Dirichlet-random probabilities, mixed with a
little uniform mass (``smoothing``) so the chain is ergodic and has one stationary distribution pi over contexts.
Sequences start from pi, so every window is stationary. Its entropy rate is exact:

    h = sum_c pi(c) * H(P(. | c))                       (nats per token)

and so is the best possible loss of a model that predicts tokens 1..T of a sequence x_0..x_T from their prefixes
(the chain rule for the joint entropy of a stationary order-k chain, T >= k):

    optimum(T) = [H(x_0..x_T) - H(x_0)] / T,   H(x_0..x_T) = H(pi) + (T + 1 - k) * h

It is a little above h because the first k - 1 predictions see less than a full context. Results then read as
"excess loss over the optimum".

**Sentences** (:class:`SentenceMixture`): batches as NLP batches are, for experiments whose claim is about how
batches vary: each row one sentence from one of several sources (topics, each with its own tokens and frequency, so
some tokens are rare), of random length, padded to the batch's length with token 0. Its best achievable loss is
exact too (see the class).

**Text** (:class:`TextData`): a file read as bytes (vocab 256), the last ``val_fraction`` kept for validation.

Batches are a pure function of (seed, step): the data position is the step, so a resumed run sees the same
batches, and every data-parallel rank builds the same global batch and takes its own disjoint slice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["MarkovLanguage", "SentenceMixture", "TextData", "batch_generator"]

# Stream ids mixed into the seed so training and validation batches never coincide.
_TRAIN_STREAM, _VAL_STREAM = 1, 2


def batch_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A CPU generator seeded from (seed, stream, index) through a 64-bit mix (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    z ^= z >> 31
    return torch.Generator().manual_seed(z & (2**63 - 1))


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along ``axis`` (0 log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=axis)


class MarkovLanguage:
    """A seeded random sparse Markov chain of order ``order`` over ``vocab_size`` tokens (see the module docstring).

    ``table`` has shape (V**k, V): row c is P(next | context c), contexts numbered base V with the oldest token
    most significant.
    """

    def __init__(
        self, *, vocab_size: int = 64, order: int = 1, branching: int = 4, smoothing: float = 0.01, seed: int = 0
    ):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if vocab_size**order > 1 << 16:
            raise ValueError(f"vocab_size**order must be <= 65536 contexts, got {vocab_size}**{order}")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        rng = np.random.default_rng(seed)
        contexts = vocab_size**order
        table = np.zeros((contexts, vocab_size))
        for c in range(contexts):
            allowed = rng.choice(vocab_size, size=branching, replace=False)
            table[c, allowed] = rng.dirichlet(np.ones(branching))
        table = (1.0 - smoothing) * table + smoothing / vocab_size
        self._init_from_table(table, order, seed)

    @classmethod
    def from_table(cls, table, *, order: int = 1, seed: int = 0) -> MarkovLanguage:
        """A chain from an explicit (V**order, V) transition table (rows must sum to 1, the chain be ergodic)."""
        table = np.asarray(table, dtype=np.float64)
        if table.ndim != 2 or table.shape[0] != table.shape[1] ** order:
            raise ValueError(f"table must have shape (V**order, V) with order={order}, got {table.shape}")
        if (table < 0).any() or not np.allclose(table.sum(1), 1.0):
            raise ValueError("table rows must be probability distributions (non-negative, summing to 1)")
        self = cls.__new__(cls)
        self._init_from_table(table, order, seed)
        return self

    def _init_from_table(self, table: np.ndarray, order: int, seed: int) -> None:
        self.vocab_size = table.shape[1]
        self.order = order
        self.seed = seed
        self.table = table
        self.stationary = self._stationary()
        self.entropy_rate = float((self.stationary * _entropy(table)).sum())
        self._cum = torch.from_numpy(np.cumsum(table, axis=1))
        self._cum[:, -1] = 1.0 + 1e-9  # a uniform draw of exactly 1 - ulp must still land in the last bin
        self._pi_cum = torch.from_numpy(np.cumsum(self.stationary))
        self._pi_cum[-1] = 1.0 + 1e-9

    def _stationary(self) -> np.ndarray:
        """pi over contexts by power iteration: pi'(c[1:], y) = sum_{c[0]} pi(c) P(y | c)."""
        v, k = self.vocab_size, self.order
        t = self.table.reshape(v, v ** (k - 1), v)  # (oldest token, rest of context, next)
        pi = np.full(v**k, 1.0 / v**k)
        for _ in range(100_000):
            new = np.einsum("ar,arn->rn", pi.reshape(v, v ** (k - 1)), t).reshape(-1)
            # Averaging with the old iterate (a lazy chain, same pi) converges even for a periodic chain.
            new = 0.5 * (new + pi)
            if np.abs(new - pi).sum() < 1e-14:
                return new / new.sum()
            pi = new
        raise ValueError("the chain did not reach a stationary distribution (is it ergodic?)")

    def optimum(self, seq_len: int) -> float:
        """The best achievable mean loss predicting tokens 1..seq_len from their prefixes (see the docstring)."""
        if seq_len < self.order:
            raise ValueError(f"seq_len must be >= order={self.order}, got {seq_len}")
        v, k = self.vocab_size, self.order
        h_pi = float(_entropy(self.stationary))
        h_first = float(_entropy(self.stationary.reshape(v, -1).sum(1)))
        return (h_pi + (seq_len + 1 - k) * self.entropy_rate - h_first) / seq_len

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, length) int64 tokens, each row a stationary window of the chain."""
        v, k = self.vocab_size, self.order
        if length < k:
            raise ValueError(f"length must be >= order={k}, got {length}")
        ctx = torch.searchsorted(self._pi_cum, torch.rand(batch, 1, generator=generator, dtype=torch.float64))[:, 0]
        out = torch.empty(batch, length, dtype=torch.int64)
        for i in range(k):  # unpack the context's digits, oldest first
            out[:, i] = (ctx // v ** (k - 1 - i)) % v
        u = torch.rand(length - k, batch, 1, generator=generator, dtype=torch.float64)
        for t in range(k, length):
            nxt = torch.searchsorted(self._cum[ctx], u[t - k])[:, 0]
            out[:, t] = nxt
            ctx = (ctx % v ** (k - 1)) * v + nxt
        return out

    def log_prob(self, tokens: torch.Tensor) -> torch.Tensor:
        """log P(x_t | previous k tokens) for t >= k: shape (batch, length - k) (for Monte-Carlo checks)."""
        v, k = self.vocab_size, self.order
        ctx = torch.zeros(tokens.shape[0], tokens.shape[1] - k, dtype=torch.int64)
        for i in range(k):
            ctx = ctx * v + tokens[:, i : tokens.shape[1] - k + i]
        return torch.from_numpy(np.log(self.table))[ctx, tokens[:, k:]]

    def reference_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean -log P(target | its whole prefix) under the chain itself, on (inputs, targets) from :meth:`batch`:
        the loss of the best possible model on exactly these tokens. Its expectation is ``optimum(T)``; a finite
        validation set differs from it by sampling noise that a model's loss on the same tokens shares, so
        ``model loss - reference_loss`` is the excess with that noise paired away."""
        x = torch.cat([inputs[:, :1], targets], dim=1)  # (B, T + 1): x_0..x_T
        v, k = self.vocab_size, self.order
        if x.shape[1] - 1 < k:
            raise ValueError(f"seq_len must be >= order={k}, got {x.shape[1] - 1}")
        total = -float(self.log_prob(x).sum())  # x_k..x_T: a full context each
        # x_1..x_{k-1} see only x_0..x_{j-1}: P(x_j | x_0..x_{j-1}) = m_j(x_0..x_j) / m_{j-1}(x_0..x_{j-1}), with m_j
        # the stationary probability of a window's first j + 1 tokens (pi's axes are the context, oldest first).
        pi = self.stationary.reshape((v,) * k)
        log_m = [np.log(pi.sum(axis=tuple(range(j + 1, k)))) for j in range(k)]
        cols = [x[:, i].numpy() for i in range(k)]
        for j in range(1, k):
            total -= float((log_m[j][tuple(cols[: j + 1])] - log_m[j - 1][tuple(cols[:j])]).sum())
        return total / targets.numel()

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"):
        """The (inputs, targets) of ``step``: (batch_size, seq_len) each, targets shifted by one."""
        gen = batch_generator(seed, _TRAIN_STREAM if split == "train" else _VAL_STREAM, step)
        x = self.sample(batch_size, seq_len + 1, gen)
        return x[:, :-1], x[:, 1:]

    def describe(self, seq_len: int) -> dict:
        return {
            "kind": "markov",
            "vocab_size": self.vocab_size,
            "order": self.order,
            "seed": self.seed,
            "entropy_rate": self.entropy_rate,
            "optimum": self.optimum(seq_len),
        }


class SentenceMixture:
    """Sentences from several sources, of random length, padded: the heterogeneous batches of NLP, scaled down.

    Token 0 is padding. Source k (of ``sources``) writes with its own ``tokens_per_source`` tokens (ids
    ``1 + k * m .. (k + 1) * m``) by an order-1 :class:`MarkovLanguage` of ``branching`` successors, and is drawn
    for a row with probability ``weights[k]`` (default proportional to 2^-k: the last source and its tokens are
    rare). A row of a batch is one sentence: its source, a length L uniform on ``min_len .. seq_len + 1`` tokens
    (``seq_len + 1``: no padding), the source's chain from its stationary distribution for L tokens, then padding.

    The best possible prediction of x_t from x_0..x_{t-1} is known: the source is named by x_0's token range; after
    padding began, padding follows for sure; otherwise the sentence ends here with the hazard
    h_t = P(L = t | L >= t) and continues by the source's chain with 1 - h_t. So :meth:`reference_loss` scores
    tokens exactly and :meth:`optimum` is the expectation of that loss.
    """

    pad_id = 0

    def __init__(
        self,
        *,
        sources: int = 4,
        tokens_per_source: int = 7,
        weights=None,
        min_len: int = 4,
        branching: int = 3,
        smoothing: float = 0.01,
        seed: int = 0,
    ):
        if not isinstance(sources, int) or sources < 1:
            raise ValueError(f"sources must be an int >= 1, got {sources!r}")
        if not isinstance(tokens_per_source, int) or tokens_per_source < 2:
            raise ValueError(f"tokens_per_source must be an int >= 2, got {tokens_per_source!r}")
        if not isinstance(min_len, int) or min_len < 2:
            raise ValueError(
                f"min_len must be an int >= 2 (a sentence names its source, then goes on), got {min_len!r}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        w = np.asarray([2.0**-k for k in range(sources)] if weights is None else weights, dtype=np.float64)
        if w.shape != (sources,) or (w <= 0).any() or not np.isfinite(w).all():
            raise ValueError(f"weights must be {sources} positive numbers (one per source), got {weights!r}")
        self.sources, self.tokens_per_source, self.min_len, self.seed = sources, tokens_per_source, min_len, seed
        self.weights = w / w.sum()
        self.vocab_size = 1 + sources * tokens_per_source
        # each source its own chain, seeded apart from the other sources and from other seeds' sources
        self.chains = [
            MarkovLanguage(
                vocab_size=tokens_per_source, order=1, branching=branching, smoothing=smoothing, seed=seed * 1009 + k
            )
            for k in range(sources)
        ]
        self._w_cum = torch.from_numpy(np.cumsum(self.weights))
        self._w_cum[-1] = 1.0 + 1e-9
        self._log_table = torch.from_numpy(np.log(np.stack([c.table for c in self.chains])))  # (K, m, m)

    def _lengths(self, seq_len: int) -> np.ndarray:
        if seq_len + 1 < self.min_len:
            raise ValueError(f"seq_len must be >= min_len - 1 = {self.min_len - 1}, got {seq_len}")
        return np.arange(self.min_len, seq_len + 2)

    def _hazard(self, seq_len: int) -> np.ndarray:
        """h[t] = P(L = t | L >= t) for t = 0..seq_len + 1 (0 below min_len)."""
        lengths = self._lengths(seq_len)
        h = np.zeros(seq_len + 2)
        h[lengths] = 1.0 / (seq_len + 2 - lengths)  # L uniform: 1 / (number of lengths still possible)
        return h

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, length) int64 tokens: one padded sentence per row (``length`` = seq_len + 1)."""
        lengths = self._lengths(length - 1)
        source = torch.searchsorted(self._w_cum, torch.rand(batch, generator=generator, dtype=torch.float64))
        sent_len = torch.from_numpy(lengths)[torch.randint(len(lengths), (batch,), generator=generator)]
        out = torch.empty(batch, length, dtype=torch.int64)
        for k, chain in enumerate(self.chains):  # every source samples every row: the draws do not depend on k's rows
            rows = chain.sample(batch, length, generator) + 1 + k * self.tokens_per_source
            out = torch.where((source == k)[:, None], rows, out)
        return out.masked_fill(torch.arange(length)[None, :] >= sent_len[:, None], self.pad_id)

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"):
        """The (inputs, targets) of ``step``: (batch_size, seq_len) each, targets shifted by one."""
        gen = batch_generator(seed, _TRAIN_STREAM if split == "train" else _VAL_STREAM, step)
        x = self.sample(batch_size, seq_len + 1, gen)
        return x[:, :-1], x[:, 1:]

    def reference_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean -log P(target | its prefix) under the generating process, on (inputs, targets) from :meth:`batch`."""
        x = torch.cat([inputs[:, :1], targets], dim=1)  # (B, T + 1)
        seq_len = x.shape[1] - 1
        h = torch.from_numpy(self._hazard(seq_len))
        m = self.tokens_per_source
        source = (x[:, 0] - 1) // m  # x_0 is never padding (min_len >= 2)
        prev, nxt = x[:, :-1], x[:, 1:]
        t = torch.arange(1, seq_len + 1)
        ended, stops = prev == self.pad_id, nxt == self.pad_id
        local_prev, local_next = (prev - 1).clamp(min=0) % m, (nxt - 1).clamp(min=0) % m
        go_on = torch.log1p(-h[t]) + self._log_table[source[:, None], local_prev, local_next]
        logp = torch.where(stops, torch.log(h[t]).expand_as(go_on), go_on)
        logp = torch.where(ended, torch.zeros_like(logp), logp)  # padding after padding: certain
        return -float(logp.sum()) / targets.numel()

    def optimum(self, seq_len: int) -> float:
        """The expectation of :meth:`reference_loss`: per predicted position t = 1..seq_len,
        P(L = t) (-log h_t) + P(L > t) (-log(1 - h_t) + sum_k w_k H_k), H_k source k's entropy rate."""
        lengths = self._lengths(seq_len)
        h = self._hazard(seq_len)
        rate = float(sum(w * c.entropy_rate for w, c in zip(self.weights, self.chains)))
        total = 0.0
        for t in range(1, seq_len + 1):
            p_end = float(np.mean(lengths == t))
            p_more = float(np.mean(lengths > t))
            total += (p_end * -np.log(h[t]) if p_end else 0.0) + p_more * (-np.log1p(-h[t]) + rate)
        return total / seq_len

    def describe(self, seq_len: int) -> dict:
        return {
            "kind": "sentences",
            "vocab_size": self.vocab_size,
            "sources": self.sources,
            "tokens_per_source": self.tokens_per_source,
            "weights": [float(w) for w in self.weights],
            "min_len": self.min_len,
            "seed": self.seed,
            "optimum": float(self.optimum(seq_len)),
        }


class TextData:
    """A text file at byte level (vocab 256): the first 1 - ``val_fraction`` trains, the rest validates."""

    vocab_size = 256

    def __init__(self, path: str | Path, *, val_fraction: float = 0.1):
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data file {str(path)!r} does not exist or is not a file")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        raw = path.read_bytes()
        if not raw:
            raise ValueError(f"data file {str(path)!r} is empty")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        n_val = max(1, int(len(data) * val_fraction))
        self.path = path
        self.train_data, self.val_data = data[:-n_val], data[-n_val:]

    def optimum(self, seq_len: int) -> float | None:
        return None  # unknown for real text

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"):
        data = self.train_data if split == "train" else self.val_data
        if len(data) < seq_len + 2:
            raise ValueError(
                f"the {split} split of {str(self.path)!r} has {len(data)} bytes; seq_len={seq_len} needs at least "
                f"{seq_len + 2} (use a bigger file or a smaller seq_len)"
            )
        gen = batch_generator(seed, _TRAIN_STREAM if split == "train" else _VAL_STREAM, step)
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        x = data[idx]
        return x[:, :-1], x[:, 1:]

    def describe(self, seq_len: int) -> dict:
        return {
            "kind": "text",
            "path": str(self.path),
            "vocab_size": 256,
            "train_bytes": len(self.train_data),
            "val_bytes": len(self.val_data),
            "entropy_rate": None,
            "optimum": None,
        }
