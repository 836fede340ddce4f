"""widedp's DP trainer (``dp.engine: widedp``): ``dp_step`` on Poisson batches of samples or privacy units.

Each step: the model's per-sample row gradients (``per_sample_row_grads``; summed per unit when a unit groups
samples, ``widedp.dp.units``), ``dp_step`` (clip, select rows privately, clip, noise: paper Alg. 3) on the trainer's
row layout (``self.row_layout``: ``SingleProcess()`` here, row blocks in ``widedp.run.trainers.sharded``), the row
optimizer on the noisy selected rows, and the step's spend into the ledger. Sampling (``PoissonSampler``) is a pure
function of the secret seed and the step, and the noise generator's state is saved at every checkpoint, so a
resumed run replays the lost steps bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from widedp.accounting.statement import for_config, with_batch_bound
from widedp.config import Config
from widedp.dp import rng, units
from widedp.dp.layout import RowLayout, SingleProcess, check_options
from widedp.dp.sampling import PoissonSampler
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.selection.public import table_starts
from widedp.dp.step import dp_step
from widedp.errors import ConfigError
from widedp.run import preselect_setup
from widedp.run import summary as run_summary
from widedp.run.trainers.base import Drawn, Report, StepOutput
from widedp.run.trainers.private import PrivateTrainer
from widedp.tasks.protocol import Built, Task

OPTIMIZERS = ("sgd", "lazy_adam", "adam")
_STATS = ("rows_selected", "touched_share", "clipped1", "clipped2")


class SparseDPTrainer(PrivateTrainer):
    """The DP-sparse step (module docstring)."""

    def __init__(self, cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> None:
        if cfg.train.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer: {cfg.train.optimizer!r} is not available for DP training "
                              f"(expected one of {', '.join(OPTIMIZERS)})")
        super().__init__(cfg, out, device=device, resumed=resumed)

    #: where the step's rows live (``widedp.dp.layout``); ``grad_model`` gives this process's per-sample rows
    row_layout: RowLayout = SingleProcess()

    def setup(self, built: Built, task: Task) -> None:
        cfg = self.cfg
        check_options(self.row_layout, {"dp.preselect": cfg.dp is not None and cfg.dp.preselect is not None,
                                        "data.negatives_pool": bool(getattr(cfg.data, "negatives_pool", 0))})
        self.module = self._model = self.grad_model = built.model
        self.facts = for_config(task.privacy(cfg), cfg)
        self._split = built.splits["train"]
        n = len(self._split)
        self.grouped = task.units(cfg, self._split, device=self.device)
        n_dp = self.grouped.num_units if self.grouped is not None else n  # what Poisson sampling draws
        # The run's privacy plan, all in this one place: the ledger's prefix entries (self.prefix.entries: what is spent
        # before the first step: the task's DP vocabulary, drawn by its build with self.prefix_seed, then the
        # one-shot row pre-selection, dp.preselect, drawn here), calibration, the per-step spend, the budget cap,
        # and the selector every step uses (over the pre-selected rows only).
        self._plan(num_rows=self.module.num_rows, n=n_dp)
        self._facts_unbounded, self._units = self.facts, f"{units.privacy_unit(cfg)}s"
        self.facts = with_batch_bound(self.facts, bound=self.prefix.batch_bound, delta_b=self.prefix.batch_delta,
                                      units=self._units)
        self.truncated_steps = self._truncated_since = 0  # dp.max_batch_size: steps whose batch was cut
        self.pre = self._preselect()
        self.selector = preselect_setup.restrict_selector(
            make_selector(self.dp.selection, num_rows=self.module.num_rows,
                          table_starts=table_starts(self.module)), self.pre)
        self.optimizer = self._row_optimizer(task)
        self._sampler = self._make_sampler()
        self._stats = torch.zeros(5, device=self.device)
        if self.grouped is not None or built.notes:
            self.unit_info = {"privacy_unit": units.privacy_unit(cfg), "n_units": n_dp}
            if self.grouped is not None:
                self.unit_info.update({"max_samples_per_unit": self.grouped.cap,
                                       "samples_dropped_by_cap": self.grouped.dropped})
            self.unit_info.update(built.notes)

    def _preselect(self) -> preselect_setup.Preselection | None:
        """``dp.preselect``'s kept rows (None without it), drawn once and kept in RUN/private/."""
        return preselect_setup.setup(self.cfg, self.out, model=self.module, split=self._split, grouped=self.grouped,
                                     noise_seed=self.seeds.noise, resume=self.resumed)

    def _make_sampler(self) -> Any:
        """The Poisson sampler of examples (or of units) seeded by ``self.seeds.sampling``, its batches cut to
        ``dp.max_batch_size`` (the plan's resolved bound; None: unbounded)."""
        q, seed, n, bound = self.sampling_rate, self.seeds.sampling, len(self._split), self.prefix.batch_bound
        if self.grouped is None:
            return PoissonSampler(n, sampling_rate=q, seed=seed, device=self.device, max_batch_size=bound)
        return units.UnitPoissonSampler(self.grouped, sampling_rate=q, seed=seed, device=self.device,
                                        max_batch_size=bound)

    def _reseed(self) -> None:
        super()._reseed()
        self._sampler = self._make_sampler()

    def _row_optimizer(self, task: Task) -> Any:
        return task.row_optimizer(self.cfg, self.module)

    def start(self) -> dict[str, Any]:
        out = {"n_units": self.n_draw if self.grouped is not None else None, **super().start()}
        if self.prefix.batch_bound is not None:
            out["dp"].update(self._bound_summary())
        return out

    def _bound_summary(self) -> dict[str, Any]:
        """``dp.max_batch_size``'s resolved bound, its δ_B and the ε̄ it holds for (``widedp.run.plan``)."""
        p = self.prefix
        return {"max_batch_size": p.batch_bound, "delta_batch": p.batch_delta, "epsilon_bar": p.epsilon_bar}

    def _truncation_stats(self) -> dict[str, Any]:
        """The interval's ``truncated_steps`` (with a bound; never silent), counted from zero again."""
        if self.prefix.batch_bound is None:
            return {}
        out = {"truncated_steps": self._truncated_since}
        self._truncated_since = 0
        return out

    def sample(self, step: int) -> Drawn:
        if self.prefix.batch_bound is not None and self._sampler.truncated(step):
            self.truncated_steps += 1
            self._truncated_since += 1
        units_drawn = None
        if self.grouped is None:
            idx = self._sampler.batch(step)
        else:
            units_drawn = self._sampler.draw(step)
            idx = units_drawn.samples
        if getattr(self._split, "pool", None) is None:
            return Drawn(self._split.batch(idx), idx.numel(), units_drawn)
        batch, public = self._split.batch_at(idx, seed=self.seeds.sampling, step=step)  # data.negatives_pool
        return Drawn(batch, idx.numel(), units_drawn, public)

    def step(self, drawn: Drawn, epoch: int) -> StepOutput:
        dp, b = self.dp, self.cfg.train.batch_size
        with torch.inference_mode():
            loss, grads = self.grad_model.per_sample_row_grads(drawn.batch)
            if drawn.units is not None:  # one "sample" of the DP step = one unit's summed gradient
                grads = units.group_rows(grads, drawn.units.segment, num_units=drawn.units.num_units)
            grads = preselect_setup.restrict_grads(grads, self.pre)  # dp.preselect: the kept rows only
            res = dp_step(grads, batch_size=b, sampling_rate=self.sampling_rate, clip1=dp.clip1, clip2=dp.clip2,
                          noise_multiplier=dp.noise_multiplier, selector=self.selector,
                          ctx=SelectionContext(epoch=epoch, num_epochs=self.cfg.train.epochs),
                          generator=self.noise_gen, public_rows=drawn.public_rows, noise=dp.noise,
                          layout=self.row_layout)
            self.optimizer.step(self.row_layout.local(res.grad))
            st = res.stats
            self._stats += torch.stack([st.touched_share.new_tensor(float(st.rows_selected)), st.touched_share,
                                        st.clipped1, st.clipped2.to(st.clipped1.dtype),
                                        st.nonfinite.to(st.clipped1.dtype)])
        self.ledger.add(res.spend)
        return StepOutput(torch.where(torch.isfinite(loss), loss, 0.0).sum())  # a non-finite sample counts 0

    def interval_stats(self, steps: int, step: int) -> dict[str, Any]:
        s = (self._stats / steps).tolist()
        self._stats.zero_()
        return {**dict(zip(_STATS, s)), **self._nonfinite_stats(int(round(s[4] * steps)), step),
                **self._truncation_stats()}

    def eval_model(self) -> Any:
        return self._model

    def state_dict(self) -> dict[str, Any]:
        # (the journal is written ahead of each interval, never lowered at a checkpoint)
        return {"optimizer": self.optimizer.state_dict(), "ledger": self.ledger.to_json(), **self._truncated_state()}

    def _truncated_state(self) -> dict[str, Any]:
        """The run's bound and ``truncated_steps`` so far, for the checkpoint (with a bound)."""
        bound = self.prefix.batch_bound
        return {"truncated_steps": self.truncated_steps, "max_batch_size": bound} if bound is not None else {}

    def _load_truncated_state(self, ckpt: dict[str, Any]) -> None:
        """``truncated_steps`` back; a bound (``auto``, worked out again) other than the one the run's steps so far
        were cut to is refused: δ_B would be charged for a B those steps did not have."""
        was = ckpt.get("max_batch_size")
        if was is not None and was != self.prefix.batch_bound:
            raise ConfigError(f"dp.max_batch_size: the run's batches so far were cut to {was:,} units, but "
                              f"{self.cfg.dp.max_batch_size} now resolves to {self.prefix.batch_bound:,} (another "
                              "widedp or accountant version?); resume it with the version that started it")
        self.truncated_steps = int(ckpt.get("truncated_steps", 0))

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        self._load_truncated_state(ckpt)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        states = rng.load_states(self.out, step) if self.replayable else None  # (a damaged file: ConfigError)
        lost = None if states is not None else self._lost_state(step)
        if states is not None:
            rng.restore(self.noise_gen, states["noise"], rng.state_path(self.out, step))
        elif self.replayable:
            self._restart_randomness(step)
        self.ledger = self._resumed_ledger(ckpt, replayable=states is not None, lost=lost)

    def save_private(self, step: int, *, best: dict[str, Any] | None = None) -> None:
        rng.save_states(self.out, step, {"noise": self.noise_gen.get_state()})

    def report(self, *, stopped: bool) -> Report:
        dp = self.dp
        eps = run_summary.epoch_epsilons(dp, self.ledger, self.prefix)
        facts = self.facts
        if self.prefix.batch_bound is not None and "delta_batch" in eps:  # the δ_B the headline ε is valid with
            facts = with_batch_bound(self._facts_unbounded, bound=self.prefix.batch_bound,
                                     delta_b=eps["delta_batch"], units=self._units)
        st = run_summary.run_statement(facts, dp, self.ledger, private_rng=self.seeds.private, prefix=self.prefix,
                                       epsilons=eps)
        section = self._dp_summary(stopped=stopped)
        section.update(epsilon=st.epsilon, epsilon_rdp=eps.get("epsilon_rdp", 0.0))
        if self.prefix.batch_bound is not None:
            section.update(**self._bound_summary(), truncated_steps=self.truncated_steps)
            section.update({k: eps[k] for k in ("delta_batch", "epsilon_bar", "delta_batch_rdp", "epsilon_bar_rdp")
                            if k in eps})
        return Report(st, section, run_summary.plot_title(dp, st))
