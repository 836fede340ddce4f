"""Trainer of the ``glm`` task: prepare the Brown GLM data, run one convex algorithm, write the run directory.

Run directory (like ``widedp train``'s): config.yaml, metrics.jsonl (a "start" record, "interval" records every
~T/25 iterations with train/test loss and accuracy, an "end" record), summary.json (test_accuracy, train/valid/test
loss and accuracy, epsilon through widedp.accounting with its ledger, the algorithm's calibrated parameters),
checkpoint.pt (final W [d, K] and the history, loaded with weights_only=True), loss.png and accuracy.png.

Privacy: every algorithm calibrates its noise to ``algorithm.epsilon`` at ``algorithm.delta`` with
``algorithm.accountant`` and reports the accountant's epsilon of what it actually spent; DP-AGD, whose budgets are
chosen adaptively, reports the zCDP figure of its budget (a privacy filter; no PLD/RDP figure). summary.json's
``privacy`` is the statement (``widedp.accounting.statement``): unit = one training example = one document chunk (see
``unit_of``), adjacency add/remove, delta, the accountant, and what epsilon does not cover (``not_covered``:
the vocabulary, the label set and split, the training-set size). Features are normalised per example (log-tf,
unit norm), so no statistic of the training set enters them.

Randomness (``algorithm.rng``): ``secure`` (default) seeds the algorithm's generator (sampling, batch slots,
noise) from ``widedp.dp.rng.run_seeds``: OS-CSPRNG seeds kept only in RUN/private/ (0600), never in config.yaml,
checkpoint.pt, summary.json or metrics.jsonl; ``reproducible`` derives them from train.seed and the run says it
is NOT private. The data split (data.seed) and the initial W = 0 are public. metrics.jsonl and summary.json also
hold non-private diagnostics (train loss and accuracy, clipped shares, solver statistics): do not share them.

``resume``: a finished run (summary.json present) is returned as is; an unfinished one restarts from scratch with
the seeds saved in RUN/private/ (the same transcript, so nothing more is spent); without them it refuses.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from widedp import accounting
from widedp.accounting.statement import PrivacyStatement
from widedp.config import Config
from widedp.config.glm import GLMAlgorithmConfig
from widedp.convex import common
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.models import glm
from widedp.resources import set_threads
from widedp.run.checkpoint import read_json, save_checkpoint, write_json
from widedp.run.plots import plot_history, plot_losses
from widedp.run.summary import DIAGNOSTICS_NOTICE


def not_covered(cfg: Config) -> tuple[str, ...]:
    """What the GLM's epsilon does not cover: computed from the private data outside the ledger, or published."""
    d = cfg.data
    return (f"the vocabulary (the top-{d.vocab_size} words of the training chunks by count)",
            "the label set (the classes the corpus has)",
            "the training-set size n (published; treated as public: it sets noise scales, denominators, sampling "
            "rates)") + ((f"data.max_docs: {d.max_docs}: the corpus is cut to its first {d.max_docs} documents by "
                          "position",) if d.max_docs else ()) + (
        ("data.split_by: document on a text corpus: a document's split key is its whole text, so a chunk added to or "
         "removed from a document can move that document's other chunks between the splits",)
        if d.split_by == "document" and d.chunk_tokens and d.corpus != "brown" else ())


def unit_of(cfg: Config) -> str:
    """The privacy unit: one training example of the GLM, i.e. one row built by ``data_prep.brown_glm``."""
    d = cfg.data
    if d.chunk_tokens:
        lo = max(1, min(d.min_chunk_tokens, d.chunk_tokens))
        return (f"document chunk (one training example: {lo}-{d.chunk_tokens} consecutive filtered "
                "tokens of one document, with its label; a document yields several)")
    return "document (one training example: its filtered tokens and its label)"


def privacy_statement(cfg: Config, epsilon: float | None, *, private_rng: bool) -> PrivacyStatement:
    a: GLMAlgorithmConfig = cfg.algorithm
    if a.name == "nonprivate" or epsilon is None:
        return PrivacyStatement(None, None, unit_of(cfg), private=False, reason="trained without differential privacy")
    return PrivacyStatement(epsilon, a.delta, unit_of(cfg), accountant="zCDP" if a.name == "dp_agd" else
                            a.accountant.upper(), not_covered=not_covered(cfg), private=private_rng,
                            reason="" if private_rng else rng.NOT_PRIVATE)


