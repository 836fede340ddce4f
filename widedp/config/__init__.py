"""YAML -> frozen dataclasses. Unknown keys, wrong types and impossible values raise ``ConfigError`` naming the key.

A training config has four sections::

    data:  {preset, corpus, vocab_size, window, negatives, sample_shape, splits, seed, ...}   -> DataConfig
    model: {dim, tied, sparse, init_scale, init_vectors, init_output}                           -> ModelConfig
    train: {epochs, batch_size, optimizer, lr, seed, ...}                                       -> TrainConfig
    dp:    {clip1, clip2, noise_multiplier, delta, rng, selection: {name: ..., ...}}            -> DPConfig | None

``--set a.b.c=value`` overrides are applied to the raw mapping before validation (value parsed as YAML).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from widedp.accounting.registry import accountant
from widedp.config import glm, module, recsys  # the other tasks' sections (TASK_SECTIONS)

# the data: section (DataConfig, VocabDPConfig, DATA_PRESETS) lives in widedp.config.data, re-exported here
from widedp.config.data import DATA_PRESETS, PRIVACY_UNITS, DataConfig, VocabDPConfig  # noqa: F401
from widedp.config.selection import (  # noqa: F401  (the dp.selection section lives there, re-exported here)
    SELECTIONS,
    AllRowsConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    PreselectConfig,
    RandomSparsificationConfig,
    SelectionConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
    refuse_renamed_method,
)
from widedp.config.tools import (
    apply_overrides,
    build,
    expect_mapping,
    no_unknown,
    nonneg,
    positive,
    read_config_file,
    section,
    show,
)
from widedp.dp.spend import DISCRETE_PLD_REFUSED
from widedp.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelConfig:
    """CBOW with negative sampling.

    Args:
        dim: embedding size D.
        tied: one table for context and output (the paper's V x D parameters) or two.
        sparse: sparse gradients from the EmbeddingBag / Embedding (non-private SparseAdam needs it).
        init_scale: input rows ~ U(-init_scale/D, init_scale/D) (0.5: word2vec's init); untied output rows are zeros.
        init_vectors: PATH of word vectors in word2vec text or binary format (gensim's ``save_word2vec_format``; the
            ``eval`` extra reads them): a public warm start. Each vocabulary word with a vector there (matched
            exactly) starts from it in the input table; the other rows keep the init above. Applied to a new run
            only (a resumed run's checkpoint holds the weights). ASSUMED PUBLIC: the statement names the file and its
            sha256, and ε does not cover the vectors if they were derived from private data
            (``widedp.models.init_vectors``). One process only.
        init_output: with ``init_vectors`` and untied tables, the output table's found rows: ``zeros`` (word2vec's
            output init, as gensim's ``intersect_word2vec_format`` leaves it) | ``vectors`` (the same vectors).
    """

    kind: Literal["cbow"] = "cbow"
    dim: int = 100
    tied: bool = True
    sparse: bool = True
    init_scale: float = 0.5
    init_vectors: str | None = None
    init_output: Literal["zeros", "vectors"] = "zeros"

    def __post_init__(self) -> None:
        positive("model.dim", self.dim)
        positive("model.init_scale", self.init_scale)
        if self.init_vectors is not None and not self.init_vectors.strip():
            raise ConfigError("model.init_vectors: an empty path (give a word2vec file, or leave the key out)")
        if self.init_output != "zeros" and self.init_vectors is None:
            raise ConfigError(f"model.init_output: {self.init_output} needs model.init_vectors")
        if self.init_output == "vectors" and self.tied:
            raise ConfigError("model.init_output: vectors applies to untied tables; a tied model's one table takes "
                              "the vectors already (leave init_output out)")

    @staticmethod
    def hash_view(d: dict[str, Any]) -> dict[str, Any]:
        """The model section as the config hash sees it: keys added later hash only when set."""
        d = dict(d)
        if d.get("init_vectors") is None:
            d.pop("init_vectors", None)
        if d.get("init_output") == "zeros":
            d.pop("init_output", None)
        return d


# ---------------------------------------------------------------------------------------------------------- train


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, logging and checkpoints.

    Args:
        epochs: passes over the train split (with DP: n/b Poisson steps per epoch).
        batch_size: b; with DP the *expected* batch size of Poisson sampling and the fixed denominator.
        optimizer: non-private: ``sgd`` | ``adam`` (dense) | ``sparse_adam``; DP: ``sgd`` | ``lazy_adam`` (updates
            only selected rows' moments) | ``adam`` (dense moments, the paper's).
        lr: learning rate. betas, eps: Adam's.
        seed: seeds the model init (public); with ``dp.rng: reproducible`` also the batches, selection and
            noise (then the run is NOT private).
        device: ``auto`` (CUDA when available) | ``cpu`` | ``cuda`` | ``cuda:N``.
        threads: torch intra-op threads (0 = leave torch's default).
        log_every: steps between logged statistics. checkpoint_every: steps between checkpoints (0 = only at the
            end and at epoch ends). eval_batch_size: batch size of validation/test loss evaluation.
        max_steps: stop after this many steps in total (0 = no limit) — smoke runs.
        eval_max_samples: evaluate on at most this many samples of valid/test (0 = all).
        keep_best: end with the weights of the epoch with the lowest validation loss (checked at epoch ends), not
            the last epoch's; the summary names the epoch kept.
    """

    # how long, how big
    epochs: int = 20
    batch_size: int = 20
    max_steps: int = 0
    # the optimizer
    optimizer: Literal["sgd", "adam", "sparse_adam", "lazy_adam"] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # where it runs
    seed: int = 0
    device: str = "auto"
    threads: int = 1
    # logging, evaluation, checkpoints
    log_every: int = 1000
    checkpoint_every: int = 0
    eval_batch_size: int = 4096
    eval_max_samples: int = 0
    keep_best: bool = False

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "lr", "log_every", "eval_batch_size"):
            positive(f"train.{key}", getattr(self, key))
        for key in ("checkpoint_every", "max_steps", "threads"):
            nonneg(f"train.{key}", getattr(self, key))
        nonneg("train.eval_max_samples", self.eval_max_samples)
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"train.seed: must be in [0, 2^63), got {self.seed}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


# ------------------------------------------------------------------------------------------------------------- dp


@dataclass(frozen=True)
class DPConfig:
    """The DP step (paper Alg. 3) and its accounting.

    Args:
        clip1: S1, per-sample L2 clip.
        clip2: S2, L2 clip of the selected gradient (null = no second clip).
        noise_multiplier: sigma, relative to the sensitivity min(S1/b, 2*S2) of the selected gradient.
        delta: the delta of the reported (epsilon, delta); a new run refuses one at or above 1/N for its N training
            units (``allow_large_delta``).
        rng: ``secure`` (default: sampling, selection and noise seeded from the OS CSPRNG, seeds kept only in
            RUN/private/) | ``reproducible`` (derived from train.seed, for tests and debugging: NOT private).
        noise: the step's noise: ``gaussian`` (default: torch's continuous sampler, x + N(0, (σΔ₂)²) in floating
            point) | ``secure`` (Δ̂ rounded onto a power-of-two grid plus discrete Gaussian noise, the released
            values a function of an integer only: no floating-point artefact of the sampler reaches them;
            ``widedp.dp.noise.snapped_release``). Secure needs ``accountant: rdp`` (RDP only, σ charged as
            σ/(1 + 2^-10)), the widedp engine, and no other release of continuous noisy values
            (``selection.release_values``, ``data.vocabulary: dp``).
        accountant: ``pld`` (headline) | ``rdp``. (``paper``, the paper's Theorem 3, is refused: not a valid bound;
            ``widedp epsilon`` shows its figure as a labelled reference.)
        target_epsilon: stop training before the spent epsilon would exceed it (and calibrate, see ``calibrate``).
        calibrate: with target_epsilon: ``none`` | ``noise_multiplier`` (solve sigma) | ``selection_epsilon``
            (solve the selection's epsilon; for ``gaussian_threshold`` its sigma).
        selection: the row-selection mechanism, ``{name: exponential | sparse_vector | uniform |
            random_sparsification | all | gaussian_threshold, ...}``.
        preselect: optional one-shot DP pre-selection of rows before the first step (``PreselectConfig``;
            charged once); every step's selection then ranges over the pre-selected rows only.
        engine: ``widedp`` (our step) | ``opacus`` (Opacus' PrivacyEngine on an equivalent nn.Embedding CBOW — the
            DP-SGD baseline; needs ``selection: {name: all}``).
        sampling_rate: q of Poisson sampling, fixed in the config (an epoch is then round(1/q) steps); null (the
            default) = b / N, which uses the number N of training units: the data's size, listed as not covered.
            ``train.batch_size`` stays the noise's fixed denominator b (best near q·N).
        allow_large_delta: accept a ``delta`` at or above 1/N (N: the training units Poisson sampling draws).
            Such a δ is met by a mechanism that publishes each unit in the clear with probability δ (δ·N of them on
            average; δ = 0.5 reports ε = 0), so a new run refuses it unless this is true; the statement always
            prints δ. Not part of the config's hash (it changes no computation).
        max_batch_size: null (plain Poisson) | B >= 1 | ``auto``: at most B training units per batch (truncated
            Poisson; a per-step memory bound), charged as δ_B of ``delta`` (``widedp.dp.sampling``, ``run.plan``);
            ``auto``: the smallest B with δ_B <= delta / 1000. The widedp engine only.
    """

    clip1: float = 15.0
    clip2: float | None = 1.0
    noise_multiplier: float = 0.5
    delta: float = 1e-5
    rng: Literal["secure", "reproducible"] = "secure"
    noise: Literal["gaussian", "secure"] = "gaussian"
    accountant: str = "pld"  # a headline accountant of widedp.accounting.registry ("paper": refused with its reason)
    target_epsilon: float | None = None
    calibrate: Literal["none", "noise_multiplier", "selection_epsilon"] = "none"
    selection: SelectionConfig = field(default_factory=ExponentialSelectionConfig)
    engine: Literal["widedp", "opacus"] = "widedp"
    preselect: PreselectConfig | None = None
    sampling_rate: float | None = None
    allow_large_delta: bool = False
    max_batch_size: int | str | None = None

    def __post_init__(self) -> None:
        b = self.max_batch_size
        if b is not None and not (b == "auto" or (type(b) is int and b >= 1)):
            raise ConfigError(f"dp.max_batch_size: expected a positive integer, auto or null, got {show(b)}")
        if b is not None and self.engine != "widedp":
            raise ConfigError(f"dp.max_batch_size: bounds widedp's own Poisson batches; dp.engine: {self.engine} "
                              "draws its own, unbounded (leave dp.max_batch_size null there)")
        if self.sampling_rate is not None and not 0 < self.sampling_rate <= 1:
            raise ConfigError(f"dp.sampling_rate: must be in (0, 1], got {self.sampling_rate}")
        self._check_noise()
        if self.engine == "opacus" and self.selection.name != "all":
            raise ConfigError(
                f"dp.engine: opacus runs DP-SGD only (dp.selection.name: all), not {self.selection.name!r}"
            )
        if self.accountant == "paper":
            raise ConfigError("dp.accountant: paper (the paper's Theorem 3) is not a valid DP bound (it under-reports, "
                              "e.g. q=0.01, T=1, sigma=0.2: 5.8 vs a true eps >= 22.6) and cannot drive a run; use pld "
                              "or rdp. Its figure is shown, labelled, as paper_theorem3_reference_NOT_A_BOUND in "
                              "`widedp epsilon CONFIG --set dp.accountant=pld`")
        accountant(self.accountant)  # one of the registry's headline accountants
        positive("dp.clip1", self.clip1)
        if self.clip2 is not None:
            positive("dp.clip2", self.clip2)
        positive("dp.noise_multiplier", self.noise_multiplier)
        if not 0 < self.delta < 1:
            raise ConfigError(f"dp.delta: must be in (0, 1), got {self.delta}")
        if self.target_epsilon is not None:
            positive("dp.target_epsilon", self.target_epsilon)
        if self.calibrate != "none" and self.target_epsilon is None:
            raise ConfigError("dp.calibrate: needs dp.target_epsilon")
        if self.calibrate == "selection_epsilon" and not hasattr(self.selection, "with_privacy"):
            raise ConfigError(
                f"dp.calibrate: selection_epsilon needs a selection with a privacy parameter (its config's "
                f"with_privacy knob), not {self.selection.name!r}"
            )

    def _check_noise(self) -> None:
        """``noise``'s value and what ``noise: secure`` does not cover (one line naming the key)."""
        if self.noise not in ("gaussian", "secure"):
            raise ConfigError(f"dp.noise: expected one of gaussian, secure, got {show(self.noise)}")
        if self.noise != "secure":
            return
        if self.engine != "widedp":
            raise ConfigError(f"dp.noise: secure is widedp's own step; dp.engine: {self.engine} draws its own "
                              "continuous Gaussian noise (use dp.noise: gaussian there)")
        if not accountant(self.accountant).discrete_noise:
            raise ConfigError(DISCRETE_PLD_REFUSED)
        if getattr(self.selection, "release_values", False):
            raise ConfigError("dp.noise: secure does not cover dp.selection.release_values: true (its Laplace values "
                              "are released as floats); set release_values: false or dp.noise: gaussian")


# --------------------------------------------------------------------------------------------------------- top


@dataclass(frozen=True)
class Config:
    """A whole config. ``task`` picks the data/model sections' types (and, for some tasks, an ``algorithm``
    section): ``TASK_SECTIONS``."""

    data: Any = field(default_factory=DataConfig)
    model: Any = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dp: DPConfig | None = None
    task: str = "cbow"
    algorithm: Any = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-able mapping (tuples as lists) that ``config_from_dict`` reads back."""
        d = json.loads(json.dumps(dataclasses.asdict(self)))
        if d["algorithm"] is None:
            del d["algorithm"]
        return d

    def hash(self) -> str:
        d = self.to_dict()
        view = getattr(type(self.data), "hash_view", None)  # data keys added later hash only when set
        if view is not None:
            d["data"] = view(d["data"])
        model_view = getattr(type(self.model), "hash_view", None)  # (model keys added later: likewise)
        if model_view is not None:
            d["model"] = model_view(d["model"])
        pre = (d.get("dp") or {}).get("preselect")
        if pre is not None and pre.get("table_rows") is None:  # (added later: hashes only when set)
            del pre["table_rows"]
        for key in ("sampling_rate", "max_batch_size"):  # (added later: hash only when set)
            if d.get("dp") is not None and d["dp"].get(key) is None:
                d["dp"].pop(key, None)
        if d.get("dp") is not None:  # a guard's opt-out, not a computation
            d["dp"].pop("allow_large_delta", None)
        if d.get("dp") is not None and d["dp"].get("noise") == "gaussian":  # (added later: hashes when not default)
            d["dp"].pop("noise", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (UTF-8, no repeated keys), apply ``key.path=value`` overrides, and validate it."""
    raw = read_config_file(path)
    if isinstance(raw, dict) and "runs" in raw and "train" not in raw:
        raise ConfigError(f"{path}: a sweep file (it has runs:), not a config; run it with widedp compare")
    apply_overrides(raw, overrides)
    return config_from_dict(raw)


#: task -> its sections: (data dataclass, model dataclass, data presets (applied when data.preset names one; may be
#: empty), the ``algorithm:`` dataclass or None). ``widedp.tasks.TASKS`` holds the tasks themselves.
TASK_SECTIONS: dict[str, tuple[type, type, dict[str, dict[str, Any]], type | None]] = {
    "cbow": (DataConfig, ModelConfig, DATA_PRESETS, None),
    **{name: (m.DATA_CONFIG, m.MODEL_CONFIG, m.DATA_PRESETS, getattr(m, "ALGORITHM_CONFIG", None))
       for name, m in (("recsys", recsys), ("glm", glm), ("module", module))},
}


def _task_types(task: Any) -> tuple[type, type, dict[str, dict[str, Any]], type | None]:
    if not isinstance(task, str) or task not in TASK_SECTIONS:
        raise ConfigError(f"task: expected one of {', '.join(TASK_SECTIONS)}, got {show(task)}")
    return TASK_SECTIONS[task]


def _dp_config(dp_raw: Any) -> DPConfig | None:
    """The ``dp:`` section; null = non-private (as ``Config.to_dict`` writes it; a file's ``dp:`` given no value at
    all, its keys commented out, is refused by ``read_config_file``)."""
    if dp_raw is None:
        return None
    expect_mapping("dp", dp_raw)
    dp_raw = dict(dp_raw)
    if "secure_rng" in dp_raw:
        raise ConfigError("dp.secure_rng: removed; the randomness is secret by default "
                          "(dp.rng: reproducible asks for a seeded, NOT private run)")
    given = "selection" in dp_raw
    sel_raw = dp_raw.pop("selection", {"name": "exponential"})
    if sel_raw is None:
        raise ConfigError(f"dp.selection: is present but empty; give its name ({' | '.join(SELECTIONS)}) and keys")
    expect_mapping("dp.selection", sel_raw)
    name = sel_raw.get("name")
    if not isinstance(name, str) or name not in SELECTIONS:
        raise ConfigError(f"dp.selection.name: expected one of {', '.join(SELECTIONS)}, got {show(name)}")
    refuse_renamed_method(name, sel_raw)
    pre_raw = dp_raw.pop("preselect", None)
    preselect = None if pre_raw is None else build("dp.preselect", PreselectConfig, pre_raw)
    try:
        selection = build("dp.selection", SELECTIONS[name], sel_raw)
    except ConfigError as e:
        if given:
            raise
        raise ConfigError(f"dp.selection: not given, and the default ({e}) fails; dp: has only "
                          f"{', '.join(sorted(map(str, dp_raw))) or 'no keys'} (an override on a non-private config "
                          "makes such a section: give dp.selection, or leave the config non-private)") from None
    return build("dp", DPConfig, dp_raw, selection=selection, preselect=preselect)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate a raw config mapping (as read from YAML); anything wrong is a one-line ``ConfigError``."""
    expect_mapping("config", raw)
    task = raw.get("task", "cbow")
    data_cls, model_cls, presets, algo_cls = _task_types(task)
    sections = {"task", "data", "model", "train", "dp"} | ({"algorithm"} if algo_cls else set())
    no_unknown("", raw, sections)
    if algo_cls is not None and raw.get("dp") is not None:
        raise ConfigError(f"dp: task {task} takes its privacy parameters in algorithm: (epsilon, delta, accountant)")
    data_raw = section(raw, "data")
    if presets:
        preset = data_raw.get("preset", next(iter(presets)))
        if not isinstance(preset, str) or preset not in presets:
            raise ConfigError(f"data.preset: unknown preset {show(preset)} (expected one of {', '.join(presets)})")
        data_raw = {**presets[preset], **data_raw}
    cfg = Config(
        data=build("data", data_cls, data_raw),
        model=build("model", model_cls, section(raw, "model")),
        train=build("train", TrainConfig, section(raw, "train")),
        dp=_dp_config(raw.get("dp")),
        task=task,
        algorithm=build("algorithm", algo_cls, section(raw, "algorithm")) if algo_cls else None,
    )
    if cfg.dp is not None and cfg.dp.noise == "secure" and getattr(cfg.data, "vocabulary", None) == "dp":
        raise ConfigError("dp.noise: secure does not cover data.vocabulary: dp (its noisy counts are continuous "
                          "Gaussians, released as floats); use another data.vocabulary or dp.noise: gaussian")
    return cfg
