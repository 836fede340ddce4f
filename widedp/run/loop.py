"""The one training loop: sample -> engine step -> ledger / journal -> log -> evaluate -> checkpoint -> summary.

Every task the loop trains (``widedp.tasks.Task``: cbow, recsys, module) and every engine (``widedp.run.engines``:
non-private, widedp's DP step, the Opacus baseline) runs through ``run``; ``widedp.run.train.train`` (the CLI's
``widedp train`` and the Python API) calls it. What differs between engines is in the engine objects; what differs
between tasks is in the task objects.

The run directory it writes: config.yaml (resolved), metrics.jsonl, summary.json, loss.png, checkpoint.pt, the
task's files (vocab.json, features.json, ...), and with DP spent.json (the privacy ledger journal) and private/ (the
secret seeds and generator states that resume needs; mode 0700). The run directory is private working state:
metrics.jsonl, summary.json and loss.png hold non-private statistics of the training batches.

On several processes (``widedp.run.ranks``) every rank runs this loop; the engine's ``is_writer`` (rank 0) writes
the run's files, the other ranks build into a scratch folder and write only their own shards and generator states
(``widedp.run.shards``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from widedp.config import Config
from widedp.errors import ConfigError
from widedp.run import ranks
from widedp.run import summary as run_summary
from widedp.run.checkpoint import load_checkpoint, save_checkpoint, write_json, write_text
from widedp.run.engines import Engine, make_engine
from widedp.run.plots import plot_losses
from widedp.tasks.protocol import Task


@torch.inference_mode()
def evaluate(model: Any, split: Any, *, batch_size: int, max_samples: int = 0) -> float:
    """Mean per-sample loss over a split (or its first ``max_samples`` samples)."""
    n = len(split) if not max_samples else min(max_samples, len(split))
    if n == 0:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size), device=total.device)
        total += model(split.batch(idx)).double().sum()
    return float(total) / n


def epoch_record(engine: Engine, splits: dict[str, Any], tc: Any, epoch: int, step: int) -> dict[str, Any]:
    """The losses of the three splits after ``step`` steps (epoch ``epoch + 1``) and the epsilon spent so far."""
    model = engine.eval_model()
    model.eval()
    rec: dict[str, Any] = {"epoch": epoch + 1, "step": step}
    for k in ("train", "valid", "test"):
        rec[f"{k}_loss"] = evaluate(model, splits[k], batch_size=tc.eval_batch_size, max_samples=tc.eval_max_samples)
    model.train()
    rec.update(engine.epsilons())
    return rec


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


def run(cfg: Config, task: Task, out: Path, *, resume: bool, progress: bool, data: Any = None) -> dict[str, Any]:
    """Train ``cfg`` into ``out`` (locked and prepared by the caller); returns the summary (also in summary.json).
    ``data``: prepared data for the task's build (canaries, a sweep's shared corpus)."""
    t_setup = time.perf_counter()
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = ranks.resolve_device(tc.device)
    task.check(cfg, private=cfg.dp is not None)
    out.mkdir(parents=True, exist_ok=True)
    if resume and data is None and (out / "canaries.json").exists():
        raise ConfigError(f"{out}: trained with canaries; resume it by re-running the same `widedp canary` command")
    ckpt = load_checkpoint(out, map_location=device) if resume else None
    if ckpt is not None and ckpt["config_hash"] != cfg.hash():
        raise ConfigError(f"{out}: checkpoint was written by a different config (hash {ckpt['config_hash']})")
    if ckpt is not None and ckpt.get("world_size", 1) != ranks.world():
        raise ConfigError(f"{out}: trained on {ckpt.get('world_size', 1)} process(es); resume it on as many "
                          f"(widedp train --resume {out} --nproc {ckpt.get('world_size', 1)}), not {ranks.world()}")

    engine = make_engine(cfg, out, device=device, resumed=ckpt is not None)
    writer = engine.is_writer  # (False: a rank > 0 of a distributed run)
    if writer:
        built = task.build(cfg, out, device=device, data=data, noise_seed=engine.prefix_seed,
                           resumed=ckpt is not None)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    else:  # the task's files are rank 0's to write
        with tempfile.TemporaryDirectory(prefix="widedp-rank-") as scratch:
            built = task.build(cfg, Path(scratch), device=device, data=data, noise_seed=engine.prefix_seed)
    n = len(built.splits["train"])
    if ckpt is not None and ckpt.get("n_train") != n:
        was = ckpt.get("n_train")
        raise ConfigError(f"{out}: the training split is not the one this run trained on ("
                          + (f"{was:,} examples then, {n:,} now" if was is not None else
                             "its checkpoint predates widedp recording it; the CBOW and recommender splits changed "
                             "with the record-local split")
                          + "): start a new run (--overwrite)")
    engine.setup(built, task)
    if writer:
        task.warn(cfg)  # (after the setup, so that a config error stays one line)
    splits = built.splits
    step, history, elapsed = 0, [], 0.0
    best: dict[str, Any] = {}  # train.keep_best: epoch, valid_loss, model
    if ckpt is not None:
        engine.module.load_state_dict(ckpt["model"])
        engine.load_state_dict(ckpt)
        step, history, elapsed, best = ckpt["step"], ckpt["history"], ckpt["elapsed"], ckpt.get("best", {})
    total, per_epoch = engine.total, engine.per_epoch
    if ckpt is not None and writer:
        drop_metrics_after(out / "metrics.jsonl", step)
    metrics = (out / "metrics.jsonl").open("a") if writer else open(os.devnull, "w")  # noqa: SIM115

    def log(rec: dict[str, Any]) -> None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    def record(epoch: int) -> None:
        history.append(epoch_record(engine, splits, tc, epoch, step))
        log({"kind": "epoch", **history[-1]})
        rec = history[-1]
        if tc.keep_best and rec["epoch"] > 0 and rec["valid_loss"] < best.get("valid_loss", float("inf")):
            best.update(epoch=rec["epoch"], valid_loss=rec["valid_loss"],
                        model={k: v.detach().clone() for k, v in engine.module.state_dict().items()})

    def checkpoint() -> None:
        engine.save_private(step)  # private/ (and a sharded run's shards), before the checkpoint
        state = {"model": engine.module.state_dict(), "step": step, "history": history,
                 "elapsed": elapsed + time.perf_counter() - t0 - aside, "config_hash": cfg.hash(), "best": best,
                 "n_train": n, **engine.state_dict()}
        if writer:
            save_checkpoint(out, state)
        engine.prune_private(step)

    if ckpt is None:
        start = engine.start()  # (a prefix's journal entry, before anything derived from it is logged)
        history.append(epoch_record(engine, splits, tc, -1, 0))
        log({"kind": "notice", "text": run_summary.DIAGNOSTICS_NOTICE})
        if scored := task.metrics_model(cfg):  # e.g. the full model, when the release leaves a table out
            log({"kind": "notice", "metrics_model": scored, "text": f"the losses and metrics here score {scored}"})
        log({"kind": "start", "n_train": n, "n_units": None, "steps_per_epoch": per_epoch, "total_steps": total,
             **start})
    setup_s = time.perf_counter() - t_setup
    stopped_by_budget = False
    bar = tqdm(total=total, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
    loss_acc = torch.zeros((), device=device)
    acc_steps, acc_samples, t0 = 0, 0, time.perf_counter()
    t_window, aside = t0, 0.0
    while step < total:
        epoch = step // per_epoch
        if engine.exhausted():
            stopped_by_budget = True
            break
        if acc_steps == 0:  # DP: reserve the interval in the journal before any of it can leave the process
            engine.reserve(min(tc.log_every, total - step))
        drawn = engine.sample(step)
        loss_acc += engine.step(drawn, epoch).loss_sum
        acc_samples += drawn.samples
        step += 1
        acc_steps += 1
        bar.update(1)
        end_of_epoch = step % per_epoch == 0 or step == total
        if acc_steps == tc.log_every or end_of_epoch:
            rec = {"kind": "interval", "step": step, "epoch": epoch, "samples": acc_samples,
                   "train_loss": float(loss_acc) / max(acc_samples, 1),
                   "samples_per_s": acc_samples / (time.perf_counter() - t_window),
                   **engine.interval_stats(acc_steps, step)}
            log(rec)
            bar.set_postfix(loss=f"{rec['train_loss']:.4f}",
                            **({"eps": f"{history[-1]['epsilon']:.3g}"} if "epsilon" in history[-1] else {}))
            loss_acc.zero_()
            acc_steps, acc_samples, t_window = 0, 0, time.perf_counter()
        if end_of_epoch or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
            t_aside = time.perf_counter()  # evaluation and checkpoints do not count as training time
            if end_of_epoch:
                record(epoch)
            checkpoint()
            aside += time.perf_counter() - t_aside
            t_window += time.perf_counter() - t_aside
    bar.close()
    wall = elapsed + time.perf_counter() - t0 - aside  # training time: without evaluation and checkpoints
    if acc_steps or stopped_by_budget or step == total:
        if not history or history[-1]["step"] != step:
            record(step // per_epoch)
        if best and best["epoch"] != history[-1]["epoch"]:  # keep_best: end with the best epoch's weights
            engine.module.load_state_dict(best["model"])
            log({"kind": "kept_best", "epoch": best["epoch"], "valid_loss": best["valid_loss"]})
        checkpoint()
    engine.close()
    rep = engine.report(stopped=stopped_by_budget)
    summary = run_summary.summary(cfg, history, step=step, per_epoch=per_epoch, wall=wall, setup_s=setup_s, n=n,
                                  st=rep.statement, unit_info=engine.unit_info,
                                  kept_epoch=best.get("epoch") if tc.keep_best else None)
    if rep.dp is not None:
        summary["dp"] = rep.dp
    engine.eval_model()  # the task's model holds the final weights
    final = task.finish(cfg, out, built) if writer else {}
    if final:
        summary.update(final)
        log({"kind": "eval", "step": step, **final})
    metrics.close()
    summary["wall_s"] = wall + aside + setup_s  # training + evaluation + checkpoints + setup
    if writer:
        write_json(out / "summary.json", summary)
        plot_losses(history, out / "loss.png", title=rep.title)
    if stopped_by_budget and writer:
        print(f"widedp: stopped at step {step}: the next step would exceed dp.target_epsilon="
              f"{engine.dp.target_epsilon} (checkpoint saved in {out})")  # type: ignore[union-attr]
    return summary
