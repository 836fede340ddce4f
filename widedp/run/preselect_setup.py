"""``dp.preselect`` in a training run: the one-shot DP row pre-selection (``widedp.dp.selection.preselect``) run
over the whole training set before the first step, and the step restricted to the rows it kept. The DP engine
(``widedp.run.trainers.sparse.SparseDPTrainer.setup``, where the run's privacy plan is made) calls ``setup`` and
restricts its selector and every step's per-sample rows; any task the loop trains goes through it unchanged.

- Contributions: every training sample's rows (or, with privacy units, every unit's merged rows) as the DP step
  sees them (``model.per_sample_row_grads``), ℓ2-normalised per sample/unit and summed (sensitivity 1).
- Randomness: a generator seeded by ``preselect_seed(seeds.noise)``, a SHA-256 derivation of the run's secret noise
  seed (``widedp.dp.rng.derived_seed``: a stream of its own, independent of the training noise and of the DP
  vocabulary's), so it is as secret as the training noise (``dp.rng: reproducible``: derived from train.seed, NOT
  private).
- Spend: charged once, before the first step, as a ``widedp.run.plan.Prefix`` entry after the DP vocabulary's
  (the engine's ledger and journal; calibration and ``widedp epsilon`` include it).
- Resume: the kept rows are written to ``RUN/private/preselect.json`` before anything uses them; a resumed run loads
  them (never draws again: a second draw would be a second release). If that file is gone the run is refused.
- In the step (``restrict_grads``, ``restrict_selector``): each sample's rows outside the kept set are dropped
  BEFORE clipping (the set is an already-released, fixed input of every step: post-processing, the per-sample
  sensitivity is unchanged), and the selector ranges over the kept rows only, so rows outside are never selected,
  noised or updated; ``selection: all`` on the kept rows is DP-SGD on them. A recommender's always-selected dense
  rows stay in.
- The Opacus engine cannot run it (Opacus noises every row of every layer): ``check_opacus_config`` refuses it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from widedp.config import Config
from widedp.dp import rng, units
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection.base import Selector
from widedp.dp.selection.preselect import contribution_totals, preselect_rows, preselected
from widedp.errors import ConfigError

PRESELECT_FILE = "preselect.json"
_FORMAT = "widedp.preselect/1"


@dataclasses.dataclass(frozen=True)
class Preselection:
    """The kept rows: [K] sorted global ids (on the training device); ``always``: A always-selected last rows."""

    rows: Tensor
    num_rows: int
    always: int = 0


def preselect_seed(noise_seed: int) -> int:
    """A 62-bit seed for the pre-selection derived from the run's (secret) noise seed."""
    return rng.derived_seed(noise_seed, "widedp-preselect")


