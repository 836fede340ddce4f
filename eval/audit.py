"""``widedp audit``: an empirical lower bound on ε from one training run of widedp's own code (Steinke, Nasr &
Jagielski 2023), printed beside the accountant's upper bound.

    widedp audit configs/audit_dpsgd.yaml --canaries 1000 --out runs/audit          # white-box + black-box scores
    widedp audit configs/audit_dpsgd.yaml --canaries 1000 --out runs/audit --per-step  # + every step's update

1. m canaries (``widedp.eval.audit_canaries``: units of the run's privacy unit with rows of their own, appended
   after the vocabulary) are made; each is included by a fair secret coin: the OS CSPRNG (``secrets``), written
   only to ``OUT/private/audit_coins.json`` (0600, like the run's seeds: ``widedp.dp.rng``), read back only by the
   scorer in this process. ``--coin-seed`` (tests) derives them from a public seed instead: the report then says
   they are NOT secret (the bound is still valid: the coins are independent of everything the run does).
2. The run trains through widedp's own loop and engine (``widedp.run.loop``) into OUT (a normal run directory).
3. Each canary is scored (``widedp.eval.audit_scores``): white-box on the released weights, black-box by its loss,
   and with ``--per-step`` by every step's released noisy update (hooked at the engine's row optimizer, inside this
   process).
4. Guesses on a fixed grid, a union bound over it, and the one-run bound at confidence 1 − β with the run's δ
   (``widedp.eval.audit_bound``); ``OUT/audit.json`` records the counts (m, included, guesses, correct), not the
   coins, beside the run's ε and its statement; ``OUT/audit.png`` the score histograms.

The headline ``epsilon_lower`` is the score fixed in advance (``per_step`` with ``--per-step``, else
``white_box``); every score's own bound is also a valid 1 − β bound on its own (each is its own test).
"""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from widedp.config import Config
from widedp.dp import rng
from widedp.dp.noise import sensitivity
from widedp.errors import ConfigError
from widedp.eval import audit_bound as ab
from widedp.eval.audit_canaries import init_canary_rows, make_canaries, with_canaries
from widedp.eval.audit_scores import SelectionRatio, StepObserver, canary_grads, rows_of, white_box
from widedp.extras import pyplot
from widedp.run.checkpoint import write_json
from widedp.tasks.cbow import CBOWTask, build_cbow, cbow_data
from widedp.tasks.protocol import Built

AUDIT_FILE = "audit.json"
PLOT_FILE = "audit.png"
COINS_FILE = "audit_coins.json"
SCORES_FILE = "audit_scores.json"  # (beside the coins: with them, they say which canary was guessed right)
_FORMAT = 1


def draw_coins(m: int, *, seed: int | None = None) -> np.ndarray:
    """[m] bool fair coins: from the OS CSPRNG (``seed`` None), else from a torch.Generator seeded by ``seed``."""
    if seed is None:
        bits = secrets.randbits(m)
        return np.array([(bits >> i) & 1 for i in range(m)], dtype=bool)
    return (torch.rand(m, generator=torch.Generator().manual_seed(seed)) < 0.5).numpy()


