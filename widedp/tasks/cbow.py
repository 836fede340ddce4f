"""The CBOW task: the prepared splits as tensors, the model, the run's vocabulary (top-V, a public word list, or the
run's DP release: ``widedp.dp.vocab``), its privacy units (pair, sentence, document) and the Opacus baseline's
model (``dp.engine: opacus``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from widedp.accounting.statement import UnitFacts
from widedp.config import Config
from widedp.data_prep import corpus as corpus_mod
from widedp.data_prep import wordfreq_vocab
from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow
from widedp.data_prep.samples import alias_table
from widedp.data_prep.splits import counted
from widedp.distributed import ranks
from widedp.dp import rng, units
from widedp.dp import vocab as vocab_dp
from widedp.errors import ConfigError
from widedp.models import init_vectors
from widedp.models.cbow import CBOW, CBOWBatch
from widedp.models.rowinit import Deferred
from widedp.resources import check_tables_fit
from widedp.tasks import placement
from widedp.tasks.base import LoopTask
from widedp.tasks.protocol import Built, Shape

VOCAB_NOT_COVERED = ("vocabulary not private: the vocabulary (the top-V words of the training corpus by count, ties "
                     "at the cut included) and the negative-sampling distribution (their counts)")
#: data.splits as counts: the rate n / N of each split uses the corpus's number of samples N.
COUNTED_SPLITS_NOT_COVERED = ("data.splits given as counts: each split's rate n/N uses the corpus's number of "
                              "samples N (fractions do not)")


def max_sentences_not_covered(n: int) -> str:
    return f"data.max_sentences: {n}: the corpus is cut to its first {n} sentences by position"


@dataclass(frozen=True)
class NegativePool:
    """``data.negatives_pool``: each step's pool of ``size`` negative ids, i.i.d. from unigram^0.75 by Walker's alias
    method (``keep`` [V], ``alias`` [V]: O(size) a step, whatever V), a function of (seed, step) alone;
    ``row_offset``: the output table's first global row (V untied, 0 tied)."""

    keep: torch.Tensor
    alias: torch.Tensor
    size: int
    row_offset: int
    #: a pick equal to its target moves to the next pool entry up to this many times (left equal: p^9 per pick)
    MOVES = 8

    @classmethod
    def of(cls, weights: np.ndarray, size: int, *, row_offset: int, device: torch.device | str) -> NegativePool:
        """The pool drawing ids with probability ∝ ``weights`` [V] (counts ** 0.75)."""
        keep, alias = alias_table(np.asarray(weights, dtype=np.float64))
        return cls(torch.as_tensor(keep, device=device), torch.as_tensor(alias, dtype=torch.long, device=device),
                   size, row_offset)

    def draw(self, target: torch.Tensor, k: int, *, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, k] negatives for the samples of ``target`` [B], each a uniform pick from the step's pool, moved to
        the next pool entry while equal to its target (``MOVES``); [P] the pool's distinct global output rows,
        sorted)."""
        dev = self.keep.device
        gen = rng.generator(rng.derived_seed(seed, f"negatives-pool:{step}"), dev)
        i = torch.randint(self.keep.numel(), (self.size,), generator=gen, device=dev)
        u = torch.rand(self.size, generator=gen, device=dev, dtype=torch.float64)
        pool = torch.where(u < self.keep.index_select(0, i), i, self.alias.index_select(0, i))
        pick = torch.randint(self.size, (target.numel(), k), generator=gen, device=dev)
        neg = pool.index_select(0, pick.view(-1)).view(-1, k)
        for shift in range(1, 1 + min(self.MOVES, self.size - 1)):  # (no host sync: a fixed number of moves)
            moved = pool.index_select(0, pick.add(shift).remainder_(self.size).view(-1)).view(-1, k)
            neg = torch.where(neg == target.unsqueeze(1), moved, neg)
        return neg, torch.unique(pool) + self.row_offset


@dataclass(frozen=True)
class SplitTensors:
    """A CBOW split on ``device``; ``source``: the numpy split (its unit ids, for ``widedp.dp.units``); ``pool``:
    the training split's ``NegativePool`` under ``data.negatives_pool``."""

    target: torch.Tensor
    context: torch.Tensor
    negatives: torch.Tensor
    source: Split | None = field(default=None, compare=False, repr=False)
    pool: NegativePool | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, s: Split, device: torch.device) -> SplitTensors:
        return cls(*(torch.as_tensor(a, dtype=torch.long, device=device) for a in (s.target, s.context, s.negatives)),
                   source=s)

    def __len__(self) -> int:
        return self.target.numel()

    def batch(self, idx: torch.Tensor) -> CBOWBatch:
        return CBOWBatch(self.target.index_select(0, idx), self.context.index_select(0, idx),
                         self.negatives.index_select(0, idx))

    def batch_at(self, idx: torch.Tensor, *, seed: int, step: int) -> tuple[CBOWBatch, torch.Tensor | None]:
        """The batch of DP step ``step`` and its public rows: with a ``pool``, the negatives drawn from the step's
        pool and the pool's rows; else ``batch(idx)`` and None."""
        if self.pool is None:
            return self.batch(idx), None
        target = self.target.index_select(0, idx)
        neg, public = self.pool.draw(target, self.negatives.shape[1], seed=seed, step=step)
        return CBOWBatch(target, self.context.index_select(0, idx), neg), public


