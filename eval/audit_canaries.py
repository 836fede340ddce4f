"""Audit canaries for the CBOW: units of the run's privacy unit, each with rows of its own.

Canary i owns two fresh word ids appended after the run's V words, a_i = V + 2i and b_i = V + 2i + 1 (a public id
range, the same whatever the coins: the tables always have V + 2m words). A word that only a canary uses would fall
below a DP vocabulary's threshold or outside a public list; appended ids sidestep that, and since no clean sample
touches them, the canary's rows move only through the canary and the noise.

The canary unit, in the run's privacy unit:

- ``pair``: one (target, context) sample, target a_i, context b_i;
- ``sentence`` / ``document``: a two-word sentence (and document) "a_i b_i": its two samples (a_i | b_i), (b_i | a_i).

Negatives: ``data.negatives`` ids drawn from the clean unigram^0.75 law (as the pipeline draws them; canary words
have count 0, so no clean sample ever draws a canary id), with a public generator.

The canary rows are initialised (a public, data-independent choice, as any init) along mutually orthogonal unit
vectors: the input and output rows of a_i and b_i get four orthonormal directions, so at the init out[a]·in[b] =
out[b]·in[a] = 0 and σ(0) − 1 = −1/2. The output rows get norm A = ``scale``, the input rows B = ``IN_RATIO``·A
(untied tables; tied, both get A). A sample (a | b) then has gradient −out[a]/2 on in[b] (norm A/2), −in[b]/2 on
out[a] and +in[b]/2 on each of its K negatives' output rows (norm B/2 each): its own rows carry
√((A² + B²)/(A² + (K + 1)B²)) of its norm (0.98 at K = 8), where equal norms would leave √(2/(K + 2)) (0.45) on
rows the scorer can attribute to it. With A/2 ≥ S1 the unit is clipped to S1, the most a unit may weigh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from widedp.data_prep.cbow import CBOWData, Split
from widedp.errors import ConfigError
from widedp.models.cbow import CBOW, CBOWBatch

#: Input rows' norm relative to the output rows' (untied tables), see the module docstring.
IN_RATIO = 0.1


@dataclass(frozen=True)
class CanarySet:
    """m canaries over a vocabulary of V clean words.

    target: [S] int64, context: [S, C] int64 (-1 padding), negatives: [S, K] int64: every canary sample (included
    or not), canary by canary; owner: [S] int64 the canary of each sample (0..m-1, non-decreasing).
    """

    m: int
    vocab_size: int
    target: np.ndarray
    context: np.ndarray
    negatives: np.ndarray
    owner: np.ndarray

    @property
    def words(self) -> list[str]:
        """The 2m appended words, ``<canary-i-a>``, ``<canary-i-b>`` (ids V + 2i, V + 2i + 1)."""
        return [f"<canary-{i}-{s}>" for i in range(self.m) for s in "ab"]

    def batch(self, device: torch.device | str) -> CBOWBatch:
        """All S canary samples as one batch on ``device``."""
        t = (torch.as_tensor(a, dtype=torch.long, device=device) for a in (self.target, self.context, self.negatives))
        return CBOWBatch(*t)

    def own_rows(self, model: CBOW) -> Tensor:
        """[m, n] int64 global row ids of each canary's own rows (n = 2 tied, 4 untied: inputs, then outputs)."""
        ids = self.vocab_size + torch.arange(2 * self.m).view(self.m, 2)
        return ids if model.tied else torch.cat([ids, ids + model.vocab_size], 1)


def make_canaries(data: CBOWData, *, m: int, unit: str, context_width: int, negatives: int,
                  generator: torch.Generator) -> CanarySet:
    """The canary samples for ``data`` (its V words and counts): ``unit`` pair / sentence / document;
    ``context_width`` C of the split's context arrays; ``negatives`` K per sample."""
    if m < 1:
        raise ConfigError(f"--canaries: must be >= 1, got {m}")
    v = len(data.vocab)
    a = v + 2 * np.arange(m)
    if unit == "pair":
        target, ctx, owner = a, a + 1, np.arange(m)
    elif unit in ("sentence", "document"):
        target = np.stack([a, a + 1], 1).reshape(-1)
        ctx, owner = np.stack([a + 1, a], 1).reshape(-1), np.repeat(np.arange(m), 2)
    else:
        raise ConfigError(f"data.privacy_unit: the audit's canaries are CBOW pairs, sentences or documents, got {unit}")
    context = np.full((len(target), context_width), -1, dtype=np.int64)
    context[:, 0] = ctx
    weights = torch.as_tensor(np.asarray(data.counts, dtype=np.float64) ** 0.75)
    if negatives:
        neg = torch.multinomial(weights, len(target) * negatives, replacement=True, generator=generator)
        neg_np = neg.view(len(target), negatives).numpy().astype(np.int64)
    else:
        neg_np = np.zeros((len(target), 0), dtype=np.int64)
    return CanarySet(m, v, target.astype(np.int64), context, neg_np, owner.astype(np.int64))


def with_canaries(data: CBOWData, canaries: CanarySet, included: np.ndarray) -> CBOWData:
    """``data`` with the 2m canary words appended to the vocabulary (count 0) and the samples of the included
    canaries (``included`` [m] bool) appended to the train split, each canary a unit of its own (fresh sentence and
    document ids, corpus-order keys after every clean one). valid / test are unchanged."""
    if len(data.vocab) != canaries.vocab_size:
        raise ValueError("canaries were made for another vocabulary")
    keep = np.asarray(included, dtype=bool)[canaries.owner]
    tr = data.train
    owner = canaries.owner[keep]

    def fresh(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        start = (int(a.max()) + 1) if len(a) else 0
        return np.r_[a, start + owner]

    order = None if tr.order is None else np.r_[tr.order, (int(tr.order.max()) + 1 if len(tr.order) else 0)
                                                 + np.flatnonzero(keep)]
    train = Split(np.r_[tr.target, canaries.target[keep]], np.r_[tr.context, canaries.context[keep]],
                  np.r_[tr.negatives, canaries.negatives[keep]], fresh(tr.sentence), fresh(tr.document), order)
    counts = np.r_[np.asarray(data.counts), np.zeros(2 * canaries.m, dtype=np.asarray(data.counts).dtype)]
    return replace(data, vocab=[*data.vocab, *canaries.words], counts=counts, train=train)


def init_canary_rows(model: CBOW, canaries: CanarySet, *, scale: float, generator: torch.Generator) -> None:
    """Set each canary's rows to orthonormal directions of norm ``scale`` (outputs) and ``IN_RATIO``·``scale``
    (inputs, untied) (module docstring), in place."""
    d = model.dim
    n = 2 if model.tied else 4
    if d < n:
        raise ConfigError(f"model.dim: the audit's canaries need dim >= {n}, got {d}")
    g = torch.randn(canaries.m, d, n, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(g)  # [m, D, n] orthonormal columns
    norms = torch.tensor([scale] * 2 if model.tied else [IN_RATIO * scale] * 2 + [scale] * 2, dtype=torch.float64)
    dirs = (norms.view(1, n, 1) * q.transpose(1, 2)).to(model.input.weight.dtype)  # [m, n, D]
    ids = canaries.vocab_size + torch.arange(2 * canaries.m).view(canaries.m, 2)
    with torch.no_grad():
        w_in = model.input.weight
        w_in[ids.to(w_in.device)] = dirs[:, :2].to(w_in.device)
        if model.output is not None:
            w_out = model.output.weight
            w_out[ids.to(w_out.device)] = dirs[:, 2:].to(w_out.device)
