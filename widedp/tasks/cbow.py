"""The CBOW task's data and model for ``widedp.run.train``: the prepared splits as tensors, the model, and the run's
vocabulary (top-V, a public word list, or the run's DP release: ``widedp.dp.vocab``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from widedp.config import Config
from widedp.data_prep import corpus as corpus_mod
from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow
from widedp.dp import vocab as vocab_dp
from widedp.errors import ConfigError
from widedp.models.cbow import CBOW, CBOWBatch


@dataclass(frozen=True)
class SplitTensors:
    """A CBOW split on ``device``; ``source``: the numpy split (its unit ids, for ``widedp.dp.units``)."""

    target: torch.Tensor
    context: torch.Tensor
    negatives: torch.Tensor
    source: Split | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, s: Split, device: torch.device) -> SplitTensors:
        return cls(*(torch.as_tensor(a, dtype=torch.long, device=device) for a in (s.target, s.context, s.negatives)),
                   source=s)

    def __len__(self) -> int:
        return self.target.numel()

    def batch(self, idx: torch.Tensor) -> CBOWBatch:
        return CBOWBatch(self.target.index_select(0, idx), self.context.index_select(0, idx),
                         self.negatives.index_select(0, idx))


def build_cbow(cfg: Config, out: Path, *, device: torch.device, data: CBOWData | None = None
               ) -> tuple[dict[str, SplitTensors], CBOW]:
    """CBOW task: prepared splits (as tensors on ``device``) and the model; writes ``out/vocab.json``."""
    data = data if data is not None else prepare_cbow(cfg.data)
    splits = {k: SplitTensors.of(getattr(data, k), device) for k in ("train", "valid", "test")}
    (out / "vocab.json").write_text(json.dumps(data.vocab))
    init_gen = torch.Generator().manual_seed(cfg.train.seed)
    model = CBOW(len(data.vocab), cfg.model.dim, tied=cfg.model.tied, sparse=cfg.model.sparse,
                 init_scale=cfg.model.init_scale, generator=init_gen).to(device)
    return splits, model


def cbow_data(cfg: Config, out: Path, *, data: CBOWData | None, noise_seed: int | None
              ) -> tuple[CBOWData, vocab_dp.VocabRelease | None]:
    """The run's CBOW data and its DP vocabulary release (``data.vocabulary: dp``: drawn once per run with the
    generator of ``noise_seed``, the run's secret one, and kept in RUN/; see ``widedp.dp.vocab``)."""
    if cfg.data.vocabulary == "dp" and cfg.dp is None:
        raise ConfigError("data.vocabulary: dp is charged to the run's privacy ledger; it needs a dp: section")
    release = None
    if noise_seed is not None:
        release = vocab_dp.run_release(cfg.data, out, noise_seed=noise_seed)
        if data is None:
            data = prepare_cbow(cfg.data, vocab=release.vocab(corpus_mod.load_corpus(cfg.data)))
        elif list(data.vocab) != release.words:
            raise ConfigError(f"{out}: the prepared data's vocabulary is not the run's DP vocabulary "
                              f"({vocab_dp.RELEASE_FILE})")
    data = data if data is not None else prepare_cbow(cfg.data)
    return data, release


def warn_vocabulary(cfg: Config) -> None:
    """``data.vocabulary: private_top`` with DP: say on stderr that the vocabulary is not private."""
    if cfg.task == "cbow" and cfg.dp is not None and cfg.data.vocabulary == "private_top":
        print("widedp: warning: data.vocabulary: private_top — the vocabulary and the negative-sampling distribution "
              "come from the training corpus WITHOUT privacy (not covered by ε); use data.vocabulary: dp or "
              "file:PATH", file=sys.stderr)
