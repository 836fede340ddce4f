"""``widedp train``: CBOW on a corpus, non-private or with the DP-sparse step (paper Alg. 3).

    widedp train configs/brown_cbow_sparse_exp.yaml --out runs/exp
    widedp train configs/brown_cbow_nonprivate.yaml --set train.epochs=1
    widedp train --resume runs/exp            # after a crash or kill -9

A run directory holds: config.yaml (resolved), metrics.jsonl, summary.json, loss.png, checkpoint.pt, vocab.json,
and with DP spent.json (the privacy ledger journal) and private/ (the secret seeds and generator states that resume
needs; mode 0700). The run directory is private working state: metrics.jsonl, summary.json and loss.png hold
non-private statistics of the training batches. Share only what ``widedp export`` writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from widedp import accounting
from widedp.config import Config, config_from_dict
from widedp.data_prep.cbow import CBOWData, prepare_cbow
from widedp.dp import rng, units
from widedp.dp.optim import make_row_optimizer
from widedp.dp.sampling import PoissonSampler, ShuffledBatches
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.step import dp_step
from widedp.errors import ConfigError
from widedp.run import budget, preselect_setup, run_budget, rundir
from widedp.run import summary as run_summary
from widedp.run.checkpoint import load_checkpoint, save_checkpoint, write_json
from widedp.run.plots import plot_losses
from widedp.tasks.cbow import SplitTensors, build_cbow, cbow_data, warn_vocabulary  # noqa: F401  (re-exported)

DP_OPTIMIZERS = ("sgd", "lazy_adam", "adam")
PLAIN_OPTIMIZERS = ("sgd", "adam", "sparse_adam")


#: task -> builder ``(cfg, out, *, device, data) -> (splits, model)``. A split has ``len()`` and ``batch(idx)``;
#: a model has ``forward(batch) -> [B] loss``, ``per_sample_row_grads(batch) -> (loss, PerSampleRows)``,
#: ``row_tables()`` and ``num_rows``: the one training loop and the one DP step serve every such task.
TASK_BUILDERS: dict[str, Any] = {
    "cbow": build_cbow,
    "recsys": "widedp.tasks.recsys:build_recsys",
}
#: tasks with their own algorithms (not the DP-sparse step): task -> ``train_fn(cfg, out, *, resume, progress)``.
TASK_TRAINERS: dict[str, str] = {
    "glm": "widedp.tasks.glm:train_glm",
}


def _resolve(ref: Any) -> Any:
    if not isinstance(ref, str):
        return ref
    import importlib

    mod, name = ref.split(":")
    return getattr(importlib.import_module(mod), name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name} requested but CUDA is not available")
    return torch.device(name)


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


def train(cfg: Config, out: Path, *, resume: bool = False, progress: bool = True, data: CBOWData | None = None,
          overwrite: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into run directory ``out``; returns the summary dict (also written to summary.json).

    ``data``: already prepared samples (e.g. with canaries inserted); default ``prepare_cbow(cfg.data)``.
    A directory that already holds a run is only resumed (``resume``) or replaced (``overwrite``); one process at a
    time writes it.
    """
    with rundir.locked(out):
        rundir.prepare(out, resume=resume, overwrite=overwrite)
        return _train(cfg, out, resume=resume, progress=progress, data=data)


