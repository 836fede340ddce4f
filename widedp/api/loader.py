"""The Poisson loader ``PrivacyEngine.make_private`` returns in place of the user's DataLoader.

Every step, each of the n items of ``data_loader.dataset`` joins the batch independently with probability
q = b / n (b = ``data_loader.batch_size``, the expected batch size), drawn by ``widedp.dp.sampling.PoissonSampler`` from
the engine's secret sampling seed; the batch is ``collate_fn([dataset[i] for i in batch])``. One ``iter()`` yields
the rest of the current epoch (round(n / b) steps per epoch), so ``for epoch in ...: for batch in loader:`` works, and
a resumed engine continues mid-epoch with the very batches an uninterrupted run would have drawn.

- An empty Poisson batch is not yielded: the engine takes its step itself (noise only; it is a step of the
  analysis and spends like any other).
- Each yielded batch must be used for exactly one DP step (``optimizer.step()`` or ``engine.step``) before the
  next is asked for, and a step takes only the batch this loader yielded for it (a batch from elsewhere, a second
  step on one batch, or a forward over a different number of samples is refused: the accountant's q describes
  these Poisson batches and nothing else).
- Iteration ends at the run's planned steps (``epochs`` x steps per epoch) or when the next step would exceed
  ``target_epsilon`` (then ``engine.stopped_by_budget`` is True).
- Items are read in the main process (``num_workers`` is ignored); ``dataset.__getitems__`` is used when present.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from widedp.api.engine import PrivacyEngine


class PoissonLoader:
    """Iterable of Poisson batches of ``dataset`` for ``engine`` (see the module docstring)."""

    def __init__(self, engine: PrivacyEngine, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.engine, self.dataset, self.collate_fn = engine, dataset, collate_fn

    def __len__(self) -> int:
        """Steps per epoch (the expected number of batches; empty ones are stepped, not yielded)."""
        return self.engine.steps_per_epoch

    def fetch_items(self, idx: list[int]) -> Any:
        """The items ``idx`` (what ``__getitems__`` returns when the dataset has one)."""
        get = getattr(self.dataset, "__getitems__", None)
        return get(idx) if get is not None else [self.dataset[i] for i in idx]

    def _fetch(self, idx: list[int]) -> Any:
        return self.collate_fn(self.fetch_items(idx))

    def __iter__(self) -> Iterator[Any]:
        e = self.engine
        per = e.steps_per_epoch
        end = min(e.total_steps, (e.steps // per + 1) * per)
        while e.steps < end:
            if e.budget_exhausted():
                e.stopped_by_budget = True
                return
            t = e.steps
            idx = e.batch_indices(t)
            if not idx:
                e.empty_step()
                continue
            mine = e.local_items(idx)  # (several processes: this rank's part, possibly empty)
            batch = self._fetch(mine)
            e._issue(t, mine, batch, every=idx if mine is not idx else None)
            yield batch
            if e.steps == t:
                raise RuntimeError(f"step {t}: the previous Poisson batch was not used for a DP step; call "
                                   "optimizer.step() (or engine.step) once per batch before asking for the next")
