"""The DP vocabulary (``data.vocabulary: dp``): Gaussian partition selection of the words, charged to the run.

Mechanism (the weighted Gaussian policy of Gopi et al. 2020, "Differentially private set union"; Google's DP
partition selection is the same shape):

1. Units are the corpus's sentences or documents (``data.privacy_unit``) after the public token filters. Unit u
   keeps its first k distinct words in order of first appearance (k = ``data.vocab_dp.max_words_per_unit``: a rule
   applied to each unit alone) and adds 1/sqrt(n_u) to the count of each of its n_u <= k kept words.
2. Sensitivity: adding or removing one unit changes the count vector by a vector with n_u entries 1/sqrt(n_u):
   l2 norm exactly 1 (l_inf <= 1), whatever n_u is. (Weight 1 per word would be l2 sqrt(k); 1/sqrt(n_u) rather
   than 1/sqrt(k) spends the same budget and lets short units count more.)
3. N(0, sigma²) is added to the count of every word the corpus has (sigma = ``noise_multiplier``, relative to the
   sensitivity 1); the words whose noisy count exceeds tau are candidates, and the ``vocab_size`` largest noisy
   counts among them are kept (post-processing); their noisy counts are the negative-sampling weights.
4. tau: a word only the added unit has (absent from the neighbour) has count 1/sqrt(n) and is released with
   probability Phi_bar((tau - 1/sqrt(n))/sigma); some of the unit's n new words is released with probability
   1 - Phi((tau - 1/sqrt(n))/sigma)^n (independent noise). tau is the smallest value with
   max_{1<=n<=k} [1 - Phi((tau - 1/sqrt(n))/sigma)^n] <= delta_tau (``vocab_dp.delta``).

Privacy (``widedp.run.plan``): restricted to the words both neighbours have, the release is the Gaussian
mechanism with sensitivity 1, noise multiplier sigma (post-processed); the event "a new word is released" has
probability <= delta_tau and is independent of that Gaussian's noise. So, composed adaptively with training
(ledger: this Gaussian as a step at sampling rate 1, then the training steps), with (eps_L, delta_L) the ledger's
guarantee: adding a unit: P[M(D') in S] <= e^eps_L P[M(D) in S] + delta_L + delta_tau; removing it:
P[M(D) in S] <= e^eps_L P[M(D') in S] / (1 - delta_tau) + delta_L. The run reports
(eps_L(delta - delta_tau) + ln(1/(1 - delta_tau)), delta), delta = ``dp.delta``, which covers both directions.

Randomness: a torch.Generator seeded from the run's secret noise seed (``vocab_seed``), so the vocabulary is as
secret as the training noise (reproducible, and NOT private, with ``dp.rng: reproducible``). The release is drawn
once per run and kept in ``RUN/vocab_release.json`` (words, noisy counts, the mechanism's parameters): a resumed or
canary run loads it and never draws again, the run's ledger holds its spend, and nothing is cached in
``data.cache_dir`` (a shared cache would let another run reuse, i.e. re-release, or re-draw from the same seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from widedp.data_prep import corpus as corpus_mod
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.run.checkpoint import read_json, write_json

RELEASE_FILE = "vocab_release.json"
_FORMAT = "widedp.vocab_release/1"


@dataclass(frozen=True)
class VocabRelease:
    """A released DP vocabulary. words: [V] most-counted first; noisy_counts: [V] float64 their noisy counts;
    mechanism: unit, k, sigma, tau, delta_tau and the sensitivity (1), as stored in ``RUN/vocab_release.json``."""

    words: list[str]
    noisy_counts: np.ndarray
    mechanism: dict[str, Any]

    def vocab(self, corpus: corpus_mod.Corpus) -> corpus_mod.Vocab:
        """The ``Vocab`` of this release over ``corpus`` (negative-sampling weights = the noisy counts)."""
        return corpus_mod.vocab_from_words(corpus, self.words, self.noisy_counts)

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "words": self.words, "noisy_counts": self.noisy_counts.tolist(),
                "mechanism": self.mechanism}


def unit_word_weights(corpus: corpus_mod.Corpus, *, unit: str, max_words: int) -> np.ndarray:
    """[W] float64 weighted counts: sum over units u of 1/sqrt(n_u) for each of u's first n_u <= ``max_words``
    distinct words (order of first appearance); ``unit``: ``sentence`` | ``document``."""
    sent = corpus.sentence_of_token()
    uid = sent if unit == "sentence" else corpus.document_of_sentence()[sent]
    w_count = len(corpus.words)
    uniq, first = np.unique(uid * w_count + corpus.ids, return_index=True)  # distinct (unit, word), first position
    u, w = uniq // w_count, uniq % w_count
    order = np.lexsort((first, u))  # by unit, then first appearance
    u, w = u[order], w[order]
    new = np.r_[True, u[1:] != u[:-1]] if len(u) else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    sizes = np.diff(np.r_[starts, len(u)])
    rank = np.arange(len(u)) - np.repeat(starts, sizes)
    keep = rank < max_words
    n_u = np.repeat(np.minimum(sizes, max_words), sizes)
    return np.bincount(w[keep], weights=1.0 / np.sqrt(n_u[keep]), minlength=w_count)


def threshold_delta(tau: float, *, sigma: float, max_words: int) -> float:
    """max over 1 <= n <= k of P[some of n words only one unit has is released] = 1 - Phi((tau - 1/sqrt(n))/sigma)^n."""
    n = np.arange(1, max_words + 1)
    log_keep = n * stats.norm.logcdf((tau - 1.0 / np.sqrt(n)) / sigma)  # log Phi(.)^n
    return float(np.max(-np.expm1(log_keep)))


def threshold(*, sigma: float, max_words: int, delta: float) -> float:
    """The smallest tau with ``threshold_delta(tau) <= delta``:
    max over 1 <= n <= k of 1/sqrt(n) + sigma Phi^-1((1 - delta)^(1/n))."""
    n = np.arange(1, max_words + 1)
    tail = -np.expm1(np.log1p(-delta) / n)  # 1 - (1 - delta)^(1/n), accurately
    return float(np.max(1.0 / np.sqrt(n) + sigma * stats.norm.isf(tail)))


def noisy_counts(counts: np.ndarray, *, sigma: float, generator: torch.Generator) -> np.ndarray:
    """counts [W] + N(0, sigma²) on every word the corpus has (count > 0); -inf for the others (never released)."""
    present = counts > 0
    noise = torch.randn(int(present.sum()), generator=generator, dtype=torch.float64).numpy()
    out = np.full(len(counts), -np.inf)
    out[present] = counts[present] + sigma * noise
    return out


def select(noisy: np.ndarray, *, tau: float, max_size: int) -> np.ndarray:
    """Ids of the ``max_size`` largest noisy counts above ``tau``, largest first (post-processing)."""
    above = np.flatnonzero(noisy > tau)
    return above[np.argsort(-noisy[above], kind="stable")][:max_size]


def draw_release(data_cfg: Any, *, generator: torch.Generator) -> VocabRelease:
    """Run the mechanism (module docstring) on ``data_cfg``'s corpus with ``generator``."""
    v = data_cfg.vocab_dp
    corpus = corpus_mod.load_corpus(data_cfg)
    counts = unit_word_weights(corpus, unit=data_cfg.privacy_unit, max_words=v.max_words_per_unit)
    tau = threshold(sigma=v.noise_multiplier, max_words=v.max_words_per_unit, delta=v.delta)
    noisy = noisy_counts(counts, sigma=v.noise_multiplier, generator=generator)
    ids = select(noisy, tau=tau, max_size=data_cfg.vocab_size)
    if len(ids) < 3:
        raise ConfigError(f"data.vocabulary: dp released only {len(ids)} word(s) above tau={tau:.3g}; lower "
                          "data.vocab_dp.noise_multiplier or raise its delta (or use a larger corpus)")
    mech = {"unit": data_cfg.privacy_unit, "max_words_per_unit": v.max_words_per_unit,
            "noise_multiplier": v.noise_multiplier, "sensitivity": 1.0, "threshold": tau, "delta": v.delta,
            "threshold_delta": threshold_delta(tau, sigma=v.noise_multiplier, max_words=v.max_words_per_unit),
            "vocab_size_max": data_cfg.vocab_size, "released": len(ids)}
    return VocabRelease([str(w) for w in corpus.words[ids]], noisy[ids], mech)


