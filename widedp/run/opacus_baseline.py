"""The DP-SGD baseline: Opacus 1.6 ``PrivacyEngine`` on ``OpacusCBOW`` (``dp.engine: opacus``).

Called by ``widedp.run.train.train``; writes the same run directory (config.yaml, metrics.jsonl, summary.json, loss.png,
checkpoint.pt, vocab.json, spent.json). What is Opacus' and what is ours:

- Opacus: per-sample gradients (``grad_sample_mode="hooks"`` on ``nn.Embedding`` only — the layers where Opacus is
  correct, see ``widedp.models.cbow_opacus``), flat clipping at ``dp.clip1``, Gaussian noise ``dp.noise_multiplier
  * clip1`` on every coordinate, division by the expected batch size b, Poisson sampling through its
  ``DPDataLoader``, and the reported epsilon (its PRV accountant when ``dp.accountant: pld``, its RDP accountant
  otherwise; ``epsilon_rdp`` is always its RDP accountant).
- Ours: the sampling rate is set to exactly q = b/n and the divisor to exactly b (Opacus derives both from
  ``len(data_loader)``, which rounds), the same init as ``CBOW`` for the same seed, the same evaluation
  (``widedp.run.train.evaluate`` on a ``CBOW`` holding the same weights), the spent-budget journal, calibration and the
  budget stop through ``widedp.run.budget`` (the same Gaussian spend as widedp's ``selection: all``, so both engines get
  the same sigma), and ``epsilon_widedp`` (our accountant on the same steps) as a cross-check.

Randomness: the sampling and noise generators are seeded as in ``widedp.run.train`` (secret by default,
``widedp.dp.rng``); their seeds and states live only in ``RUN/private/``. Resume: Opacus' batch sampler cannot
replay the lost steps exactly, so every step the journal reserved stays spent, in our ledger and in Opacus'
accountant history alike.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from widedp import accounting
from widedp.accounting import statement
from widedp.config import Config
from widedp.data_prep.cbow import CBOWData
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.models.cbow import CBOW
from widedp.models.cbow_opacus import OpacusCBOW
from widedp.run import budget
from widedp.run import summary as run_summary
from widedp.run.checkpoint import load_checkpoint, save_checkpoint, write_json
from widedp.run.plots import plot_losses
from widedp.run.train import SplitTensors, evaluate, resolve_device

OPACUS_OPTIMIZERS = ("sgd", "adam")


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


def _as_is(batch: Any) -> Any:
    return batch


def check_opacus_config(cfg: Config) -> None:
    """ConfigError unless ``cfg`` is a DP-SGD config Opacus runs as widedp would."""
    dp = cfg.dp
    if dp is None or dp.engine != "opacus":
        raise ConfigError("dp.engine: train_opacus needs a dp: section with engine: opacus")
    if dp.selection.name != "all":
        raise ConfigError(f"dp.selection.name: opacus runs DP-SGD only (all), not {dp.selection.name!r}")
    if dp.clip2 is not None:
        raise ConfigError("dp.clip2: must be null with dp.engine: opacus (Opacus' DP-SGD has no second clip)")
    if cfg.train.optimizer not in OPACUS_OPTIMIZERS:
        raise ConfigError(f"train.optimizer: {cfg.train.optimizer!r} is not available with dp.engine: opacus "
                          f"(expected one of {', '.join(OPACUS_OPTIMIZERS)})")


def opacus_epsilons(history: list[tuple[float, float, int]], delta: float) -> dict[str, float | None]:
    """Opacus' RDP and PRV epsilons of an accountant history [(sigma, q, steps)]; PRV None where it fails."""
    if not history:
        return {"rdp": 0.0, "prv": 0.0}
    rdp = RDPAccountant()
    rdp.history = list(history)
    prv_acc = PRVAccountant()
    prv_acc.history = list(history)
    try:
        prv: float | None = float(prv_acc.get_epsilon(delta))
    except Exception:  # PRV's domain heuristics fail at extreme settings; RDP stays available
        prv = None
    return {"rdp": float(rdp.get_epsilon(delta)), "prv": prv}