def _train(cfg: Config, out: Path, *, resume: bool, progress: bool, data: CBOWData | None) -> dict[str, Any]:
    if cfg.task in TASK_TRAINERS:
        return _resolve(TASK_TRAINERS[cfg.task])(cfg, out, resume=resume, progress=progress)
    t_setup = time.perf_counter()
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = resolve_device(tc.device)
    _check_optimizer(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if resume and data is None and (out / "canaries.json").exists():
        raise ConfigError(f"{out}: trained with canaries; resume it by re-running the same `widedp canary` command")
    ckpt = load_checkpoint(out, map_location=device) if resume else None
    if ckpt is not None and ckpt["config_hash"] != cfg.hash():
        raise ConfigError(f"{out}: checkpoint was written by a different config (hash {ckpt['config_hash']})")

    preselect_setup.check_supported(cfg)
    if cfg.task == "cbow" and cfg.dp is not None and cfg.dp.engine == "opacus":
        if not units.is_per_sample(cfg) or cfg.data.vocabulary == "dp":
            raise ConfigError("dp.engine: opacus trains per (target, context) pair with the top-V or a file "
                              "vocabulary; privacy units and data.vocabulary: dp need dp.engine: widedp")
        from widedp.run.opacus_baseline import train_opacus

        data = data if data is not None else prepare_cbow(cfg.data)
        return train_opacus(cfg, out, data=data, resume=resume, progress=progress)
    b, dp = tc.batch_size, cfg.dp
    if dp is not None:  # secret seeds (dp.rng: secure) live in out/private/ only; never in config.yaml or logs
        seeds, replayable = rng.run_seeds(out, mode=dp.rng, seed=tc.seed, resume=ckpt is not None)
    rb = run_budget.for_config(cfg)
    release = None
    if cfg.task == "cbow":
        data, release = cbow_data(cfg, out, data=data, noise_seed=seeds.noise if rb.vocabulary else None)
    splits, model = _resolve(TASK_BUILDERS[cfg.task])(cfg, out, device=device, data=data)
    train_split, n = splits["train"], len(splits["train"])
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    grouped = units.train_units(cfg, train_split, device=device) if dp is not None else None
    n_dp = grouped.num_units if grouped is not None else n  # what Poisson sampling draws: units (or samples)
    if dp is not None:
        dp = run_budget.calibrated(cfg, num_rows=model.num_rows, n=n_dp, rb=rb)
        spend = budget.step_spend(dp, num_rows=model.num_rows, batch_size=b, n=n_dp)
        pre = preselect_setup.setup(cfg, out, model=model, split=train_split, grouped=grouped, noise_seed=seeds.noise,
                                    resume=ckpt is not None)  # dp.preselect: once, before the first step
        selector = preselect_setup.restrict_selector(make_selector(dp.selection, num_rows=model.num_rows), pre)
        optimizer: Any = make_row_optimizer(tc.optimizer, model.row_tables(), lr=tc.lr, betas=tc.betas, eps=tc.eps)
        noise_gen = torch.Generator(device=device)
        noise_gen.manual_seed(seeds.noise)
        sampler: Any = (PoissonSampler(n, sampling_rate=b / n, seed=seeds.sampling, device=device) if grouped is None
                        else units.UnitPoissonSampler(grouped, sampling_rate=b / n_dp, seed=seeds.sampling,
                                                      device=device))
        per_epoch = budget.steps_per_epoch(b, n_dp)
        budget_cap = run_budget.budget_steps(dp, spend, rb)
        warn_vocabulary(cfg)  # (after the setup, so that a config error stays one line)
    else:
        optimizer = _torch_optimizer(cfg, model)
        sampler = ShuffledBatches(n, batch_size=b, seed=tc.seed, device=device)
        per_epoch, budget_cap = sampler.steps_per_epoch, None
    ledger = accounting.Ledger()
    if dp is not None:
        for p in rb.prefix:  # the DP vocabulary and the row pre-selection, spent before the first step
            ledger.add(p)
    step, history, elapsed = 0, [], 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, history, elapsed = ckpt["step"], ckpt["history"], ckpt["elapsed"]
        if dp is not None:
            states = rng.load_states(out, step) if replayable else None
            if states is not None:
                noise_gen.set_state(states["noise"])
            ledger = budget.resumed_ledger(accounting.Ledger.from_json(ckpt["ledger"]), budget.read_journal(out),
                                           replayable=states is not None)
    total = budget.total_steps(cfg, n_dp)
    metrics = (out / "metrics.jsonl").open("a")

    def log(rec: dict[str, Any]) -> None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    best: dict[str, Any] = ckpt.get("best", {}) if ckpt is not None else {}  # keep_best: epoch, valid_loss, model

    def remember_best() -> None:
        rec = history[-1]
        if tc.keep_best and rec["epoch"] > 0 and rec["valid_loss"] < best.get("valid_loss", float("inf")):
            best.update(epoch=rec["epoch"], valid_loss=rec["valid_loss"],
                        model={k: v.detach().clone() for k, v in model.state_dict().items()})

    def checkpoint() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "history": history, "elapsed": elapsed + time.perf_counter() - t0 - aside,
                 "config_hash": cfg.hash(), "best": best}
        if dp is not None:  # (the journal is written ahead of each interval, never lowered here)
            state["ledger"] = ledger.to_json()
            rng.save_states(out, step, {"noise": noise_gen.get_state()})  # private/, before the checkpoint
        save_checkpoint(out, state)
        if dp is not None:
            rng.prune_states(out, step)

    if ckpt is None:
        if rb.prefix:
            budget.write_journal(out, ledger)  # the prefix's spend, before anything derived from it is logged
        history.append(_epoch_record(model, splits, tc, -1, 0, dp, ledger, rb))
        log({"kind": "notice", "text": run_summary.DIAGNOSTICS_NOTICE})
        log({"kind": "start", "n_train": n, "n_units": n_dp if grouped is not None else None,
             "steps_per_epoch": per_epoch, "total_steps": total,
             "dp": None if dp is None else {"noise_multiplier": dp.noise_multiplier,
                                            "selection": dp.selection.name, "budget_steps": budget_cap}})
    setup_s = time.perf_counter() - t_setup
    stopped_by_budget = False
    bar = tqdm(total=total, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
    loss_acc = torch.zeros((), device=device)
    stats_acc = torch.zeros(5, device=device)
    acc_steps, acc_samples, t0 = 0, torch.zeros((), device=device, dtype=torch.long), time.perf_counter()
    t_window, aside = t0, 0.0
    while step < total:
        epoch = step // per_epoch
        trained = ledger.steps - rb.prefix_steps  # training steps recorded (the prefix is not a step)
        if budget_cap is not None and trained >= budget_cap:
            stopped_by_budget = True
            break
        if dp is not None and acc_steps == 0:
            # reserve the interval in the journal before any of it can leave the process
            reserve = min(tc.log_every, total - step, (budget_cap - trained) if budget_cap else tc.log_every)
            pending = accounting.Ledger.from_json(ledger.to_json())
            pending.add(spend, count=reserve)
            budget.write_journal(out, pending)
        if grouped is not None:
            drawn = sampler.draw(step)
            idx = drawn.samples
        else:
            idx = sampler.batch(step)
        batch = train_split.batch(idx)
        if dp is not None:
            with torch.inference_mode():
                loss, grads = model.per_sample_row_grads(batch)
                if grouped is not None:  # one "sample" of the DP step = one unit's summed gradient
                    grads = units.group_rows(grads, drawn.segment, num_units=drawn.num_units)
                grads = preselect_setup.restrict_grads(grads, pre)  # dp.preselect: the kept rows only
                res = dp_step(grads, batch_size=b, sampling_rate=b / n_dp, clip1=dp.clip1, clip2=dp.clip2,
                              noise_multiplier=dp.noise_multiplier, selector=selector,
                              ctx=SelectionContext(epoch=epoch, num_epochs=tc.epochs), generator=noise_gen)
                optimizer.step(res.grad)
                st = res.stats
                stats_acc += torch.stack([st.touched_share.new_tensor(float(st.rows_selected)), st.touched_share,
                                          st.clipped1, st.clipped2.to(st.clipped1.dtype),
                                          st.nonfinite.to(st.clipped1.dtype)])
            ledger.add(res.spend)
            loss_acc += torch.where(torch.isfinite(loss), loss, 0.0).sum()  # a non-finite sample counts 0
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = model(batch)
            loss.mean().backward()
            optimizer.step()
            loss_acc += loss.detach().sum()
        acc_samples += idx.numel()
        step += 1
        acc_steps += 1
        bar.update(1)
        end_of_epoch = step % per_epoch == 0 or step == total
        if acc_steps == tc.log_every or end_of_epoch:
            now = time.perf_counter()
            samples = int(acc_samples)
            rec = {"kind": "interval", "step": step, "epoch": epoch, "samples": samples,
                   "train_loss": float(loss_acc) / max(samples, 1), "samples_per_s": samples / (now - t_window)}
            if dp is not None:
                s = (stats_acc / acc_steps).tolist()
                rec.update(dict(zip(("rows_selected", "touched_share", "clipped1", "clipped2"), s)))
                rec["nonfinite_samples"] = int(round(s[4] * acc_steps))
                if rec["nonfinite_samples"]:
                    run_summary.warn_nonfinite(rec["nonfinite_samples"], step)
            log(rec)
            bar.set_postfix(loss=f"{rec['train_loss']:.4f}",
                            **({"eps": f"{history[-1]['epsilon']:.3g}"} if "epsilon" in history[-1] else {}))
            loss_acc.zero_()
            stats_acc.zero_()
            acc_samples.zero_()
            acc_steps, t_window = 0, time.perf_counter()
        if end_of_epoch or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
            t_aside = time.perf_counter()  # evaluation and checkpoints do not count as training time
            if end_of_epoch:
                history.append(_epoch_record(model, splits, tc, epoch, step, dp, ledger, rb))
                log({"kind": "epoch", **history[-1]})
                remember_best()
            checkpoint()
            aside += time.perf_counter() - t_aside
            t_window += time.perf_counter() - t_aside
    bar.close()
    wall = elapsed + time.perf_counter() - t0 - aside  # training time: without evaluation and checkpoints
    if acc_steps or stopped_by_budget or step == total:
        if not history or history[-1]["step"] != step:
            history.append(_epoch_record(model, splits, tc, step // per_epoch, step, dp, ledger, rb))
            log({"kind": "epoch", **history[-1]})
            remember_best()
        if best and best["epoch"] != history[-1]["epoch"]:  # keep_best: end with the best epoch's weights
            model.load_state_dict(best["model"])
            log({"kind": "kept_best", "epoch": best["epoch"], "valid_loss": best["valid_loss"]})
        checkpoint()
    metrics.close()
    if dp is not None:
        budget.write_journal(out, ledger)  # the run is over: what it spent is exactly the ledger
    private_rng = dp is None or seeds.private
    unit_info = None
    if grouped is not None or release is not None:
        unit_info = {"privacy_unit": units.privacy_unit(cfg), "n_units": n_dp}
        if grouped is not None:
            unit_info.update({"max_samples_per_unit": grouped.cap, "samples_dropped_by_cap": grouped.dropped})
        if release is not None:
            unit_info["vocabulary"] = release.mechanism
    summary = run_summary.summary(cfg, dp, history, step=step, per_epoch=per_epoch, wall=wall, setup_s=setup_s,
                                  n=n, ledger=ledger, stopped=stopped_by_budget, cap=budget_cap,
                                  private_rng=private_rng, rb=rb, unit_info=unit_info,
                                  kept_epoch=best.get("epoch") if tc.keep_best else None)
    summary["wall_s"] = wall + aside + setup_s  # training + evaluation + checkpoints + setup
    write_json(out / "summary.json", summary)
    st = run_summary.run_statement(cfg, dp, ledger, private_rng=private_rng, rb=rb)
    plot_losses(history, out / "loss.png", title=run_summary.plot_title(cfg, dp, st))
    if stopped_by_budget:
        print(f"widedp: stopped at step {step}: the next step would exceed dp.target_epsilon="
              f"{dp.target_epsilon} (checkpoint saved in {out})")
    return summary


def _epoch_record(model: Any, splits: dict[str, Any], tc: Any, epoch: int, step: int, dp: Any,
                  ledger: accounting.Ledger, rb: run_budget.RunBudget) -> dict[str, Any]:
    model.eval()
    rec = {"epoch": epoch + 1, "step": step,
           "train_loss": evaluate(model, splits["train"], batch_size=tc.eval_batch_size,
                                  max_samples=tc.eval_max_samples),
           "valid_loss": evaluate(model, splits["valid"], batch_size=tc.eval_batch_size,
                                  max_samples=tc.eval_max_samples),
           "test_loss": evaluate(model, splits["test"], batch_size=tc.eval_batch_size,
                                 max_samples=tc.eval_max_samples)}
    model.train()
    rec.update(run_summary.epoch_epsilons(dp, ledger, rb))
    return rec


def _check_optimizer(cfg: Config) -> None:
    allowed = PLAIN_OPTIMIZERS if cfg.dp is None else DP_OPTIMIZERS
    if cfg.train.optimizer not in allowed:
        mode = "non-private" if cfg.dp is None else "DP"
        raise ConfigError(f"train.optimizer: {cfg.train.optimizer!r} is not available for {mode} training "
                          f"(expected one of {', '.join(allowed)})")
    if cfg.dp is None and cfg.train.optimizer == "sparse_adam" and not getattr(cfg.model, "sparse", True):
        raise ConfigError("train.optimizer: sparse_adam needs model.sparse: true")


def _torch_optimizer(cfg: Config, model: Any) -> torch.optim.Optimizer:
    tc = cfg.train
    if tc.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=tc.lr)
    if tc.optimizer == "sparse_adam":
        return torch.optim.SparseAdam(list(model.parameters()), lr=tc.lr, betas=tc.betas, eps=tc.eps)
    if getattr(cfg.model, "sparse", False):
        raise ConfigError("train.optimizer: adam (dense) needs model.sparse: false; use sparse_adam for sparse "
                          "embeddings")
    return torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps)


def load_run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a widedp run directory)")
    return config_from_dict(yaml.safe_load(path.read_text()))


def default_out(config_path: str | os.PathLike[str]) -> Path:
    return Path("runs") / Path(config_path).stem