def vocab_seed(noise_seed: int) -> int:
    """A 62-bit seed for the vocabulary noise derived from the run's (secret) noise seed: SHA-256 keeps it as secret
    as that seed and independent of the training noise stream."""
    return rng.derived_seed(noise_seed, "widedp-vocab-dp")


def load_release(run_dir: Path) -> VocabRelease | None:
    """``RUN/vocab_release.json`` (None when there is none)."""
    path = run_dir / RELEASE_FILE
    if not path.is_file():
        return None
    d = read_json(path)
    if not isinstance(d, dict) or d.get("format") != _FORMAT:
        raise ConfigError(f"{path}: not a widedp vocabulary release")
    return VocabRelease(list(d["words"]), np.asarray(d["noisy_counts"], dtype=np.float64), dict(d["mechanism"]))


def run_release(data_cfg: Any, run_dir: Path, *, noise_seed: int, resumed: bool = False) -> VocabRelease:
    """The run's DP vocabulary: loaded from ``run_dir`` when it holds one (resume, canary runs), else drawn with the
    generator of ``vocab_seed(noise_seed)`` and written there (atomically) before anything uses it. A ``resumed``
    run without it is refused: the ledger charges one draw, and the seed may be new (lost ``private/``)."""
    found = load_release(run_dir)
    if found is not None:
        _check_matches(found, data_cfg, run_dir)
        return found
    if resumed:
        raise ConfigError(f"{run_dir / RELEASE_FILE}: missing, so the run's DP vocabulary is lost (a new draw would "
                          "be a second release, and the weights belong to the first); start a new run directory")
    gen = rng.generator(vocab_seed(noise_seed))
    release = draw_release(data_cfg, generator=gen)
    write_json(run_dir / RELEASE_FILE, release.to_json())
    return release


def _check_matches(release: VocabRelease, data_cfg: Any, run_dir: Path) -> None:
    v, m = data_cfg.vocab_dp, release.mechanism
    want = {"unit": data_cfg.privacy_unit, "max_words_per_unit": v.max_words_per_unit,
            "noise_multiplier": v.noise_multiplier, "delta": v.delta}
    if any(m.get(k) != x for k, x in want.items()) or not math.isfinite(float(m.get("threshold", math.nan))):
        raise ConfigError(f"{run_dir / RELEASE_FILE}: drawn with other data.vocab_dp parameters ({m}); start a new "
                          "run directory")
