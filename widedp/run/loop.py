"""The one training loop: sample -> trainer step -> ledger / journal -> log -> evaluate -> checkpoint -> summary.

Every task the loop trains (``widedp.tasks.Task``: cbow, recsys, module) and every trainer (``widedp.run.trainers``:
non-private, widedp's DP step, the Opacus baseline) runs through ``run``; ``widedp.run.train.train`` (the CLI's
``widedp train`` and the Python API) calls it. What differs between trainers is in the trainer objects; what differs
between tasks is in the task objects.

The run directory it writes: config.yaml (resolved), metrics.jsonl, summary.json, loss.png, checkpoint.pt, the
task's files (vocab.json, features.json, ...), and with DP spent.json (the privacy ledger journal) and private/ (the
secret seeds and generator states that resume needs; mode 0700). The run directory is private working state:
metrics.jsonl, summary.json and loss.png hold non-private statistics of the training batches.

On several processes (``widedp.distributed.ranks``) every rank runs this loop; the trainer's ``is_writer`` (rank 0)
writes the run's files, the other ranks build into a scratch folder and write only their part of the checkpoint and
their generator states (``widedp.distributed.shards``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from widedp.config import Config
from widedp.distributed import ranks, signals
from widedp.errors import ConfigError
from widedp.resources import set_threads
from widedp.run import summary as run_summary
from widedp.run.checkpoint import load_checkpoint, save_checkpoint, write_json, write_text
from widedp.run.plots import plot_losses
from widedp.run.trainers import Trainer, make_trainer
from widedp.tasks.protocol import Built, Task


@torch.inference_mode()
def evaluate(model: Any, split: Any, *, batch_size: int, max_samples: int = 0) -> float | None:
    """Mean per-sample loss over a split (or its first ``max_samples`` samples); None for an empty split (JSON
    null in metrics.jsonl and summary.json: no loss, never a bare NaN)."""
    n = len(split) if not max_samples else min(max_samples, len(split))
    if n == 0:
        return None
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size), device=total.device)
        total += model(split.batch(idx)).double().sum()
    return float(total) / n


def epoch_record(trainer: Trainer, splits: dict[str, Any], tc: Any, epoch: int, step: int) -> dict[str, Any]:
    """The losses of the three splits after ``step`` steps (epoch ``epoch + 1``) and the epsilon spent so far."""
    model = trainer.eval_model()
    model.eval()
    rec: dict[str, Any] = {"epoch": epoch + 1, "step": step}
    for k in ("train", "valid", "test"):
        rec[f"{k}_loss"] = evaluate(model, splits[k], batch_size=tc.eval_batch_size, max_samples=tc.eval_max_samples)
    model.train()
    rec.update(trainer.epsilons())
    return rec


def warn_empty_splits(splits: dict[str, Any]) -> None:
    """One line on stderr when the valid or test split is empty (``data.splits`` gives it no share): its losses
    are null, and train.keep_best has nothing to choose by."""
    empty = [k for k in ("valid", "test") if len(splits[k]) == 0]
    if empty:
        print(f"widedp: warning: data.splits: the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} "
              f"empty: {' and '.join(f'{k}_loss' for k in empty)} will be null (no held-out evaluation)",
              file=sys.stderr)


def drop_metrics_after(path: Path, step: int) -> None:
    """On resume: drop the metrics lines logged after the checkpoint's ``step`` (the resumed run logs them again) and
    a line the kill cut short."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step):
            keep.append(line + "\n")
    write_text(path, "".join(keep))


@dataclass
class RunState:
    """What a run carries from step to step: what its checkpoint saves (step, history, elapsed, best), the
    accumulators of the log interval under way, and the timers that keep evaluation and checkpoints out of the
    training time."""

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # the epoch records
    elapsed: float = 0.0  # training seconds of the attempts before a resume
    best: dict[str, Any] = field(default_factory=dict)  # train.keep_best: epoch, valid_loss, model
    stopped_by_budget: bool = False
    saved: int | None = None  # the step of the last checkpoint (None: none yet)
    t0: float = 0.0  # when this attempt's training began
    aside: float = 0.0  # seconds of evaluation and checkpoints since t0
    loss_acc: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # the interval's summed losses
    acc_steps: int = 0  # the interval's steps
    acc_samples: int = 0  # the interval's samples
    t_window: float = 0.0  # when the interval began (moved on by the time set aside)

    @classmethod
    def resumed(cls, ckpt: dict[str, Any]) -> RunState:
        """The state a checkpoint saved."""
        return cls(step=ckpt["step"], history=ckpt["history"], elapsed=ckpt["elapsed"], best=ckpt.get("best", {}),
                   saved=ckpt["step"])

    def training_seconds(self) -> float:
        """Training time so far, this attempt's and the earlier ones': without evaluation and checkpoints."""
        return self.elapsed + time.perf_counter() - self.t0 - self.aside