class SplitDataset(Dataset):
    """A split as an Opacus-friendly dataset: ``__getitems__`` gathers a whole batch with three index_selects."""

    def __init__(self, split: SplitTensors) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.split
        return s.target[i], s.context[i], s.negatives[i]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.split.batch(torch.as_tensor(idx, dtype=torch.long, device=self.split.target.device))
        return b.target, b.context, b.negatives


def build_cbow(cfg: Config, out: Path, *, device: torch.device, data: CBOWData | None = None, meta: bool = False
               ) -> tuple[dict[str, SplitTensors], CBOW]:
    """CBOW task: prepared splits (as tensors on ``device``) and the model; writes ``out/vocab.json``. ``meta``: the
    model on the meta device (no storage; several processes: ``widedp.tasks.placement``), its init deferred to each
    rank's ``ShardedCBOW``, which draws its own rows of the weights built here otherwise."""
    data = data if data is not None else prepare_cbow(cfg.data)
    splits = {k: SplitTensors.of(getattr(data, k), device) for k in ("train", "valid", "test")}
    (out / "vocab.json").write_text(json.dumps(data.vocab))
    tables = 1 if cfg.model.tied else 2
    check_tables_fit(tables * len(data.vocab), cfg.model.dim, device=device,
                     what=f"{tables} x {len(data.vocab):,} rows")
    shape = dict(tied=cfg.model.tied, sparse=cfg.model.sparse, init_scale=cfg.model.init_scale)
    if meta:
        with torch.device("meta"):
            model = CBOW(len(data.vocab), cfg.model.dim, **shape)
        model.deferred = Deferred(cfg.train.seed, device)
    else:
        init_gen = torch.Generator().manual_seed(cfg.train.seed)
        model = CBOW(len(data.vocab), cfg.model.dim, **shape, generator=init_gen).to(device)
    if cfg.data.negatives_pool:
        pool = NegativePool.of(np.asarray(data.counts, dtype=np.float64) ** 0.75, cfg.data.negatives_pool,
                               row_offset=model.num_rows - model.vocab_size, device=device)
        splits["train"] = replace(splits["train"], pool=pool)
    return splits, model


def cbow_data(cfg: Config, out: Path, *, data: CBOWData | None, noise_seed: int | None, resumed: bool = False
              ) -> tuple[CBOWData, vocab_dp.VocabRelease | None]:
    """The run's CBOW data and its DP vocabulary release (``data.vocabulary: dp``: drawn once per run with the
    generator of ``noise_seed``, the run's secret one, and kept in RUN/; see ``widedp.dp.vocab``)."""
    release = None
    if noise_seed is not None:
        release = vocab_dp.run_release(cfg.data, out, noise_seed=noise_seed, resumed=resumed)
        if data is None:
            data = prepare_cbow(cfg.data, vocab=release.vocab(corpus_mod.load_corpus(cfg.data)))
        elif list(data.vocab) != release.words:
            raise ConfigError(f"{out}: the prepared data's vocabulary is not the run's DP vocabulary "
                              f"({vocab_dp.RELEASE_FILE})")
    data = data if data is not None else prepare_cbow(cfg.data)
    return data, release