class AuditTask(CBOWTask):
    """The CBOW task with audit canaries: ``build`` appends the 2m canary words, the included canaries' units and
    the canary rows' init; ``row_optimizer`` wraps the DP row optimizer in a ``StepObserver`` (``per_step``)."""

    def __init__(self, *, m: int, coins: np.ndarray, scale: float | None, seed: int, per_step: bool) -> None:
        self.m, self.coins, self.scale, self.seed, self.per_step = m, coins, scale, seed, per_step
        self.state: dict[str, Any] = {}
        self.observer: StepObserver | None = None

    def build(self, cfg: Config, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        base, release = cbow_data(cfg, out, data=None, noise_seed=noise_seed, resumed=resumed)
        gen = torch.Generator().manual_seed(self.seed)  # public: the canaries and their init
        cs = make_canaries(base, m=self.m, unit=cfg.data.privacy_unit, context_width=base.train.context.shape[1],
                           negatives=cfg.data.negatives, generator=gen)
        splits, model = build_cbow(cfg, out, device=device, data=with_canaries(base, cs, self.coins))
        clip1 = cfg.dp.clip1 if cfg.dp is not None else None
        scale = self.scale if self.scale is not None else 4.0 * (clip1 or 1.0)
        init_canary_rows(model, cs, scale=scale, generator=gen)
        own = cs.own_rows(model).to(device)
        batch, owner = cs.batch(device), torch.as_tensor(cs.owner, device=device)
        mu0, _ = canary_grads(model, batch, owner, own, clip1=clip1, batch_size=cfg.train.batch_size)
        self.state = {"model": model, "canaries": cs, "own": own, "batch": batch, "owner": owner, "scale": scale,
                      "clip1": clip1, "init_rows": rows_of(model, own), "direction": -mu0,
                      "own_touched": (mu0.abs().amax(2) > 0).sum(1)}
        return Built(splits, model, {"vocabulary": release.mechanism} if release is not None else {})

    def row_optimizer(self, cfg: Config, model: Any) -> Any:
        inner = super().row_optimizer(cfg, model)
        if not self.per_step:
            return inner
        st = self.state
        probe = {"batch": st["batch"], "owner": st["owner"], "own": st["own"], "clip1": st["clip1"],
                 "b": cfg.train.batch_size, "rows_per_unit": _rows_per_unit(cfg, st)}
        self.observer = StepObserver(inner, model, probe, selection_ratio(cfg, num_rows=model.num_rows))
        return self.observer


def _rows_per_unit(cfg: Config, st: dict[str, Any]) -> torch.Tensor:
    """[m] rows a canary unit's contribution count is spread over: its own rows with a public negatives pool, else
    every row its gradient touches."""
    if cfg.data.negatives_pool:
        return st["own_touched"]
    with torch.inference_mode():
        _, g = st["model"].per_sample_row_grads(st["batch"])
        from widedp.dp.units import group_rows

        return group_rows(g, st["owner"], num_units=len(st["own"])).lengths()


def selection_ratio(cfg: Config, *, num_rows: int) -> SelectionRatio:
    """The per-step adversary's model of ``cfg``'s row selection (``widedp.eval.audit_scores``)."""
    from widedp.dp.selection import make_selector

    if cfg.dp is None:
        return SelectionRatio()
    sel = make_selector(cfg.dp.selection, num_rows=num_rows)
    name = cfg.dp.selection.name
    if name == "exponential":
        s0 = sel.score_clip if sel.score_clip is not None else float("inf")
        return SelectionRatio("exponential", epsilon=sel.epsilon, score_clip=s0,
                              sensitivity=min(s0, cfg.dp.clip1 / cfg.train.batch_size))
    if name == "gaussian_threshold":
        return SelectionRatio("gaussian", sigma=sel.sigma, threshold=sel.threshold,
                              public_pool=bool(cfg.data.negatives_pool))
    return SelectionRatio()


def check_config(cfg: Config, *, m: int, confidence: float, scale: float | None = None) -> None:
    """One-line errors for what the audit cannot run."""
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"--canary-scale: must be a finite number > 0, got {scale}")
    if cfg.task != "cbow":
        raise ConfigError(f"task: the audit runs CBOW configs (its canaries are word pairs / sentences), got "
                          f"{cfg.task}")
    if cfg.dp is not None and cfg.dp.engine != "widedp":
        raise ConfigError(f"dp.engine: the audit runs widedp's own DP engine, got {cfg.dp.engine}")
    if m < 2:
        raise ConfigError(f"--canaries: need at least 2, got {m}")
    if not 0.5 <= confidence < 1:
        raise ConfigError(f"--confidence: must be in [0.5, 1), got {confidence}")


