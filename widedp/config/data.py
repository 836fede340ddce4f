"""The ``data:`` section of the CBOW task (``widedp.config`` re-exports everything here): text preprocessing, the
privacy unit and the vocabulary."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from widedp.config.tools import check_input_file, check_splits, data_cache_key, nonneg, positive
from widedp.errors import ConfigError

#: Named preprocessing presets; explicit keys in ``data:`` override them.
DATA_PRESETS: dict[str, dict[str, Any]] = {
    # The paper's Sec. 6 setting: V=1000, window 4, 8 negatives, 200K/100K/200K (target, context) pairs expected:
    # fractions of Brown's 979,216 pairs (a fraction, unlike a count, does not depend on the data's size).
    "paper": {"corpus": "brown", "vocab_size": 1000, "window": 4, "negatives": 8, "sample_shape": "pair",
              "splits": [0.20425, 0.10212, 0.20425]},
    # The whole Brown corpus with V=10,000 (splits: every sample, 60/20/20 by fraction).
    "brown_10k": {"corpus": "brown", "vocab_size": 10_000, "window": 4, "negatives": 8, "sample_shape": "pair",
                  "splits": [0.6, 0.2, 0.2]},
    # The whole Brown vocabulary: every word left after the filters that occurs >= 5 times in the corpus
    # (13,232 words of 40,097; they cover 463,133 of 509,267 tokens), 2,652,900 pairs, 60/20/20. vocab_size is that
    # count, so that it is V; min_count is the rule (a larger vocab_size adds no rarer word).
    "brown_full": {"corpus": "brown", "vocab_size": 13_232, "min_count": 5, "window": 4, "negatives": 8,
                   "sample_shape": "pair", "splits": [0.6, 0.2, 0.2]},
    "custom": {},
}


#: ``data.privacy_unit`` values of the CBOW task.
PRIVACY_UNITS = ("pair", "sentence", "document")


@dataclass(frozen=True)
class VocabDPConfig:
    """``data.vocab_dp``: the DP vocabulary (``data.vocabulary: dp``; ``widedp.dp.vocab``).

    Each unit (sentence or document of the corpus) keeps its first ``max_words_per_unit`` distinct words (order of
    first appearance) and adds 1/sqrt(n_u) to each of its n_u kept words' counts (l2 sensitivity 1); N(0, sigma²)
    is added to every word's count; the words above the threshold tau (solved so that a word only one unit has is
    released with probability <= ``delta``) are candidates and the top ``data.vocab_size`` of them are kept.

    Args:
        max_words_per_unit: k, distinct words one unit contributes to at most.
        noise_multiplier: sigma, the std of the count noise (the sensitivity is 1).
        delta: delta_tau, the threshold's share of the run's dp.delta (must be below it).
    """

    max_words_per_unit: int = 32
    noise_multiplier: float = 4.0
    delta: float = 1e-6

    def __post_init__(self) -> None:
        positive("data.vocab_dp.max_words_per_unit", self.max_words_per_unit)
        positive("data.vocab_dp.noise_multiplier", self.noise_multiplier)
        if not 0 < self.delta < 1:
            raise ConfigError(f"data.vocab_dp.delta: must be in (0, 1), got {self.delta}")


@dataclass(frozen=True)
class TokenFilter:
    """The token filters of the text tasks (cbow and glm ``data:``), applied in this order by
    ``widedp.data_prep.corpus.apply_filters``: lowercase, alphabetic tokens only, NLTK's English stop words removed
    (the paper: all true)."""

    lowercase: bool = True
    alpha_only: bool = True
    remove_stopwords: bool = True


@dataclass(frozen=True)
class DataConfig(TokenFilter):
    """Preprocessing of a text corpus into CBOW samples.

    Args:
        preset: ``paper`` | ``brown_10k`` | ``brown_full`` | ``custom``; the preset fills keys the config leaves
            out.
        corpus: ``brown`` | ``text:PATH`` (a local UTF-8 file, one document or sentence per line) |
            ``hf:NAME[:CONFIG]`` (a Hugging Face ``datasets`` text dataset; see ``hf_split`` / ``hf_column``).
        vocab_size: V, the number of most frequent words kept (after stop-word removal).
        min_count: keep only words occurring at least this often (after the filters), at most ``vocab_size`` of
            them (1 = no minimum); only with ``vocabulary: private_top``.
        window: context window; the context of a target is the ``window`` nearest in-vocabulary words on each side,
            within its sentence (979,216 pairs on Brown with the paper preset).
        negatives: negative samples per sample, drawn from unigram^0.75, never equal to the target.
        negatives_pool: M > 0: in DP training (``dp.engine: widedp``) every step draws a pool of M ids i.i.d. from
            unigram^0.75, a function of the run's sampling seed, the step and that law only (never of the batch: the
            law is public or released, except with ``private_top``, not covered), and each sample's ``negatives``
            are drawn uniformly from that pool instead of its stored ones (a pick equal to the sample's target moves
            to the next pool entry). The pool's output rows are then public for the step:
            noised every step for free, left out of the selection's scores (``dp_step``'s ``public_rows``). 0 = the
            negatives stored with each sample. Evaluation always uses the stored ones.
        sample_shape: ``pair`` (target + one context word, the paper's) or ``bag`` (target + its whole window).
        splits: train / valid / test: fractions of all samples summing to <= 1, or expected counts (rate n / N
            over the N samples: the rate then depends on the data's size, which the privacy statement lists). Each
            sample's split is drawn from a key of its own record (``widedp.data_prep.splits``), so sizes are
            Binomial, and for a fixed vocabulary (``file:``, ``wordfreq`` or ``dp``) adding or removing a unit
            changes no other sample's split.
        seed: seed of the record keys (the splits and the stored negatives); need not be secret.
        lowercase, alpha_only, remove_stopwords: token filters (``TokenFilter``).
        max_sentences: keep only the first N sentences (0 = all) — for smoke tests.
        hf_split: split of an ``hf:`` corpus.
        hf_column: text column of an ``hf:`` corpus.
        cache_dir: where prepared id arrays are cached (keyed by these parameters); "" turns caching off.
        privacy_unit: what one DP guarantee protects: ``pair`` (one sample) | ``sentence`` | ``document`` (Brown:
            a source file; ``text:``: a block of lines between blank lines; ``hf:``: a row). With a unit other than
            ``pair``, DP training Poisson-samples units (train.batch_size = the expected number of UNITS per batch),
            every drawn unit brings all its train samples, and each unit's summed gradient is clipped at S1.
        max_samples_per_unit: m, a unit keeps only its first m train samples in corpus order (target position, then
            context position): a rule applied to each unit alone. Part of the statement ("≤ m pairs").
        vocabulary: ``private_top`` (the top-V words of the corpus: NOT private; a warning, and every statement says
            so) | ``dp`` (DP partition selection, ``vocab_dp``; needs a sentence or document unit) | ``file:PATH``
            (a public list, one word per line, optionally ``word count``; without counts the negatives follow a Zipf
            law over the file's order, p(rank r) ∝ 1/r, before the usual ^0.75) | ``wordfreq`` or ``wordfreq:LANG``
            (public, default ``en``: the first ``vocab_size`` words of the wordfreq package's ``best`` list for LANG
            that pass the token filters, with its frequencies for the negatives; wordfreq 3.1.1, data frozen in
            2021, CC BY-SA 4.0; the ``vocab`` extra; needs ``lowercase``).
        vocab_dp: the DP vocabulary's parameters (``VocabDPConfig``).
    """

    preset: Literal["paper", "brown_10k", "brown_full", "custom"] = "paper"
    corpus: str = "brown"
    vocab_size: int = 1000
    min_count: int = 1
    window: int = 4
    negatives: int = 8
    negatives_pool: int = 0
    sample_shape: Literal["pair", "bag"] = "pair"
    splits: tuple[float, ...] = (0.20425, 0.10212, 0.20425)
    seed: int = 0
    max_sentences: int = 0
    hf_split: str = "train"
    hf_column: str = "text"
    cache_dir: str = ".cache/widedp"
    privacy_unit: Literal["pair", "sentence", "document"] = "pair"
    max_samples_per_unit: int = 32
    vocabulary: str = "private_top"
    vocab_dp: VocabDPConfig = field(default_factory=VocabDPConfig)

    def __post_init__(self) -> None:
        positive("data.vocab_size", self.vocab_size)
        positive("data.min_count", self.min_count)
        if self.min_count > 1 and self.vocabulary != "private_top":
            raise ConfigError(f"data.min_count: applies to the top-V vocabulary (data.vocabulary: private_top), not "
                              f"to {self.vocabulary!r}")
        positive("data.max_samples_per_unit", self.max_samples_per_unit)
        if not (self.vocabulary in ("private_top", "dp", "wordfreq") or self.vocabulary.startswith(("file:",
                                                                                                "wordfreq:"))):
            raise ConfigError(f"data.vocabulary: expected private_top, dp, file:PATH, wordfreq or wordfreq:LANG, got "
                              f"{self.vocabulary!r}")
        if self.wordfreq_lang is not None:
            if not re.fullmatch(r"[a-z]{2,3}", self.wordfreq_lang):
                raise ConfigError(f"data.vocabulary: wordfreq:LANG takes a language code such as en or fr, got "
                                  f"{self.vocabulary!r}")
            if not self.lowercase:
                raise ConfigError("data.vocabulary: wordfreq's lists are lower case; they need data.lowercase: true")
        if self.vocabulary.startswith("file:"):
            check_input_file("data.vocabulary", self.vocabulary[5:])
        if self.vocabulary == "dp" and self.privacy_unit == "pair":
            raise ConfigError("data.vocabulary: dp counts words per sentence or document; it needs "
                              "data.privacy_unit: sentence or document (a pair is not a unit of the corpus)")
        positive("data.window", self.window)
        nonneg("data.negatives", self.negatives)
        nonneg("data.negatives_pool", self.negatives_pool)
        if self.negatives_pool and not self.negatives:
            raise ConfigError("data.negatives_pool: needs data.negatives > 0 (the pool is where negatives come from)")
        nonneg("data.max_sentences", self.max_sentences)
        check_splits(self.splits)
        if not (self.corpus == "brown" or self.corpus.startswith(("text:", "hf:"))):
            raise ConfigError(f"data.corpus: expected 'brown', 'text:PATH' or 'hf:NAME', got {self.corpus!r}")
        if self.corpus.startswith("text:"):
            check_input_file("data.corpus", self.corpus[5:])

    @property
    def wordfreq_lang(self) -> str | None:
        """The language of ``data.vocabulary: wordfreq[:LANG]`` (``en`` when left out); None for other vocabularies."""
        if self.vocabulary == "wordfreq":
            return "en"
        return self.vocabulary[9:] if self.vocabulary.startswith("wordfreq:") else None

    def cache_key(self) -> str:
        """Hash of every parameter that changes the prepared arrays (not where they are cached, nor the DP
        vocabulary's parameters: a DP vocabulary's arrays are never cached). The privacy unit is in: it keys the
        record-local split (``widedp.data_prep.splits``)."""
        plain = dataclasses.replace(self, max_samples_per_unit=32, vocab_dp=VocabDPConfig())
        drop = ("negatives_pool",)  # drawn at each step, not prepared
        key = data_cache_key(plain, self.corpus[5:] if self.corpus.startswith("text:") else None, drop=drop)
        if self.vocabulary.startswith("file:"):
            key = data_cache_key(plain, self.vocabulary[5:], drop=drop) + key
        if self.wordfreq_lang is not None:  # the list is the installed wordfreq's data
            key = hashlib.sha256(f"{key} wordfreq {_installed('wordfreq')}".encode()).hexdigest()[:16]
        return key

    @staticmethod
    def hash_view(d: dict[str, Any]) -> dict[str, Any]:
        """``d`` (this section as a dict) without the privacy-unit, vocabulary and pool keys left at their defaults,
        so that runs recorded before those keys existed keep their config hash (resume, ``widedp compare``'s reuse)."""
        defaults = {"privacy_unit": "pair", "max_samples_per_unit": 32, "vocabulary": "private_top", "min_count": 1,
                    "vocab_dp": dataclasses.asdict(VocabDPConfig()), "negatives_pool": 0}
        return {k: v for k, v in d.items() if not (k in defaults and v == defaults[k])}


def _installed(package: str) -> str:
    """The installed version of ``package``, or "none"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"