class CBOWTask(LoopTask):
    name = "cbow"

    def check(self, cfg: Config, *, private: bool) -> None:
        if cfg.data.vocabulary == "dp" and not private:
            raise ConfigError("data.vocabulary: dp is charged to the run's privacy ledger; it needs a dp: section")
        if cfg.data.negatives_pool and not (private and cfg.dp.engine == "widedp"):
            raise ConfigError("data.negatives_pool: applies to DP training with dp.engine: widedp only")
        if cfg.data.negatives_pool and cfg.dp.preselect is not None:
            raise ConfigError("data.negatives_pool: not with dp.preselect (the pool's rows would be updated outside "
                              "the pre-selected rows)")

    def build(self, cfg: Config, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        if cfg.model.init_vectors is not None:  # checked before a DP vocabulary is drawn and charged
            if ranks.world() > 1:
                raise ConfigError("model.init_vectors: a warm start trains on one process only (no --nproc)")
            init_vectors.check_file(cfg.model.init_vectors, dim=cfg.model.dim)
        data, release = cbow_data(cfg, out, data=data, noise_seed=noise_seed, resumed=resumed)
        splits, model = build_cbow(cfg, out, device=device, data=data,
                                   meta=placement.tables_on_meta(cfg, resumed=resumed))
        if cfg.model.init_vectors is not None:
            init_vectors.warm_start(model, list(data.vocab), out, path=cfg.model.init_vectors,
                                    output=cfg.model.init_output, resumed=resumed)
        return Built(splits, model, {"vocabulary": release.mechanism} if release is not None else {})

    def shape(self, cfg: Config) -> Shape:
        """n of the prepared train split (Binomial: a count in data.splits is only its expectation; a DP
        vocabulary is drawn per run, so then n is estimated with the top-V vocabulary: noted)."""
        num_rows = cfg.data.vocab_size * (1 if cfg.model.tied else 2)
        dp_vocab = cfg.data.vocabulary == "dp" and cfg.dp is not None
        if units.is_per_sample(cfg) and not dp_vocab:
            return Shape(len(prepare_cbow(cfg.data).train.target), num_rows)
        data_cfg, notes = cfg.data, {}
        if dp_vocab:
            data_cfg = replace(data_cfg, vocabulary="private_top")
            notes["n_units_note"] = ("estimated with the top-V vocabulary: the run's DP vocabulary changes the number "
                                     "of units slightly (its summary.json has the exact figure)")
        split = SplitTensors.of(prepare_cbow(data_cfg).train, torch.device("cpu"))
        return Shape(len(split), num_rows, split, notes)

    def units(self, cfg: Config, split: Any, *, device: torch.device | str) -> units.Units | None:
        """Sentence or document units: the split's ``source`` carries each sample's ids and corpus-order key."""
        if units.is_per_sample(cfg):
            return None
        unit = units.privacy_unit(cfg)
        src = getattr(split, "source", None)
        if src is None or getattr(src, unit, None) is None:
            raise ConfigError(f"data.privacy_unit: {unit}: the prepared data has no {unit} ids (rebuild its cache)")
        return units.group_units(getattr(src, unit), src.order, cap=cfg.data.max_samples_per_unit, device=device)

    def privacy(self, cfg: Config) -> UnitFacts:
        if units.is_per_sample(cfg):
            unit = ("(target, context) pair" if cfg.data.sample_shape == "pair"
                    else "(target, context window) sample")
        else:
            unit = units.unit_name(cfg, "pairs" if cfg.data.sample_shape == "pair" else "samples")
        vocabulary = cfg.data.vocabulary
        gaps = ((VOCAB_NOT_COVERED,) if vocabulary == "private_top" else ()) + (
            (COUNTED_SPLITS_NOT_COVERED,) if counted(cfg.data.splits) else ()) + (
            (max_sentences_not_covered(cfg.data.max_sentences),) if cfg.data.max_sentences else ())
        includes: tuple[str, ...] = ()
        if vocabulary == "dp" and cfg.dp is not None:
            v = cfg.data.vocab_dp
            includes = (f"the DP vocabulary and its noisy counts (the negative-sampling distribution): Gaussian "
                        f"partition selection, σ={v.noise_multiplier:g}, ≤ {v.max_words_per_unit} words per "
                        f"{cfg.data.privacy_unit}, threshold δ_τ={v.delta:g} of δ",)
        elif vocabulary.startswith("file:"):
            includes = ("the vocabulary: a public word list (data.vocabulary: file:PATH), nothing private spent on it",)
        elif cfg.data.wordfreq_lang is not None:
            includes = (f"the vocabulary: public (data.vocabulary: {vocabulary}), the first {cfg.data.vocab_size} "
                        f"words passing the token filters of the {wordfreq_vocab.describe(cfg.data.wordfreq_lang)}; "
                        "nothing private spent on it",)
        if cfg.model.init_vectors is not None:
            includes = (*includes, init_vectors.statement_line(cfg.model.init_vectors))
        return UnitFacts(unit, gaps, includes)

    def warn(self, cfg: Config) -> None:
        """``data.vocabulary: private_top`` with DP: say on stderr that the vocabulary is not private, once per
        process (a sweep or a benchmark trains many runs; each run's statement lists it as not covered)."""
        if cfg.dp is not None and cfg.data.vocabulary == "private_top" and "private_top" not in WARNED:
            WARNED.add("private_top")
            print("widedp: warning: data.vocabulary: private_top — the vocabulary and the negative-sampling "
                  "distribution come from the training corpus WITHOUT privacy (not covered by ε); use "
                  "data.vocabulary: dp, wordfreq or file:PATH", file=sys.stderr)

    def shared_data(self, cfg: Config) -> CBOWData | None:
        """The prepared corpus, shared by a sweep's runs of the same data (not a DP vocabulary: drawn per run)."""
        return None if cfg.data.vocabulary == "dp" else prepare_cbow(cfg.data)


#: the warnings this process has printed (``CBOWTask.warn``: once per process)
WARNED: set[str] = set()

TASK = CBOWTask()