def train_opacus(cfg: Config, out: Path, *, data: CBOWData, resume: bool = False, progress: bool = True
                 ) -> dict[str, Any]:
    """Train ``cfg`` (``dp.engine: opacus``) into ``out``; returns the summary dict (also in summary.json)."""
    with warnings.catch_warnings():
        # Opacus' advice to use its secure RNG (our generators are seeded from the OS CSPRNG, dp.rng), and torch's
        # note that the backward hooks fire on an integer-input Embedding: both expected, both noise in every
        # run's output.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _train_opacus(cfg, out, data=data, resume=resume, progress=progress)


def _train_opacus(cfg: Config, out: Path, *, data: CBOWData, resume: bool, progress: bool) -> dict[str, Any]:
    t_setup = time.perf_counter()
    check_opacus_config(cfg)
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = resolve_device(tc.device)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = load_checkpoint(out, map_location=device) if resume else None
    if ckpt is not None and ckpt["config_hash"] != cfg.hash():
        raise ConfigError(f"{out}: checkpoint was written by a different config (hash {ckpt['config_hash']})")
    splits = {k: SplitTensors.of(getattr(data, k), device) for k in ("train", "valid", "test")}
    n, b = len(splits["train"]), tc.batch_size
    (out / "vocab.json").write_text(json.dumps(data.vocab))
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    eval_model = CBOW(len(data.vocab), cfg.model.dim, tied=cfg.model.tied, sparse=False,
                      init_scale=cfg.model.init_scale, generator=torch.Generator().manual_seed(tc.seed)).to(device)
    model = OpacusCBOW.from_cbow(eval_model)
    dp = budget.calibrated(cfg, num_rows=eval_model.num_rows, n=n)
    spend = budget.step_spend(dp, num_rows=eval_model.num_rows, batch_size=b, n=n)
    budget_cap = budget.budget_steps(dp, spend)
    q = b / n
    if tc.optimizer == "sgd":
        base_opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=tc.lr)
    else:
        base_opt = torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps)
    seeds, _ = rng.run_seeds(out, mode=dp.rng, seed=tc.seed, resume=ckpt is not None)
    noise_gen = torch.Generator(device=device)
    noise_gen.manual_seed(seeds.noise)
    sample_gen = torch.Generator()
    sample_gen.manual_seed(seeds.sampling)

    ledger = accounting.Ledger()
    step, history, elapsed = 0, [], 0.0
    opacus_history: list[tuple[float, float, int]] = []
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        base_opt.load_state_dict(ckpt["optimizer"])
        step, history, elapsed = ckpt["step"], ckpt["history"], ckpt["elapsed"]
        states = rng.load_states(out, step)
        if states is not None:
            noise_gen.set_state(states["noise"])
            sample_gen.set_state(states["sampling"])
        ledger = accounting.Ledger.from_json(ckpt["ledger"])
        opacus_history = [(float(s), float(r), int(k)) for s, r, k in ckpt["opacus_history"]]
        journal = budget.read_journal(out)
        resumed = budget.resumed_ledger(ledger, journal, replayable=False)
        if resumed.steps > ledger.steps:
            opacus_history.append((dp.noise_multiplier, q, resumed.steps - ledger.steps))
        ledger = resumed

    dataset = SplitDataset(splits["train"])
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, _ = engine.make_private(
        module=model, optimizer=base_opt, data_loader=DataLoader(dataset, batch_size=b, collate_fn=_as_is),
        noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.clip1, poisson_sampling=True,
        noise_generator=noise_gen, grad_sample_mode="hooks", loss_reduction="mean",
    )
    # Opacus derives q = 1/len(loader) and the divisor int(n q) from a rounded length: set both exactly.
    loader = DPDataLoader(dataset, sample_rate=q, collate_fn=_as_is, generator=sample_gen)
    dp_opt.expected_batch_size = b
    dp_opt.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=q))
    engine.accountant.history = list(opacus_history)

    per_epoch = budget.steps_per_epoch(b, n)
    total = budget.total_steps(cfg, n)
    metrics = (out / "metrics.jsonl").open("a")

    def log(rec: dict[str, Any]) -> None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    def record(epoch: int) -> dict[str, Any]:
        eval_model.load_state_dict(model.state_dict())
        eval_model.eval()
        kw = {"batch_size": tc.eval_batch_size, "max_samples": tc.eval_max_samples}
        rec: dict[str, Any] = {"epoch": epoch + 1, "step": step}
        for k in ("train", "valid", "test"):
            rec[f"{k}_loss"] = evaluate(eval_model, splits[k], **kw)
        if engine.accountant.history:  # the headline accountant (as in the summary) and the RDP cross-check
            e = opacus_epsilons(engine.accountant.history, dp.delta)
            use_prv = dp.accountant == "pld" and e["prv"] is not None
            rec.update(epsilon=e["prv"] if use_prv else e["rdp"], epsilon_accountant="prv" if use_prv else "rdp",
                       epsilon_rdp=e["rdp"])
        return rec

    def checkpoint() -> None:
        state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                 "optimizer": base_opt.state_dict(), "step": step, "history": history,
                 "elapsed": elapsed + time.perf_counter() - t0, "config_hash": cfg.hash(),
                 "ledger": ledger.to_json(),
                 "opacus_history": [[float(s), float(r), int(k)] for s, r, k in engine.accountant.history]}
        budget.write_journal(out, ledger)
        rng.save_states(out, step, {"noise": noise_gen.get_state(), "sampling": sample_gen.get_state()})
        save_checkpoint(out, state)
        rng.prune_states(out, step)

    if ckpt is None:
        history.append(record(-1))
        log({"kind": "notice", "text": run_summary.DIAGNOSTICS_NOTICE})
        log({"kind": "start", "n_train": n, "steps_per_epoch": per_epoch, "total_steps": total,
             "dp": {"noise_multiplier": dp.noise_multiplier, "selection": "all", "engine": "opacus",
                    "budget_steps": budget_cap}})
    setup_s = time.perf_counter() - t_setup
    batches = _endless(loader)
    stopped_by_budget = False
    bar = tqdm(total=total, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
    loss_acc = torch.zeros((), device=device)
    acc_steps, acc_samples, nonfinite_acc, t0 = 0, 0, 0, time.perf_counter()
    t_window = t0
    while step < total:
        epoch = step // per_epoch
        if budget_cap is not None and ledger.steps >= budget_cap:
            stopped_by_budget = True
            break
        if acc_steps == 0:  # reserve the interval in the journal before any of it can leave the process
            reserve = min(tc.log_every, total - step, (budget_cap - ledger.steps) if budget_cap else tc.log_every)
            pending = accounting.Ledger.from_json(ledger.to_json())
            pending.add(spend, count=reserve)
            budget.write_journal(out, pending)
        target, context, negatives = (x.to(device, non_blocking=True) for x in next(batches))
        m = target.shape[0]
        dp_opt.zero_grad(set_to_none=True)
        loss = gsm(target, context, negatives)
        (loss.sum() / max(m, 1)).backward()  # loss_reduction="mean": Opacus rescales by the actual batch size
        nonfinite_acc += zero_nonfinite_samples(model)
        dp_opt.step()
        ledger.add(spend)
        loss_acc += torch.where(torch.isfinite(loss), loss, 0.0).detach().sum()
        acc_samples += m
        step += 1
        acc_steps += 1
        bar.update(1)
        end_of_epoch = step % per_epoch == 0 or step == total
        if acc_steps == tc.log_every or end_of_epoch:
            now = time.perf_counter()
            rec = {"kind": "interval", "step": step, "epoch": epoch, "samples": acc_samples,
                   "train_loss": float(loss_acc) / max(acc_samples, 1), "samples_per_s": acc_samples / (now - t_window),
                   "nonfinite_samples": nonfinite_acc}
            if nonfinite_acc:
                run_summary.warn_nonfinite(nonfinite_acc, step)
            log(rec)
            bar.set_postfix(loss=f"{rec['train_loss']:.4f}")
            loss_acc.zero_()
            acc_steps, acc_samples, nonfinite_acc, t_window = 0, 0, 0, time.perf_counter()
        if end_of_epoch:
            history.append(record(epoch))
            log({"kind": "epoch", **history[-1]})
        if end_of_epoch or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
            checkpoint()
    bar.close()
    wall = elapsed + time.perf_counter() - t0
    if not history or history[-1]["step"] != step:
        history.append(record(step // per_epoch))
        log({"kind": "epoch", **history[-1]})
    checkpoint()
    metrics.close()

    eps = opacus_epsilons(engine.accountant.history, dp.delta)
    headline = eps["prv"] if dp.accountant == "pld" and eps["prv"] is not None else eps["rdp"]
    last = history[-1]
    summary: dict[str, Any] = {
        "train_loss": last.get("train_loss"), "valid_loss": last.get("valid_loss"), "test_loss": last.get("test_loss"),
        "steps": step, "epochs": step / per_epoch, "samples_per_s": step * b / wall if wall > 0 else None,
        "wall_s": wall, "setup_s": setup_s, "n_train": n, "config_hash": cfg.hash(), "private": seeds.private,
        "initial_valid_loss": history[0]["valid_loss"],
        "dp": {
            "engine": "opacus", "delta": dp.delta, "noise_multiplier": dp.noise_multiplier, "selection": "all",
            "selection_epsilon": None, "accountant": dp.accountant,
            "epsilon": headline, "epsilon_rdp": eps["rdp"], "epsilon_prv": eps["prv"],
            "epsilon_widedp": accounting.epsilon(ledger, delta=dp.delta, accountant=dp.accountant) if ledger.steps
            else 0.0,
            "stopped_by_budget": stopped_by_budget, "budget_steps": budget_cap, "target_epsilon": dp.target_epsilon,
            "opacus_history": [list(h) for h in engine.accountant.history], "ledger": ledger.to_json(),
            "rng": dp.rng,
        },
    }
    acct = "Opacus PRV" if dp.accountant == "pld" and eps["prv"] is not None else "Opacus RDP"
    st = statement.for_run(cfg, epsilon=headline, delta=dp.delta, accountant=acct, private_rng=seeds.private)
    summary["privacy"], summary["notice"] = st.to_json(), run_summary.DIAGNOSTICS_NOTICE
    write_json(out / "summary.json", summary)
    plot_losses(history, out / "loss.png", title=f"DP-SGD (Opacus), σ={dp.noise_multiplier:.3g}\nε={headline:.3g}, "
                f"δ={dp.delta:g} per {statement.unit_and_gaps(cfg)[0]}")
    if stopped_by_budget:
        print(f"widedp: stopped at step {step}: the next step would exceed dp.target_epsilon="
              f"{dp.target_epsilon} (checkpoint saved in {out})")
    return summary


def zero_nonfinite_samples(model: torch.nn.Module) -> int:
    """Zero every per-sample gradient (``p.grad_sample``, all parameters) of a sample with a NaN/inf anywhere, before
    Opacus clips: as in widedp's step, such a sample contributes zero, and no non-finite value reaches the noise.
    Returns how many samples were zeroed."""
    grads = [p.grad_sample for p in model.parameters() if getattr(p, "grad_sample", None) is not None]
    if not grads:
        return 0
    bad = torch.zeros(grads[0].shape[0], dtype=torch.bool, device=grads[0].device)
    for g in grads:
        bad |= ~torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1)
    if bad.any():
        for g in grads:
            g[bad] = 0
    return int(bad.sum())


def _endless(loader: DataLoader) -> Any:
    while True:
        yield from loader