def run(cfg: Config, task: Task, out: Path, *, resume: bool, progress: bool | str, data: Any = None
        ) -> dict[str, Any]:
    """Train ``cfg`` into ``out`` (locked and prepared by the caller); returns the summary (also in summary.json).
    ``data``: prepared data for the task's build (canaries, a sweep's shared corpus). ``progress``: True (a bar),
    ``"lines"`` (a line per log interval on stderr) or False."""
    t_setup = time.perf_counter()
    set_threads(cfg.train.threads)
    device = ranks.resolve_device(cfg.train.device)
    task.check(cfg, private=cfg.dp is not None)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = _resume_checkpoint(cfg, out, resume=resume, data=data, device=device)
    trainer = make_trainer(cfg, out, device=device, resumed=ckpt is not None)
    built = _build(cfg, task, out, trainer, device=device, data=data, ckpt=ckpt)
    trainer.setup(built, task)
    if trainer.is_writer:
        task.warn(cfg)  # (after the setup, so that a config error stays one line)
        warn_empty_splits(built.splits)
    state = RunState()
    if ckpt is not None:
        trainer.module.load_state_dict(ckpt["model"])
        trainer.load_state_dict(ckpt)
        state = RunState.resumed(ckpt)
        if trainer.is_writer:
            drop_metrics_after(out / "metrics.jsonl", state.step)
            print(f"widedp: resuming {out} from step {state.step} of {trainer.total}", file=sys.stderr)
    loop = _Loop(cfg, trainer, built, out=out, device=device, state=state)
    if ckpt is None:
        loop.log_start(task)
    setup_s = time.perf_counter() - t_setup
    with signals.noting(lambda: signals.Position(out, step=state.step, total=trainer.total, checkpoint=state.saved,
                                                 world=ranks.world())):  # what an interrupt's line says
        wall = loop.train(progress=progress)
        loop.finish()
    return loop.summarize(task, built, wall=wall, setup_s=setup_s)


def _resume_checkpoint(cfg: Config, out: Path, *, resume: bool, data: Any, device: Any) -> dict[str, Any] | None:
    """The checkpoint a resumed run goes on from (None: a new run), checked against this config and world size."""
    if resume and data is None and (out / "canaries.json").exists():
        raise ConfigError(f"{out}: trained with canaries; resume it by re-running the same `widedp canary` command")
    ckpt = load_checkpoint(out, map_location=device) if resume else None
    if ckpt is not None and ckpt["config_hash"] != cfg.hash():
        raise ConfigError(f"{out}: checkpoint was written by a different config (hash {ckpt['config_hash']})")
    was = ckpt.get("world_size", 1) if ckpt is not None else 1
    if ckpt is not None and (was > 1) != (ranks.world() > 1):  # (a sharded checkpoint reshards to any N >= 2)
        on = "one process (no --nproc)" if was == 1 else f"2 or more (widedp train --resume {out} --nproc {was})"
        raise ConfigError(f"{out}: trained on {was} process(es); resume it on {on}, not {ranks.world()}")
    return ckpt


def _build(cfg: Config, task: Task, out: Path, trainer: Trainer, *, device: Any, data: Any,
           ckpt: dict[str, Any] | None) -> Built:
    """The task's model and splits: the writer builds into ``out`` (the task's files) and writes config.yaml, the
    other ranks build into a scratch folder. A resumed run's training split must be the checkpoint's."""
    if trainer.is_writer:
        built = task.build(cfg, out, device=device, data=data, noise_seed=trainer.prefix_seed,
                           resumed=ckpt is not None)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        ranks.share_release(out)
    else:  # the task's files are rank 0's to write (a rank > 0 of a distributed run)
        with tempfile.TemporaryDirectory(prefix="widedp-rank-") as scratch:
            ranks.share_release(Path(scratch))  # rank 0's DP vocabulary: loaded, never drawn again
            built = task.build(cfg, Path(scratch), device=device, data=data, noise_seed=trainer.prefix_seed)
    n = len(built.splits["train"])
    if ckpt is not None and ckpt.get("n_train") != n:
        was = ckpt.get("n_train")
        raise ConfigError(f"{out}: the training split is not the one this run trained on ("
                          + (f"{was:,} examples then, {n:,} now" if was is not None else
                             "its checkpoint predates widedp recording it; the CBOW and recommender splits changed "
                             "with the record-local split")
                          + "): start a new run (--overwrite)")
    return built


