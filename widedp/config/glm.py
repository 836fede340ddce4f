"""Config sections of the ``glm`` task (Brown category classification with a convex GLM): ``data:``, ``model:``,
``algorithm:``. Read by ``widedp.config`` (``TASK_SECTIONS["glm"]``).

A glm config::

    task: glm
    data: {preset: brown_glm, chunk_tokens: 100, vocab_size: 2000, norm: l2, ...}        -> GLMDataConfig
    model: {dtype: float32}                                                                -> GLMModelConfig
    train: {seed: 0, threads: 1, device: cpu}      (only seed, threads, device, log_every are used)
    algorithm: {name: dp_agd | frank_wolfe | output_perturbation | sparse_mean_gd | numeric_sparse | dpsgd |
                nonprivate, epsilon: 1.0, delta: 1e-5, ...}                               -> GLMAlgorithmConfig

There is no ``dp:`` section: each algorithm's privacy parameters live in ``algorithm:``. Algorithm-specific keys
default to null, meaning "the algorithm's default" (``ALGORITHM_DEFAULTS``); setting a key another algorithm owns is
an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from widedp.accounting.registry import accountant
from widedp.config.data import TokenFilter
from widedp.config.tools import check_input_file, data_cache_key, nonneg, positive
from widedp.errors import ConfigError

DATA_PRESETS: dict[str, dict[str, Any]] = {
    # Brown, 100-token chunks of the filtered text, V=2000 (train split only), log-tf, unit L2 rows, 15 categories.
    "brown_glm": {"corpus": "brown", "chunk_tokens": 100, "vocab_size": 2000, "weighting": "log", "norm": "l2",
                  "labels": "category", "splits": [0.6, 0.2, 0.2]},
    "custom": {},
}


@dataclass(frozen=True)
class GLMDataConfig(TokenFilter):
    """Documents -> sparse bag-of-words rows with a class label.

    Args:
        preset: ``brown_glm`` | ``custom``; the preset fills keys the config leaves out.
        corpus: ``brown`` (NLTK; label = the document's category) or ``text:PATH`` (UTF-8, one document per line,
            ``LABEL<TAB>TEXT``).
        chunk_tokens: split each document's filtered token stream into chunks of this many tokens (one sample
            each; the privacy unit is a chunk); 0 = one sample per document. min_chunk_tokens: shorter trailing
            chunks are dropped.
        vocab_size: V, the most frequent words of the TRAINING split only (ties alphabetical).
        weighting: ``tf`` (counts) | ``log`` (log(1 + tf)) | ``binary``.
        norm: ``l2`` (unit L2 rows: L2-Lipschitz sqrt(2), the default) | ``l1`` (unit L1 rows).
        bias_feature: value of a constant feature appended before normalisation (0 = no bias feature).
        labels: ``category`` (Brown's 15) | ``group`` (4 groups: press A-C, misc non-fiction D-G, learned/government
            H/J, fiction K-R; Brown only).
        splits: fractions (train, valid, test) of the documents or, with ``split_by: chunk``, of the chunks:
            record-local (each document or chunk's split comes from a key of its own, ``widedp.data_prep.splits``;
            sizes are Binomial).
        split_by: ``document`` (a document's chunks share its split) | ``chunk`` (each chunk has a split of its
            own).
        seed: seed of the record keys (need not be secret).
        max_docs: keep only the first N documents (0 = all) — for smoke runs.
        cache_dir: where prepared arrays are cached (keyed by these parameters); ``""`` turns caching off.
        lowercase, alpha_only, remove_stopwords: token filters (``TokenFilter``, as the cbow task's).
    """

    preset: Literal["brown_glm", "custom"] = "brown_glm"
    corpus: str = "brown"
    # documents -> chunks -> features
    chunk_tokens: int = 100
    min_chunk_tokens: int = 50
    vocab_size: int = 2000
    weighting: Literal["tf", "log", "binary"] = "log"
    norm: Literal["l2", "l1"] = "l2"
    bias_feature: float = 1.0
    # labels and splits
    labels: Literal["category", "group"] = "category"
    splits: tuple[float, float, float] = (0.6, 0.2, 0.2)
    split_by: Literal["document", "chunk"] = "document"
    seed: int = 0
    max_docs: int = 0
    cache_dir: str = ".cache/widedp"

    def __post_init__(self) -> None:
        positive("data.vocab_size", self.vocab_size)
        for key in ("chunk_tokens", "min_chunk_tokens", "max_docs", "bias_feature"):
            nonneg(f"data.{key}", getattr(self, key))
        if any(s < 0 for s in self.splits) or sum(self.splits) > 1 + 1e-9 or self.splits[0] <= 0:
            raise ConfigError(f"data.splits: need fractions >= 0 summing to <= 1 with a non-empty train split, got "
                              f"{list(self.splits)}")
        if not (self.corpus == "brown" or self.corpus.startswith("text:")):
            raise ConfigError(f"data.corpus: expected 'brown' or 'text:PATH', got {self.corpus!r}")
        if self.corpus.startswith("text:"):
            check_input_file("data.corpus", self.corpus[5:])
        if self.labels == "group" and self.corpus != "brown":
            raise ConfigError("data.labels: 'group' is defined for the Brown corpus only")

    def cache_key(self) -> str:
        """Hash of every parameter that changes the prepared arrays (not where they are cached)."""
        return data_cache_key(self, self.corpus[5:] if self.corpus.startswith("text:") else None)


@dataclass(frozen=True)
class GLMModelConfig:
    """Multinomial logistic regression W: [d, K], initialised at zero (every algorithm starts there).

    Args:
        dtype: ``float32`` | ``float64``, the dtype of W and of the feature rows.
    """

    kind: Literal["multinomial_logistic"] = "multinomial_logistic"
    dtype: Literal["float32", "float64"] = "float32"


ALGORITHMS = ("dp_agd", "frank_wolfe", "output_perturbation", "sparse_mean_gd", "numeric_sparse", "dpsgd",
              "nonprivate")

#: Per algorithm: its own keys and their defaults (a key listed for no algorithm is common to all).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    # Lee & Kifer: nominal T sets the initial per-iteration budget; clip = C_grad; loss_clip = C_obj.
    "dp_agd": {"iterations": 100, "clip": 1.0, "loss_clip": 3.0, "nmax_share": 0.1, "gamma": 0.1,
               "step_candidates": 10, "step_max": 2.0, "step_window": 10},
    # Polyhedral private Frank-Wolfe on the l1 ball of this radius; batch_size per iteration after the first batch.
    "frank_wolfe": {"iterations": 200, "radius": 50.0, "step": 0.0, "noise": "laplace", "first_batch_fraction": 0.5},
    "output_perturbation": {"l2_reg": 1e-3, "mechanism": "gaussian", "sparsity": 0, "radius": 0.0,
                            "solver_iterations": 1000},
    "sparse_mean_gd": {"iterations": 50, "lr": 2.0, "clip": 1.0, "batch_size": 0, "estimator": "projection",
                       "l1_radius": 0.0, "sparsity": 0, "block_size": 256, "measurement_ratio": 0.5},
    "numeric_sparse": {"iterations": 100, "lr": 2.0, "clip": 1.0, "batch_size": 500, "cutoff": 2000,
                       "threshold_scale": 3.0, "release_share": 0.05},
    "dpsgd": {"iterations": 100, "lr": 2.0, "clip": 1.0, "batch_size": 0},
    "nonprivate": {"l2_reg": 1e-4, "solver_iterations": 2000},
}
_PRIVATE = tuple(a for a in ALGORITHMS if a != "nonprivate")


@dataclass(frozen=True)
class GLMAlgorithmConfig:
    """One of the convex algorithms (``name``). The keys after ``rng`` belong to some algorithms only (a key set for
    an algorithm that has none is refused); null takes the algorithm's default.

    Args:
        name: the algorithm: ``dp_agd`` | ``frank_wolfe`` | ``output_perturbation`` | ``sparse_mean_gd`` |
            ``numeric_sparse`` | ``dpsgd`` | ``nonprivate``.
        epsilon: the target ε of the whole run (required for the private algorithms).
        delta: the δ of the reported (ε, δ).
        accountant: ``pld`` | ``rdp``, the reported ε (DP-AGD always reports zCDP).
        rng: ``secure`` (the default: the sampling and noise seeds come from the OS CSPRNG and are kept only in
            RUN/private/) | ``reproducible`` (derived from train.seed, for tests and debugging -- the run is NOT
            private).
        iterations: T, the number of iterations (dp_agd: nominal, it sets the initial per-iteration budget).
        lr: the step size.
        clip: the per-sample gradient clip (l2; numeric_sparse: l_inf; dp_agd: C_grad).
        batch_size: dpsgd: 0 = full batch (the mean over the dataset's own n, sensitivity 2 clip / n), else Poisson
            with this expected size as the fixed denominator (sensitivity clip / b); sparse_mean_gd: 0 = full batch;
            numeric_sparse: the expected group size (>= n: full batch, sensitivity 2 clip / n).
        loss_clip: C_obj, the clip of the per-sample loss in DP-AGD's step choice.
        nmax_share: the share of a DP-AGD step's budget spent on NoisyMax.
        gamma: DP-AGD's budget growth when no step helps.
        step_candidates: the number of step sizes DP-AGD chooses among.
        step_max: DP-AGD's initial largest step.
        step_window: tau, DP-AGD's steps between step-set updates.
        radius: frank_wolfe: the l1 ball's radius; output_perturbation: R of the feasible L2 ball X (0 = L /
            lambda).
        step: Frank-Wolfe's constant eta in (0, 1] (0 = 1/sqrt(T)).
        noise: Frank-Wolfe's oracle, ``laplace`` | ``gumbel``.
        first_batch_fraction: Frank-Wolfe's probability that a sample goes to the first batch (otherwise to one of
            the T - 1 later batches).
        l2_reg: lambda, the L2 regularisation (output_perturbation, nonprivate).
        mechanism: output perturbation's noise, ``gaussian`` | ``laplace``.
        sparsity: s, the sparsity bound of a gradient (0 = (chunk_tokens + 1) * K): output_perturbation: of the
            poster's Laplace formula, reported only; sparse_mean_gd: the projection's l1 radius is clip * sqrt(s).
        solver_iterations: iterations of the (non-private or output-perturbed) solver; the private solver runs at
            least the k* iterations that bound its residual.
        estimator: sparse_mean_gd's mean estimator, ``gaussian`` | ``projection`` | ``l1_recovery``.
        l1_radius: sparse_mean_gd's projection radius (0 = clip * sqrt(sparsity)).
        block_size: ``l1_recovery``'s blocks of coordinates.
        measurement_ratio: ``l1_recovery``'s rows per block coordinate (m_b = ceil(ratio * block_size)).
        cutoff: c1, the most coordinates NumericSparse releases per iteration.
        threshold_scale: alpha, NumericSparse's threshold in units of the query-noise scale.
        release_share: eps2 / (eps1 + eps2), NumericSparse's share of the budget spent on the released values.
    """

    name: Literal["dp_agd", "frank_wolfe", "output_perturbation", "sparse_mean_gd", "numeric_sparse", "dpsgd",
                  "nonprivate"] = "dpsgd"
    epsilon: float | None = None
    delta: float = 1e-5
    accountant: str = "pld"  # a headline accountant of widedp.accounting.registry
    rng: Literal["secure", "reproducible"] = "secure"
    # gradient methods (dpsgd, dp_agd, sparse_mean_gd, numeric_sparse)
    iterations: int | None = None
    lr: float | None = None
    clip: float | None = None
    batch_size: int | None = None
    # dp_agd's adaptive step
    loss_clip: float | None = None
    nmax_share: float | None = None
    gamma: float | None = None
    step_candidates: int | None = None
    step_max: float | None = None
    step_window: int | None = None
    # frank_wolfe
    radius: float | None = None
    step: float | None = None
    noise: Literal["laplace", "gumbel"] | None = None
    first_batch_fraction: float | None = None
    # output_perturbation, nonprivate
    l2_reg: float | None = None
    mechanism: Literal["gaussian", "laplace"] | None = None
    sparsity: int | None = None
    solver_iterations: int | None = None
    # sparse_mean_gd
    estimator: Literal["gaussian", "projection", "l1_recovery"] | None = None
    l1_radius: float | None = None
    block_size: int | None = None
    measurement_ratio: float | None = None
    # numeric_sparse
    cutoff: int | None = None
    threshold_scale: float | None = None
    release_share: float | None = None

    def __post_init__(self) -> None:
        try:
            accountant(self.accountant)
        except ConfigError as e:
            raise ConfigError(str(e).replace("dp.accountant", "algorithm.accountant", 1)) from None
        own = ALGORITHM_DEFAULTS[self.name]
        for f in dataclasses.fields(self):
            if f.name in ("name", "epsilon", "delta", "accountant", "rng") or getattr(self, f.name) is None:
                continue
            if f.name not in own:
                raise ConfigError(f"algorithm.{f.name}: not a key of algorithm {self.name!r} "
                                  f"(its keys: {', '.join(sorted(own))})")
        if self.name in _PRIVATE:
            if self.epsilon is None or not self.epsilon > 0:
                raise ConfigError(f"algorithm.epsilon: algorithm {self.name!r} needs a target epsilon > 0, got "
                                  f"{self.epsilon}")
        elif self.epsilon is not None:
            raise ConfigError("algorithm.epsilon: the nonprivate algorithm takes no epsilon")
        if not 0 < self.delta < 1:
            raise ConfigError(f"algorithm.delta: must be in (0, 1), got {self.delta}")
        for key in ("iterations", "lr", "clip", "loss_clip", "gamma", "step_candidates", "step_max", "step_window",
                    "l2_reg", "solver_iterations", "block_size", "cutoff", "threshold_scale"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ConfigError(f"algorithm.{key}: must be > 0, got {v}")
        for key in ("batch_size", "step", "sparsity", "l1_radius", "radius"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"algorithm.{key}: must be >= 0, got {v}")
        if self.name == "frank_wolfe" and self.radius == 0:
            raise ConfigError("algorithm.radius: the l1 ball of frank_wolfe needs a radius > 0")
        if self.step is not None and self.step > 1:
            raise ConfigError(f"algorithm.step: Frank-Wolfe's step is a convex weight in (0, 1] (0 = 1/sqrt(T)), got "
                              f"{self.step}")
        for key in ("nmax_share", "first_batch_fraction", "measurement_ratio", "release_share"):
            v = getattr(self, key)
            if v is not None and not 0 < v < 1:
                raise ConfigError(f"algorithm.{key}: must be in (0, 1), got {v}")

    def get(self, key: str) -> Any:
        """The key's value, or the algorithm's default when it is null."""
        v = getattr(self, key)
        return ALGORITHM_DEFAULTS[self.name].get(key) if v is None else v


DATA_CONFIG = GLMDataConfig
MODEL_CONFIG = GLMModelConfig
ALGORITHM_CONFIG = GLMAlgorithmConfig