def run_audit(cfg: Config, out: Path, *, canaries: int, per_step: bool = False, confidence: float = 0.95,
              scale: float | None = None, seed: int = 0, coin_seed: int | None = None, overwrite: bool = False,
              progress: bool = False, plot: bool = True) -> dict[str, Any]:
    """Train ``cfg`` with ``canaries`` audit canaries into ``out``, score them, write ``out/audit.json`` (and
    ``audit.png``); returns the report. ``seed``: the public seed of the canaries, their init and tie-breaking;
    ``coin_seed``: reproducible coins (tests; NOT secret); ``scale``: the canary output rows' norm (default 4·S1:
    the canary's gradient, about scale/2, is clipped)."""
    from widedp.run import loop, rundir

    check_config(cfg, m=canaries, confidence=confidence, scale=scale)
    if per_step and cfg.dp is None:
        raise ConfigError("--per-step: a non-private run releases no noisy updates; drop --per-step")
    if cfg.dp is not None and cfg.dp.sampling_rate is None:
        print("widedp: warning: audit without dp.sampling_rate: q = b/N and N counts the included canaries, so q "
              "depends on the coins (the data size is outside ε: see docs/audit.md); set dp.sampling_rate",
              file=sys.stderr)
    t0 = time.perf_counter()
    coins = draw_coins(canaries, seed=coin_seed)
    task = AuditTask(m=canaries, coins=coins, scale=scale, seed=seed, per_step=per_step)
    with rundir.locked(out):
        rundir.prepare(out, resume=False, overwrite=overwrite)
        out.mkdir(parents=True, exist_ok=True)
        rng.save_private(out, COINS_FILE, json.dumps({"coins": coins.astype(int).tolist(),
                                                      "secret": coin_seed is None}).encode())
        summary = loop.run(cfg, task, out, resume=False, progress=progress)
    scores = audit_scores(cfg, task, summary)
    rng.save_private(out, SCORES_FILE, json.dumps({k: v.tolist() for k, v in scores.items()}).encode())
    report = make_report(cfg, summary, scores, _load_coins(out), confidence=confidence, seed=seed,
                         primary="per_step" if per_step else "white_box")
    report.update(run_dir=str(out), seconds=time.perf_counter() - t0, coins=_coins_note(coin_seed),
                  canary={"unit": cfg.data.privacy_unit, "scale": task.state["scale"], "own_rows": int(
                      task.state["own"].shape[1]), "seed": seed})
    write_json(out / AUDIT_FILE, report)
    if plot:
        plot_audit(scores, _load_coins(out), report, out / PLOT_FILE)
    return report


def _load_coins(out: Path) -> np.ndarray:
    """The coins, read back from ``out/private/`` by the scorer (this process) only."""
    d = json.loads((out / rng.PRIVATE_DIR / COINS_FILE).read_text())
    return np.asarray(d["coins"], dtype=bool)


def _coins_note(coin_seed: int | None) -> str:
    if coin_seed is None:
        return f"secret: drawn from the OS CSPRNG, kept only in RUN/{rng.PRIVATE_DIR}/{COINS_FILE}"
    return f"reproducible from --coin-seed {coin_seed}: NOT secret (tests); the bound is valid all the same"


def audit_scores(cfg: Config, task: AuditTask, summary: dict[str, Any]) -> dict[str, np.ndarray]:
    """{white_box, black_box[, per_step]}: [m] scores, higher = more likely included (``audit_scores``)."""
    st = task.state
    model = st["model"]
    out = {"white_box": white_box(model, st["own"], st["init_rows"], st["direction"])}
    _, loss = canary_grads(model, st["batch"], st["owner"], st["own"], clip1=None, batch_size=1.0)
    out["black_box"] = -loss.double().cpu().numpy()
    if task.observer is not None:
        dp = summary["dp"]
        std = dp["noise_multiplier"] * sensitivity(clip1=cfg.dp.clip1, clip2=cfg.dp.clip2,
                                                   batch_size=cfg.train.batch_size)
        out["per_step"] = task.observer.records.score(noise_std=std, sampling_rate=sampling_rate(cfg, summary))
    return out


def sampling_rate(cfg: Config, summary: dict[str, Any]) -> float:
    """q of the run: ``dp.sampling_rate``, else b / (training units)."""
    if cfg.dp is not None and cfg.dp.sampling_rate is not None:
        return float(cfg.dp.sampling_rate)
    n = (summary.get("units") or {}).get("n_units") or summary["n_train"]
    return cfg.train.batch_size / n