class _Loop:
    """One run's loop over its ``RunState``: steps, interval and epoch records in metrics.jsonl, checkpoints, the
    summary. Only the writer (``trainer.is_writer``) writes the run's files; the others log to /dev/null."""

    def __init__(self, cfg: Config, trainer: Trainer, built: Built, *, out: Path, device: Any, state: RunState) -> None:
        self.cfg, self.tc, self.trainer, self.out, self.device, self.state = cfg, cfg.train, trainer, out, device, state
        self.splits = built.splits
        self.n = len(built.splits["train"])
        self.writer = trainer.is_writer
        self.lines = False  # a plain progress line per log interval (``train``'s progress="lines")
        self.total, self.per_epoch = trainer.total, trainer.per_epoch
        self.metrics = (out / "metrics.jsonl").open("a") if self.writer else open(os.devnull, "w")  # noqa: SIM115

    def log(self, rec: dict[str, Any]) -> None:
        """One line of metrics.jsonl, flushed."""
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()

    def record(self, epoch: int) -> None:
        """The epoch record after the current step (history and metrics.jsonl); keep_best's best epoch."""
        s, tc = self.state, self.tc
        s.history.append(epoch_record(self.trainer, self.splits, tc, epoch, s.step))
        self.log({"kind": "epoch", **s.history[-1]})
        rec = s.history[-1]
        if (tc.keep_best and rec["epoch"] > 0 and rec["valid_loss"] is not None
                and rec["valid_loss"] < s.best.get("valid_loss", float("inf"))):
            s.best.update(epoch=rec["epoch"], valid_loss=rec["valid_loss"],
                          model={k: v.detach().clone() for k, v in self.trainer.module.state_dict().items()})

    def checkpoint(self) -> None:
        """The private state (private/, a sharded run's shards), then checkpoint.pt, then the older private state
        pruned."""
        s, trainer = self.state, self.trainer
        trainer.save_private(s.step, best=s.best)  # private/ (a sharded run's part of the checkpoint), first
        state = {"model": trainer.module.state_dict(), "step": s.step, "history": s.history,
                 "elapsed": s.training_seconds(), "config_hash": self.cfg.hash(), "best": s.best, "n_train": self.n,
                 **trainer.state_dict()}
        if self.writer:
            save_checkpoint(self.out, state)
        s.saved = s.step
        trainer.prune_private(s.step)

    def log_start(self, task: Task) -> None:
        """A new run's first records: the initial evaluation (epoch 0), the notices and the "start" line."""
        start = self.trainer.start()  # (a prefix's journal entry, before anything derived from it is logged)
        self.state.history.append(epoch_record(self.trainer, self.splits, self.tc, -1, 0))
        self.log({"kind": "notice", "text": run_summary.DIAGNOSTICS_NOTICE})
        if scored := task.metrics_model(self.cfg):  # e.g. the full model, when the release leaves a table out
            self.log({"kind": "notice", "metrics_model": scored, "text": f"the losses and metrics here score {scored}"})
        self.log({"kind": "start", "n_train": self.n, "n_units": None, "steps_per_epoch": self.per_epoch,
                  "total_steps": self.total, **start})

    def train(self, *, progress: bool | str) -> float:
        """Step to the last step (or to the budget stop); returns the training seconds (``RunState.elapsed``
        included; evaluation and checkpoints not). ``progress``: True = a progress bar, ``"lines"`` = one plain
        line per log interval on stderr (logs that are not a terminal), False = nothing."""
        s, trainer, tc = self.state, self.trainer, self.tc
        self.lines = progress == "lines" and self.writer
        bar = tqdm(total=self.total, initial=s.step, disable=progress is not True, unit="step", dynamic_ncols=True)
        s.loss_acc = torch.zeros((), device=self.device)
        s.acc_steps, s.acc_samples, s.t0 = 0, 0, time.perf_counter()
        s.t_window, s.aside = s.t0, 0.0
        while s.step < self.total:
            signals.check()  # an interrupt whose exception a finaliser swallowed still stops the run
            epoch = s.step // self.per_epoch
            if trainer.exhausted():
                s.stopped_by_budget = True
                break
            if s.acc_steps == 0:  # DP: reserve the interval in the journal before any of it can leave the process
                trainer.reserve(min(tc.log_every, self.total - s.step))
            drawn = trainer.sample(s.step)
            s.loss_acc += trainer.step(drawn, epoch).loss_sum
            s.acc_samples += drawn.samples
            s.step += 1
            s.acc_steps += 1
            bar.update(1)
            end_of_epoch = s.step % self.per_epoch == 0 or s.step == self.total
            if s.acc_steps == tc.log_every or end_of_epoch:
                self.log_interval(epoch, bar)
            if end_of_epoch or (tc.checkpoint_every and s.step % tc.checkpoint_every == 0):
                self.record_and_checkpoint(epoch if end_of_epoch else None)
        bar.close()
        return s.training_seconds()

    def log_interval(self, epoch: int, bar: tqdm) -> None:
        """The "interval" line of the steps since the last one; the accumulators start over."""
        s = self.state
        rec = {"kind": "interval", "step": s.step, "epoch": epoch, "samples": s.acc_samples,
               "train_loss": float(s.loss_acc) / max(s.acc_samples, 1),
               "samples_per_s": s.acc_samples / (time.perf_counter() - s.t_window),
               **self.trainer.interval_stats(s.acc_steps, s.step)}
        self.log(rec)
        eps = {"eps": f"{s.history[-1]['epsilon']:.3g}"} if "epsilon" in s.history[-1] else {}
        bar.set_postfix(loss=f"{rec['train_loss']:.4f}", **eps)
        if self.lines:
            print(f"widedp: step {s.step}/{self.total} (epoch {epoch + 1}) train_loss {rec['train_loss']:.4f} "
                  f"{rec['samples_per_s']:,.0f} samples/s"
                  + (f" (ε {eps['eps']} at the end of epoch {s.history[-1]['epoch']})" if eps else ""),
                  file=sys.stderr, flush=True)
        s.loss_acc.zero_()
        s.acc_steps, s.acc_samples, s.t_window = 0, 0, time.perf_counter()

    def record_and_checkpoint(self, epoch: int | None) -> None:
        """The epoch record (``epoch`` given: an epoch ended) and a checkpoint, their time set aside: evaluation
        and checkpoints do not count as training time."""
        s = self.state
        t_aside = time.perf_counter()
        if epoch is not None:
            self.record(epoch)
        self.checkpoint()
        s.aside += time.perf_counter() - t_aside
        s.t_window += time.perf_counter() - t_aside

    def finish(self) -> None:
        """After the loop: the last epoch record if it is missing, keep_best's weights, the last checkpoint."""
        s = self.state
        if s.acc_steps or s.stopped_by_budget or s.step == self.total:
            if not s.history or s.history[-1]["step"] != s.step:
                self.record(s.step // self.per_epoch)
            if s.best and s.best["epoch"] != s.history[-1]["epoch"]:  # keep_best: end with the best epoch's weights
                self.trainer.module.load_state_dict(s.best["model"])
                self.log({"kind": "kept_best", "epoch": s.best["epoch"], "valid_loss": s.best["valid_loss"]})
            self.checkpoint()

    def summarize(self, task: Task, built: Built, *, wall: float, setup_s: float) -> dict[str, Any]:
        """Close the trainer; the summary (summary.json), the task's final evaluation, loss.png."""
        s, trainer, out, writer = self.state, self.trainer, self.out, self.writer
        trainer.close()
        rep = trainer.report(stopped=s.stopped_by_budget)
        summary = run_summary.summary(self.cfg, s.history, step=s.step, per_epoch=self.per_epoch, wall=wall,
                                      setup_s=setup_s, n=self.n, st=rep.statement, unit_info=trainer.unit_info,
                                      kept_epoch=s.best.get("epoch") if self.tc.keep_best else None)
        if rep.dp is not None:
            summary["dp"] = rep.dp
        trainer.eval_model()  # the task's model holds the final weights
        final = task.finish(self.cfg, out, built)  # on every rank: a sharded model's evaluation is collective
        if final:
            summary.update(final)
            self.log({"kind": "eval", "step": s.step, **final})
        self.metrics.close()
        summary["wall_s"] = wall + s.aside + setup_s  # training + evaluation + checkpoints + setup
        if writer:
            write_json(out / "summary.json", summary)
            plot_losses(s.history, out / "loss.png", title=rep.title)
        if s.stopped_by_budget and writer:
            print(f"widedp: stopped at step {s.step}: the next step would exceed dp.target_epsilon="
                  f"{trainer.dp.target_epsilon} (checkpoint saved in {out})")  # type: ignore[union-attr]
        return summary