@torch.inference_mode()
def train_contributions(model: Any, split: Any, *, grouped: units.Units | None, chunk: int = 4096
                        ) -> tuple[Tensor, Tensor, int, int]:
    """(ids [U], ℓ2-normalised contribution totals [U] float64, R, A) over the whole training split: one vector of
    norm 1 per sample, or per unit when ``grouped`` (its samples' rows merged, as the DP step sees a unit)."""
    device = next(model.parameters()).device
    always = [0]

    def batches() -> Iterator[PerSampleRows]:
        if grouped is None:
            for start in range(0, len(split), chunk):
                idx = torch.arange(start, min(len(split), start + chunk), device=device)
                g = model.per_sample_row_grads(split.batch(idx))[1]
                always[0] = getattr(g, "always_rows", 0)
                yield g
            return
        per = max(1, chunk // max(1, grouped.cap))  # units per chunk
        for u0 in range(0, grouped.num_units, per):
            ub = grouped.batch(torch.arange(u0, min(grouped.num_units, u0 + per), device=grouped.offsets.device))
            g = model.per_sample_row_grads(split.batch(ub.samples.to(device)))[1]
            g = units.group_rows(g, ub.segment.to(device), num_units=ub.num_units)
            always[0] = getattr(g, "always_rows", 0)
            yield g

    gen = batches()
    first = next(gen)
    num_rows, a = first.num_rows, always[0]
    ids, counts = contribution_totals(_chain(first, gen), selectable=num_rows - a if a else None)
    return ids, counts, num_rows, a


def _chain(first: PerSampleRows, rest: Iterator[PerSampleRows]) -> Iterator[PerSampleRows]:
    yield first
    yield from rest


def setup(cfg: Config, out: Path, *, model: Any, split: Any, grouped: units.Units | None, noise_seed: int,
          resume: bool) -> Preselection | None:
    """The run's pre-selection (None without ``dp.preselect``): loaded from ``RUN/private/`` when it is there, else
    (a new run only) drawn with the generator of ``preselect_seed(noise_seed)`` and saved there first."""
    dp = cfg.dp
    if dp is None or dp.preselect is None:
        return None
    device = next(model.parameters()).device
    path = out / rng.PRIVATE_DIR / PRESELECT_FILE
    want = {"rows": dp.preselect.rows, "sigma": dp.preselect.sigma, "threshold": dp.preselect.tau,
            "table_rows": None if dp.preselect.table_rows is None else list(dp.preselect.table_rows)}
    if path.is_file():
        return _load(path, want, device)
    if resume:
        raise ConfigError(f"{path}: missing, so the run's pre-selected rows are lost (a new draw would be a second "
                          "release); start a new run directory")
    ids, counts, num_rows, always = train_contributions(model, split, grouped=grouped)
    gen = rng.generator(preselect_seed(noise_seed), ids.device)
    starts = [int(off) for off, _ in model.row_tables()] if dp.preselect.table_rows else [0]
    kept = preselect_rows(ids, counts, dp.preselect, num_rows=num_rows - always, generator=gen, table_starts=starts)
    record = {"format": _FORMAT, **want, "num_rows": num_rows, "always_rows": always, "kept": kept.tolist()}
    rng.save_private(out, PRESELECT_FILE, json.dumps(record).encode())  # before anything uses it
    return Preselection(kept.to(device), num_rows, always)


def _load(path: Path, want: dict[str, Any], device: torch.device) -> Preselection:
    try:
        d = json.loads(path.read_text())
        ok = d.get("format") == _FORMAT and all(d.get(k) == v for k, v in want.items())
        kept = torch.tensor([int(r) for r in d["kept"]], dtype=torch.long, device=device)
        num_rows, always = int(d["num_rows"]), int(d["always_rows"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{path}: corrupted (the run's pre-selected rows cannot be read)") from None
    if not ok:
        raise ConfigError(f"{path}: drawn with other dp.preselect parameters; start a new run directory")
    return Preselection(kept, num_rows, always)


def restrict_selector(selector: Selector, pre: Preselection | None) -> Any:
    """``selector`` ranging over the kept rows only (unchanged without a pre-selection)."""
    return selector if pre is None else preselected(selector, pre.rows)


def restrict_grads(g: PerSampleRows, pre: Preselection | None) -> PerSampleRows:
    """``g`` without the (sample, row) entries outside the kept rows (the always-selected rows stay): [nnz'] rows,
    offsets recomputed; unchanged without a pre-selection."""
    if pre is None:
        return g
    k = pre.rows.numel()
    pos = torch.searchsorted(pre.rows, g.rows).clamp_(max=k - 1)
    keep = pre.rows.index_select(0, pos) == g.rows
    if pre.always:
        keep |= g.rows >= pre.num_rows - pre.always
    per_sample = torch.zeros(g.batch_size, dtype=torch.long, device=g.rows.device)
    per_sample.index_add_(0, g.sample_ids(), keep.long())
    offsets = torch.cat([per_sample.new_zeros(1), per_sample.cumsum(0)])
    return dataclasses.replace(g, values=g.values[keep], rows=g.rows[keep], offsets=offsets)