def make_report(cfg: Config, summary: dict[str, Any], scores: dict[str, np.ndarray], coins: np.ndarray, *,
                confidence: float, seed: int, primary: str) -> dict[str, Any]:
    """audit.json: per score its best guesses and bound, the headline, the run's ε and statement, the cap."""
    m, beta = len(coins), 1.0 - confidence
    dp = summary.get("dp") or {}
    delta = float(dp.get("delta") or 0.0)
    grid = ab.guess_grid(m)
    per: dict[str, Any] = {}
    for name, s in scores.items():
        best, allg = ab.audit(s, coins, beta=beta, delta=delta, grid=grid,
                              generator=torch.Generator().manual_seed(seed + 1))
        per[name] = {"epsilon_lower": best.epsilon_lower, "guesses": best.guesses, "correct": best.correct,
                     "k_plus": best.k_plus, "k_minus": best.k_minus,
                     "grid": [[g.k_plus, g.k_minus, g.correct, round(g.epsilon_lower, 6)] for g in allg]}
    head = per[primary]
    eps = dp.get("epsilon")
    cap = max(ab.bound_cap(m=m, r=kp + km, beta=beta / len(grid), delta=delta) for kp, km in grid)
    return {"format": _FORMAT, "m": m, "included": int(coins.sum()), "confidence": confidence, "beta": beta,
            "one_sided": True, "delta": delta, "primary": primary, "epsilon_lower": head["epsilon_lower"],
            "guesses": head["guesses"], "correct": head["correct"], "epsilon": eps,
            "ratio": (head["epsilon_lower"] / eps) if eps and math.isfinite(eps) else None, "epsilon_cap": cap,
            "private": bool(summary.get("private")), "privacy": (summary.get("privacy") or {}).get("text"),
            "scores": per, "grid": "(k+, k-) for r = round(f·m), f in " + str(list(ab.GUESS_FRACTIONS))
            + ": both sides (r/2, r/2) and top only (r, 0); each at beta/|grid| (union bound)",
            "method": "Steinke, Nasr & Jagielski 2023, one run; p(eps, delta) = P[Bin(r, e^eps/(1+e^eps)) >= v] "
                      "+ 2 m delta max_i P[v-i <= Bin < v]/i"}


def format_line(report: dict[str, Any]) -> str:
    """One line: the lower bound beside the accountant's ε."""
    eps = report.get("epsilon")
    upper = f"ε = {eps:.3f} (accountant, upper bound)" if eps is not None else "no ε (not private)"
    ratio = f", ratio {report['ratio']:.2f}" if report.get("ratio") is not None else ""
    return (f"widedp audit: epsilon_lower = {report['epsilon_lower']:.3f} ({report['primary']}, one-sided "
            f"{report['confidence']:.0%}, {report['correct']}/{report['guesses']} guesses correct of m = "
            f"{report['m']}; cap {report['epsilon_cap']:.2f}) vs {upper}{ratio}")


def plot_audit(scores: dict[str, np.ndarray], coins: np.ndarray, report: dict[str, Any], path: Path) -> None:
    """Histograms of each score, included vs excluded canaries, with each score's bound (the figure; skipped
    without matplotlib, the eval extra)."""
    plt = pyplot(f"the audit figure ({path.name})")
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(scores), figsize=(4.2 * len(scores), 3.2), squeeze=False)
    for ax, (name, s) in zip(axes[0], scores.items()):
        bins = np.histogram_bin_edges(s, bins=30)
        ax.hist(s[coins], bins=bins, alpha=0.6, label="included")
        ax.hist(s[~coins], bins=bins, alpha=0.6, label="excluded")
        ax.set_title(f"{name}: ε_lower = {report['scores'][name]['epsilon_lower']:.2f}", fontsize=9)
        ax.set_xlabel("score (higher = guessed included)", fontsize=8)
        ax.legend(fontsize=7)
    eps = report.get("epsilon")
    fig.suptitle(f"audit, m = {report['m']}: accountant ε = {eps:.2f}" if eps is not None else
                 f"audit, m = {report['m']}: not private", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