def to_rows(split: Any, *, num_features: int, num_classes: int, dtype: torch.dtype) -> glm.LabeledCSR:
    return glm.LabeledCSR.from_csr(torch.from_numpy(split.indptr), torch.from_numpy(split.indices),
                                   torch.from_numpy(split.values), torch.from_numpy(split.labels),
                                   num_features=num_features, num_classes=num_classes, dtype=dtype)


def default_sparsity(cfg: Config, num_features: int, num_classes: int) -> int:
    """A data-independent bound on a per-sample gradient's nonzeros: (distinct words <= chunk_tokens, + bias) * K."""
    words = cfg.data.chunk_tokens if cfg.data.chunk_tokens else num_features
    return min(num_features, words + int(cfg.data.bias_feature > 0)) * num_classes


def run_algorithm(a: GLMAlgorithmConfig, train: glm.LabeledCSR, *, sparsity: int, generator: torch.Generator,
                  callback: common.Callback) -> common.ConvexResult:
    """Calibrate ``a``'s noise to its target epsilon and run it on ``train``."""
    from widedp.convex import dp_agd, frank_wolfe, numeric_sparse, output_perturbation, sparse_mean

    g = a.get
    n = len(train)
    every = max(1, (g("iterations") or 25) // 25)
    if a.name == "nonprivate":
        w, info = output_perturbation.solve_regularized(train, l2_reg=g("l2_reg"), iterations=g("solver_iterations"))
        callback(info["iterations"], w, {})
        return common.ConvexResult(w.to(train.x.values().dtype), accounting.Ledger(), info["iterations"], info)
    if a.name == "output_perturbation":
        return output_perturbation.output_perturbation(
            train, epsilon=a.epsilon, delta=a.delta, l2_reg=g("l2_reg"), mechanism=g("mechanism"),
            sparsity=g("sparsity") or sparsity, radius=g("radius"), generator=generator,
            solver_iterations=g("solver_iterations"), accountant=a.accountant)
    if a.name in ("dpsgd", "sparse_mean_gd"):
        bs = g("batch_size")
        q = 1.0 if bs <= 0 or bs >= n else bs / n
        sigma = sparse_mean.calibrate_sigma(iterations=g("iterations"), sampling_rate=q, target_epsilon=a.epsilon,
                                            delta=a.delta, accountant=a.accountant)
        est = "gaussian" if a.name == "dpsgd" else g("estimator")
        radius = (g("l1_radius") or g("clip") * math.sqrt(g("sparsity") or sparsity)) if est == "projection" else 0
        return sparse_mean.dp_gd(train, noise_multiplier=sigma, iterations=g("iterations"), lr=g("lr"),
                                 clip=g("clip"), batch_size=bs, estimator=est, generator=generator, l1_radius=radius,
                                 block_size=g("block_size") or 256, measurement_ratio=g("measurement_ratio") or 0.5,
                                 callback=callback, log_every=every)
    if a.name == "dp_agd":
        rho = common.zcdp_rho_for(a.epsilon, a.delta)
        return dp_agd.dp_agd(train, rho=rho, nominal_iterations=g("iterations"), clip=g("clip"),
                             loss_clip=g("loss_clip"), nmax_share=g("nmax_share"), gamma=g("gamma"),
                             step_candidates=g("step_candidates"), step_max=g("step_max"),
                             step_window=g("step_window"), generator=generator, callback=callback, log_every=every)
    if a.name == "frank_wolfe":
        t = g("iterations")
        eps0 = frank_wolfe.calibrate_epsilon0(iterations=t, target_epsilon=a.epsilon, delta=a.delta,
                                              noise=g("noise"), accountant=a.accountant)
        return frank_wolfe.private_frank_wolfe(
            train, epsilon0=eps0, iterations=t, radius=g("radius"), eta=g("step") or frank_wolfe.default_step(t),
            first_batch_fraction=g("first_batch_fraction"), noise=g("noise"), generator=generator,
            callback=callback, log_every=every)
    if a.name == "numeric_sparse":
        bs = g("batch_size")
        q = min(1.0, bs / n)
        e_seg = numeric_sparse.calibrate_segment_epsilon(
            iterations=g("iterations"), sampling_rate=q, cutoff=g("cutoff"), release_share=g("release_share"),
            target_epsilon=a.epsilon, delta=a.delta, accountant=a.accountant)
        return numeric_sparse.numeric_sparse_erm(
            train, segment_epsilon=e_seg, iterations=g("iterations"), lr=g("lr"), clip=g("clip"), batch_size=bs,
            cutoff=g("cutoff"), threshold_scale=g("threshold_scale"), release_share=g("release_share"),
            generator=generator, callback=callback, log_every=every)
    raise AssertionError(a.name)  # pragma: no cover


def _metrics(w: torch.Tensor, splits: dict[str, glm.LabeledCSR]) -> dict[str, float]:
    out = {}
    for name, s in splits.items():
        out[f"{name}_loss"] = glm.mean_loss(w, s)
        out[f"{name}_accuracy"] = glm.accuracy(w, s)
    return out


def train_glm(cfg: Config, out: Path, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train ``cfg`` (task glm) into run directory ``out``; returns the summary (also in summary.json)."""
    from widedp.data_prep.brown_glm import prepare_glm

    a: GLMAlgorithmConfig = cfg.algorithm
    if resume and (out / "summary.json").is_file():
        return read_json(out / "summary.json")
    gen, private_rng = _generator(cfg, out, resume=resume)
    t_setup = time.perf_counter()
    set_threads(cfg.train.threads)
    if cfg.train.device not in ("auto", "cpu"):
        raise ConfigError(f"train.device: task glm runs on the CPU, got {cfg.train.device!r}")
    data = prepare_glm(cfg.data)
    k = len(data.classes)
    splits = _splits(cfg, data)
    train = splits["train"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "vocab.json").write_text(json.dumps({"vocab": data.vocab, "classes": data.classes,
                                                "bias_feature": data.has_bias}))
    history: list[dict[str, Any]] = []
    metrics = (out / "metrics.jsonl").open("w")
    metrics.write(json.dumps({"kind": "notice", "text": DIAGNOSTICS_NOTICE}) + "\n")
    sparsity = default_sparsity(cfg, data.num_features, k)
    metrics.write(json.dumps({"kind": "start", "algorithm": a.name, "n_train": len(train),
                              "num_features": data.num_features, "num_classes": k,
                              "target_epsilon": a.epsilon, "delta": a.delta, "sparsity_bound": sparsity}) + "\n")
    eval_splits = {"train": train, "test": splits["test"]}
    t0 = time.perf_counter()

    def callback(it: int, w: torch.Tensor, extra: dict[str, Any]) -> None:
        rec = {"kind": "interval", "epoch": it, "iteration": it, **_metrics(w, eval_splits),
               "elapsed_s": time.perf_counter() - t0, **{k_: float(v) for k_, v in extra.items()}}
        history.append(rec)
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    setup_s = t0 - t_setup
    result = run_algorithm(a, train, sparsity=sparsity, generator=gen, callback=callback)
    wall = time.perf_counter() - t0
    final = _metrics(result.w, splits)
    if not history or history[-1]["iteration"] != result.iterations:
        history.append({"kind": "interval", "epoch": result.iterations, "iteration": result.iterations,
                        **{k_: v for k_, v in final.items() if not k_.startswith("valid")}})
    summary: dict[str, Any] = {
        "task": "glm", "algorithm": a.name, **final, "iterations": result.iterations, "steps": result.iterations,
        "n_train": len(train), "num_features": data.num_features, "num_classes": k, "wall_s": wall,
        "setup_s": setup_s, "samples_per_s": None, "config_hash": cfg.hash(),
        "private": a.name != "nonprivate" and private_rng, "info": _jsonable(result.info),
        "initial_valid_loss": math.log(k), "notice": DIAGNOSTICS_NOTICE,
    }
    eps = _add_dp(summary, a, result) if a.name != "nonprivate" else None
    st = privacy_statement(cfg, eps, private_rng=private_rng)
    summary["privacy"] = st.to_json()
    metrics.write(json.dumps({"kind": "end", **{k_: v for k_, v in summary.items() if k_ != "dp"},
                              "epsilon": summary.get("epsilon")}) + "\n")
    metrics.close()
    _write_results(cfg, out, result, history, summary, st=st, eps=eps, private_rng=private_rng)
    return summary


def _generator(cfg: Config, out: Path, *, resume: bool) -> tuple[torch.Generator, bool]:
    """The algorithm's generator and whether its seeds are private; a private algorithm's secret seeds
    (rng: secure) live in out/private/ only."""
    a: GLMAlgorithmConfig = cfg.algorithm
    if a.name == "nonprivate":
        return torch.Generator().manual_seed(cfg.train.seed), True  # no randomness is used
    seeds, replayable = rng.run_seeds(out, mode=a.rng, seed=cfg.train.seed, resume=resume)
    if resume and not replayable and (out / "metrics.jsonl").is_file():
        raise ConfigError(f"{out}: cannot resume: the earlier attempt's seeds ({out / rng.PRIVATE_DIR}) are "
                          "gone, and a fresh attempt would compose with what it already wrote; train into a new "
                          "directory")
    return rng.generator(seeds.noise), seeds.private


def _splits(cfg: Config, data: Any) -> dict[str, glm.LabeledCSR]:
    """The train, valid and test splits of the prepared data as GLM rows of ``model.dtype``."""
    dtype = torch.float64 if cfg.model.dtype == "float64" else torch.float32
    return {name: to_rows(getattr(data, name), num_features=data.num_features, num_classes=len(data.classes),
                          dtype=dtype) for name in ("train", "valid", "test")}


def _add_dp(summary: dict[str, Any], a: GLMAlgorithmConfig, result: common.ConvexResult) -> float:
    """Add the private algorithm's ``dp`` section and ``epsilon`` to ``summary``; returns that epsilon."""
    summary["dp"] = {"delta": a.delta, "target_epsilon": a.epsilon, "selection": a.name, "engine": "glm",
                     "rng": a.rng, "noise_multiplier": result.info.get("noise_multiplier"),
                     "ledger": result.ledger.to_json()}
    if a.name == "dp_agd":  # adaptive budgets: the zCDP filter's budget is the guarantee (widedp.convex.dp_agd)
        eps = common.zcdp_epsilon(result.info["rho"], a.delta)
        summary["dp"].update({"accountant": "zcdp", "epsilon_rdp": None, "rho": result.info["rho"],
                              "rho_spent": result.info["rho_spent"], "epsilon_zcdp": eps})
    else:
        eps = common.ledger_epsilon(result.ledger, delta=a.delta, accountant=a.accountant)
        summary["dp"].update({"accountant": a.accountant, "epsilon_rdp": common.ledger_epsilon(
            result.ledger, delta=a.delta, accountant="rdp")})
    summary["epsilon"] = summary["dp"]["epsilon"] = eps
    return eps


def _write_results(cfg: Config, out: Path, result: common.ConvexResult, history: list[dict[str, Any]],
                   summary: dict[str, Any], *, st: PrivacyStatement, eps: float | None, private_rng: bool) -> None:
    """checkpoint.pt, summary.json, loss.png and accuracy.png of a finished run."""
    a: GLMAlgorithmConfig = cfg.algorithm
    save_checkpoint(out, {"w": result.w, "history": history, "config_hash": cfg.hash(), "step": result.iterations})
    write_json(out / "summary.json", summary)
    title = a.name if eps is None else f"{a.name}, ε={eps:.3g}, δ={a.delta:g} [{st.accountant}]"
    if eps is not None and not private_rng:
        title = "NOT PRIVATE (reproducible rng) " + title
    plot_losses([{"epoch": h["epoch"], "train_loss": h.get("train_loss"), "test_loss": h.get("test_loss")}
                 for h in history], out / "loss.png", title=title)
    _plot_accuracy(history, out / "accuracy.png", title=title)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def _plot_accuracy(history: list[dict[str, Any]], path: Path, *, title: str) -> None:
    plot_history(history, path, keys=("train_accuracy", "test_accuracy"), x="iteration", ylabel="accuracy",
                 title=title)


class GLMTask:
    """``task: glm`` (``widedp.tasks.TASKS``): convex DP algorithms with their own loops, not the DP-sparse step."""

    name = "glm"
    summary_keys: tuple[str, ...] = ()

    def train(self, cfg: Config, out: Path, *, resume: bool, progress: bool) -> dict[str, Any]:
        return train_glm(cfg, out, resume=resume, progress=progress)

    def epsilon_report(self, cfg: Config) -> dict[str, Any]:
        raise ConfigError("epsilon: task glm algorithms calibrate their noise to algorithm.epsilon when they run; "
                          "`widedp train CONFIG` (seconds) reports the spent epsilon in summary.json")


TASK = GLMTask()
