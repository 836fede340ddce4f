"""What both DP trainers share: the run's secret seeds, what is spent before the first step, the privacy plan, the
ledger, the spent-budget journal written ahead (``widedp.run.journal``) and the budget stop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from widedp import accounting
from widedp.config import Config
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.run import journal, plan
from widedp.run import summary as run_summary


class PrivateTrainer:
    """Base of ``SparseDPTrainer`` and ``OpacusTrainer``.

    Randomness that protects the data is seeded from ``rng.run_seeds`` (``dp.rng: secure``: the OS CSPRNG, kept
    only in RUN/private/, never in config.yaml, checkpoints or logs); the generators' states at each checkpoint are
    saved there too (``save_private``), so a resumed run can replay exactly.
    """

    is_writer = True  # this process writes the run's files (the journal); a distributed run's rank 0 alone

    def __init__(self, cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> None:
        assert cfg.dp is not None
        self.cfg, self.out, self.device, self.dp, self.resumed = cfg, out, device, cfg.dp, resumed
        self.seeds, self.replayable = self._run_seeds(resumed=resumed)
        self._seeds_lost = resumed and not self.replayable  # private/seeds.json was missing: fresh seeds drawn
        # what is spent before the first step: the DP vocabulary (released by the task's build, with the seed below)
        # and the row pre-selection (drawn by the trainer's setup)
        self.prefix = plan.prefix_of(cfg)
        self.prefix_seed = self.seeds.noise if self.prefix.vocabulary else None
        self.unit_info: dict[str, Any] | None = None
        self._journal_floor = 0  # the journal's steps when the run resumed (it is never written lower)
        if self.prefix.vocabulary and not resumed:  # journaled before the task's build draws and writes the release
            self._write_journal(self._prefix_ledger())

    def _run_seeds(self, *, resumed: bool) -> tuple[rng.RunSeeds, bool]:
        """The run's seeds and whether it replays exactly (``widedp.dp.rng.run_seeds``)."""
        return rng.run_seeds(self.out, mode=self.dp.rng, seed=self.cfg.train.seed, resume=resumed)

    def _plan(self, *, num_rows: int, n: int) -> None:
        """The privacy plan over ``n`` samples (or units): the ledger, starting with the prefix's entries
        (``self.prefix``, each recorded once), sigma (or the selection's epsilon) calibrated for the whole run with
        the prefix, what each step spends, the budget cap; the noise generator."""
        self.ledger = self._prefix_ledger()
        self.plan = plan.plan(self.cfg, self.prefix, num_rows=num_rows, n=n, new=not self.resumed)
        self.dp, self.spend, self.cap = self.plan.dp, self.plan.spend, self.plan.cap
        self.prefix = self.plan.prefix  # with dp.max_batch_size's bound and δ_B (plan.bounded)
        b = self.cfg.train.batch_size
        self.n_draw, self.sampling_rate = n, plan.sampling_rate(self.dp, b, n)
        if self.is_writer and not 0.5 <= self.sampling_rate * n / b <= 2:  # a fixed q far from b/N: utility only
            print(f"widedp: warning: dp.sampling_rate {self.sampling_rate:g} draws {self.sampling_rate * n:,.0f} "
                  f"training units per step on average, but train.batch_size (the noise's denominator) is {b:,}",
                  file=sys.stderr)
        self.per_epoch = plan.steps_per_epoch(b, n, rate=self.dp.sampling_rate)
        self.total = plan.total_steps(self.cfg, n)
        if self.cap == 0 and not self.resumed:
            self._refuse_no_step()
        self.noise_gen = rng.generator(self.seeds.noise, self.device)

    def _refuse_no_step(self) -> None:
        """A budget that allows no training step: refused before the run starts (it would end "finished" with the
        initial weights, which ``widedp export`` would release), naming what the prefix and one step spend."""
        dp, prefix = self.dp, self.prefix
        one = plan.composed_epsilon(prefix, dp, [(self.spend, 1)])
        spent = f"one step spends ε={one:.4g}"
        if prefix.entries:
            spent = f"{prefix.what()} spends ε={plan.composed_epsilon(prefix, dp, []):.4g}, with one step ε={one:.4g}"
        raise ConfigError(f"dp.target_epsilon: {dp.target_epsilon:g} allows no training step ({spent} at "
                          f"δ={dp.delta:g}); raise it, or spend less per step (dp.noise_multiplier, the selection's)")

    def _prefix_ledger(self) -> accounting.Ledger:
        """A ledger of what is spent before the first step (``self.prefix.entries``, each part once)."""
        ledger = accounting.Ledger()
        for p in self.prefix.entries:
            ledger.add(p)
        return ledger

    def start(self) -> dict[str, Any]:
        if self.prefix.entries:
            self._write_journal(self.ledger)  # the prefix's spend, before anything derived from it leaves
        return {"dp": {"noise_multiplier": self.dp.noise_multiplier, "selection": self.dp.selection.name,
                       "budget_steps": self.cap}}

    @property
    def trained(self) -> int:
        """Training steps recorded (the prefix is not a step)."""
        return self.ledger.steps - len(self.prefix.entries)

    def exhausted(self) -> bool:
        return self.cap is not None and self.trained >= self.cap

    def reserve(self, steps: int) -> None:
        """Record the next ``steps`` steps (fewer when the cap is nearer) in the journal before any of them can leave
        the process."""
        pending = accounting.Ledger.from_json(self.ledger.to_json())
        pending.add(self.spend, count=steps if self.cap is None else min(steps, self.cap - self.trained))
        self._write_journal(pending)

    def _write_journal(self, ledger: accounting.Ledger) -> None:
        """Write the journal (the writer alone), never lowering it: a resumed run that replays its lost steps
        exactly spends again only what the journal already holds, so until it passes the journal's high-water mark
        the journal stays (a second crash, then a resume without ``private/``, must still count those steps)."""
        if self.is_writer and ledger.steps >= self._journal_floor:
            journal.write_journal(self.out, ledger)

    def _restart_randomness(self, step: int) -> None:
        """The generators' states at checkpoint ``step`` are lost (``RUN/private/rng-STEP.pt`` deleted or unreadable)
        though the seeds remain: continue from fresh seeds (``rng.fresh_seeds``), never from the old ones, which
        would redraw step 0's noise and the lost steps' batches. The lost steps stay spent (``_resumed_ledger`` with
        ``replayable=False``)."""
        self.seeds = self._fresh_seeds(step)
        if self.is_writer:
            rng.save_seeds(self.out, self.seeds)
        self.replayable = False
        self._reseed()

    def _fresh_seeds(self, step: int) -> rng.RunSeeds:
        return rng.fresh_seeds(self.seeds, step)

    def _reseed(self) -> None:
        """Seed the trainer's generators (in place) and samplers from ``self.seeds``."""
        rng.seed_generator(self.noise_gen, self.seeds.noise)

    def _resumed_ledger(self, ckpt: dict[str, Any], *, replayable: bool, lost: str | None = None
                        ) -> accounting.Ledger:
        """The checkpoint's ledger, or the journal's when the lost steps cannot be replayed (they stay spent).
        ``lost``: the missing private file that makes them unreplayable; the writer then says so in one line
        (``journal.warn_redrawn``)."""
        written = journal.read_journal(self.out)
        self._journal_floor = written.steps if written is not None else 0
        checkpointed = accounting.Ledger.from_json(ckpt["ledger"])
        ledger = journal.resumed_ledger(checkpointed, written, replayable=replayable)
        if lost is not None and self.is_writer:
            journal.warn_redrawn(lost, step=ckpt["step"], recharged=ledger.steps - checkpointed.steps)
        return ledger

    def _lost_state(self, step: int, *, rank: int | None = None) -> str:
        """The private file whose loss keeps a resume at checkpoint ``step`` from replaying: the seeds (missing when
        the trainer started), else the generator states of ``step`` (of ``rank``)."""
        if self._seeds_lost:
            return str(self.out / rng.PRIVATE_DIR / rng.SEEDS_FILE)
        return str(rng.state_path(self.out, step, rank=rank))

    def epsilons(self) -> dict[str, Any]:
        return run_summary.epoch_epsilons(self.dp, self.ledger, self.prefix)

    def prune_private(self, step: int) -> None:
        rng.prune_states(self.out, step)

    def close(self) -> None:
        self._write_journal(self.ledger)  # the run is over: what it spent is exactly the ledger

    def _dp_summary(self, *, stopped: bool) -> dict[str, Any]:
        """summary.json's ``dp`` keys both trainers write (each adds its epsilons)."""
        dp = self.dp
        return {"delta": dp.delta, "noise_multiplier": dp.noise_multiplier, "selection": dp.selection.name,
                "selection_epsilon": getattr(dp.selection, "epsilon", None), "accountant": dp.accountant,
                "stopped_by_budget": stopped, "budget_steps": self.cap, "target_epsilon": dp.target_epsilon,
                "rng": dp.rng, "ledger": self.ledger.to_json()}

    def _nonfinite_stats(self, count: int, step: int) -> dict[str, Any]:
        if count:
            run_summary.warn_nonfinite(count, step)
        return {"nonfinite_samples": count}
