"""``widedp compare SWEEP.yaml --out DIR``: run configs x seeds, then one figure and one table for all of them.

A sweep file::

    runs:
      - name: dp-sgd-0.5                      # panel title and folder name: DIR/<name>/seed<k>
        config: brown_cbow_dpsgd.yaml          # relative to the sweep file's folder (or to the working directory)
        set: {dp.noise_multiplier: 0.5}        # optional dotted-key overrides (a value replaces that key's subtree)
        seeds: [0, 1, 2]                       # optional, default [0]; sets train.seed
    set: {train.epochs: 5}                     # optional, applied to every run (before the run's own set)
    panels: [dp-sgd-0.5, ...]                  # optional panel order (default: the order of runs)

Runs whose ``summary.json`` exists are skipped; a run with a checkpoint but no summary is resumed. Written:
``DIR/curves.png`` (a panel per run: train and test loss per epoch, mean over seeds with a min/max band, like the
paper's Fig. 1), ``DIR/results.md`` and ``DIR/results.json`` (final losses mean ± std over seeds, the honest
accountant's epsilon (summary ``dp.epsilon``), its RDP epsilon, wall time, samples/s, and — to compare with the
paper's reported eps — the paper's Theorem 3 figure for the same steps, ``paper_theorem3_reference_NOT_A_BOUND``:
NOT a valid DP bound, never a run's privacy).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from widedp.checkpoint import load_checkpoint, read_json, write_json
from widedp.config import Config, config_from_dict
from widedp.configtools import apply_override
from widedp.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
_RUN_KEYS = {"name", "config", "set", "seeds"}
_TOP_KEYS = {"runs", "set", "panels"}
PAPER_KEY = "paper_theorem3_reference_NOT_A_BOUND"  # = widedp.accounting.REFERENCE_KEY (not imported: heavy)


@dataclass(frozen=True)
class SweepRun:
    """One named config. ``sets``: (dotted key, value) pairs (the sweep's, then the run's); ``cli``: ``key=value``
    strings from the command line, applied last."""

    name: str
    config_path: Path
    sets: tuple[tuple[str, Any], ...]
    cli: tuple[str, ...]
    seeds: tuple[int, ...]

    def config(self, seed: int) -> Config:
        raw = _read_yaml(self.config_path)
        for key, value in self.sets:
            _set(raw, key, copy.deepcopy(value))
        for ov in self.cli:
            apply_override(raw, ov)
        _set(raw, "train.seed", seed)
        return config_from_dict(raw)


@dataclass(frozen=True)
class Sweep:
    path: Path
    runs: tuple[SweepRun, ...]
    panels: tuple[str, ...]


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read and validate a sweep file (every run's config is loaded once per seed, so bad keys fail here)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError:
        raise ConfigError(f"{path}: invalid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'runs' list at top level")
    for k in raw:
        if k not in _TOP_KEYS:
            raise ConfigError(f"{path}: {k}: unknown key (expected one of {', '.join(sorted(_TOP_KEYS))})")
    common = _overrides(path, "set", raw.get("set"))
    runs_raw = raw.get("runs")
    if not isinstance(runs_raw, list) or not runs_raw:
        raise ConfigError(f"{path}: runs: expected a non-empty list of runs")
    runs: list[SweepRun] = []
    for i, r in enumerate(runs_raw):
        where = f"{path}: runs[{i}]"
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: expected a mapping with name and config")
        for k in r:
            if k not in _RUN_KEYS:
                raise ConfigError(f"{where}.{k}: unknown key (expected one of {', '.join(sorted(_RUN_KEYS))})")
        name = r.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}.name: expected a folder-safe name (letters, digits, _ . + = -), got {name!r}")
        if any(x.name == name for x in runs):
            raise ConfigError(f"{where}.name: {name!r} appears twice")
        cfg = r.get("config")
        if not isinstance(cfg, str):
            raise ConfigError(f"{where}.config: expected a path to a YAML config, got {cfg!r}")
        seeds = r.get("seeds", [0])
        if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
            raise ConfigError(f"{where}.seeds: expected a list of distinct integers >= 0, got {seeds!r}")
        run = SweepRun(name, _resolve(p, cfg, f"{where}.config"),
                       (*common, *_overrides(path, f"runs[{i}].set", r.get("set"))), tuple(overrides), tuple(seeds))
        for s in run.seeds:
            try:
                run.config(s)
            except ConfigError as e:
                raise ConfigError(f"{where} ({name}): {e}") from None
        runs.append(run)
    names = [r.name for r in runs]
    panels = raw.get("panels", names)
    if not isinstance(panels, list) or not all(isinstance(x, str) for x in panels):
        raise ConfigError(f"{path}: panels: expected a list of run names")
    unknown = [x for x in panels if x not in names]
    if unknown:
        raise ConfigError(f"{path}: panels: {unknown[0]!r} is not a run name")
    return Sweep(p, tuple(runs), tuple(panels))


def _overrides(path: str | Path, key: str, raw: Any) -> list[tuple[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k for k in raw):
        raise ConfigError(f"{path}: {key}: expected a mapping of dotted keys to values, got {raw!r}")
    return list(raw.items())


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path}: invalid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return raw


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    """``raw[a][b][c] = value`` for ``key = "a.b.c"`` (creating sections; the value replaces the subtree)."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"set {key}: {part} is not a section")
    node[parts[-1]] = value


def _resolve(sweep_path: Path, cfg: str, where: str) -> Path:
    for cand in (sweep_path.parent / cfg, Path(cfg)):
        if cand.is_file():
            return cand
    raise ConfigError(f"{where}: config file not found: {cfg} (looked beside the sweep file and in the working "
                      "directory)")


def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / name / f"seed{seed}"


def run_sweep(sweep: Sweep, out: Path, *, progress: bool = False) -> None:
    """Train every run x seed that has no summary.json yet (resuming those with a checkpoint)."""
    from widedp.data_prep.cbow import prepare_cbow
    from widedp.train import train

    data_cache: dict[Any, Any] = {}
    for run in sweep.runs:
        for seed in run.seeds:
            d = run_dir(out, run.name, seed)
            if (d / "summary.json").is_file():
                continue
            cfg = run.config(seed)
            data = None
            if cfg.task == "cbow":  # other tasks prepare their own data inside train()
                if cfg.data not in data_cache:
                    data_cache = {cfg.data: prepare_cbow(cfg.data)}  # keep one prepared corpus in memory at a time
                data = data_cache[cfg.data]
            print(f"widedp compare: {run.name} seed {seed} -> {d}", flush=True)
            train(cfg, d, resume=(d / "checkpoint.pt").is_file(), progress=progress, data=data)


def history_of(d: Path) -> list[dict[str, Any]]:
    """Per-epoch records of a finished run (epoch 0 = before training), from its checkpoint."""
    return list(load_checkpoint(d)["history"])


def _stats(xs: list[float | None]) -> dict[str, float | None]:
    v = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None}
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": m, "std": sd, "min": min(v), "max": max(v)}


def summarize(sweep: Sweep, out: Path) -> list[dict[str, Any]]:
    """One row per run name (in panel order, then the rest): mean/std over seeds of the final figures."""
    rows = []
    order = list(sweep.panels) + [r.name for r in sweep.runs if r.name not in sweep.panels]
    by_name = {r.name: r for r in sweep.runs}
    for name in order:
        run = by_name[name]
        sums = [read_json(run_dir(out, name, s) / "summary.json") for s in run.seeds]
        dps = [s.get("dp") or {} for s in sums]
        row: dict[str, Any] = {
            "name": name, "seeds": list(run.seeds), "private": any(s.get("private") for s in sums),
            "engine": dps[0].get("engine", "widedp") if dps[0] else None,
            "selection": dps[0].get("selection"), "accountant": dps[0].get("accountant"),
            "noise_multiplier": _stats([d.get("noise_multiplier") for d in dps]),
            "steps": _stats([s.get("steps") for s in sums]),
        }
        for k in ("train_loss", "valid_loss", "test_loss", "initial_valid_loss", "wall_s", "samples_per_s",
                  "test_accuracy"):
            row[k] = _stats([s.get(k) for s in sums])
        row["epsilon"] = _stats([d.get("epsilon") for d in dps]) if row["private"] else None
        row["epsilon_rdp"] = _stats([d.get("epsilon_rdp") for d in dps]) if row["private"] else None
        row[PAPER_KEY] = _stats([_paper_reference(d) for d in dps]) if row["private"] else None
        row["run_dirs"] = [str(run_dir(out, name, s)) for s in run.seeds]
        rows.append(row)
    return rows


def _paper_reference(dp: dict[str, Any]) -> float | None:
    """The paper's Theorem 3 eps for a run's ledger (a labelled reference, NOT a bound); None where undefined."""
    from widedp import accounting

    if not dp.get("ledger") or not dp.get("delta"):
        return None
    try:
        ledger = accounting.Ledger.from_json(dp["ledger"])
        return accounting.paper_theorem3_reference(ledger.runs, dp["delta"])["epsilon"] if ledger.steps else None
    except ConfigError:  # e.g. several sampling rates: Theorem 3 is stated for identical steps
        return None


def _fmt(st: dict[str, float | None] | None, digits: int = 4, pm: bool = True) -> str:
    if st is None or st["mean"] is None:
        return "–"
    m = f"{st['mean']:.{digits}f}"
    return f"{m} ± {st['std']:.{digits}f}" if pm and st["std"] else m


def results_markdown(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", "", "Final losses: mean ± std over seeds. ε: the run's accountant (summary dp.epsilon); "
             "ε RDP: the RDP accountant. σ: the (calibrated) noise multiplier. Paper Thm 3: the paper's Theorem 3 "
             "for the same steps, shown only to compare with the paper's reported ε: it is NOT a valid DP bound "
             "(it can under-report).", "",
             "| run | seeds | train loss | valid loss | test loss | test acc. | ε | ε RDP | paper Thm 3 (NOT a bound) "
             "| σ | steps | wall s | samples/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f" ({r['accountant']})" if r["private"] and r["accountant"] else ""
        lines.append(
            f"| {r['name']} | {len(r['seeds'])} | {_fmt(r['train_loss'])} | {_fmt(r['valid_loss'])} | "
            f"{_fmt(r['test_loss'])} | {_fmt(r['test_accuracy'], 3)} | "
            f"{_fmt(r['epsilon'], 3)}{acc if r['epsilon'] else ''} | "
            f"{_fmt(r['epsilon_rdp'], 3)} | {_fmt(r.get(PAPER_KEY), 3)} | "
            f"{_fmt(r['noise_multiplier'], 4, pm=False) if r['private'] else '–'} | "
            f"{_fmt(r['steps'], 0, pm=False)} | {_fmt(r['wall_s'], 1, pm=False)} | "
            f"{_fmt(r['samples_per_s'], 0, pm=False)} |")
    return "\n".join(lines) + "\n"


def plot_curves(sweep: Sweep, out: Path, path: Path) -> None:
    """A panel per run: train and test loss per epoch, mean over seeds and a min/max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sweep.panels)
    by_name = {r.name: r for r in sweep.runs}
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), dpi=100, sharey=True, squeeze=False)
    for ax, name in zip(axes.flat, names):
        hists = [history_of(run_dir(out, name, s)) for s in by_name[name].seeds]
        for key, color in (("train_loss", "tab:blue"), ("test_loss", "tab:orange")):
            per_epoch: dict[int, list[float]] = {}
            for h in hists:
                for rec in h:
                    if rec.get(key) is not None:
                        per_epoch.setdefault(int(rec["epoch"]), []).append(float(rec[key]))
            ep = sorted(per_epoch)
            mean = [sum(per_epoch[e]) / len(per_epoch[e]) for e in ep]
            ax.plot(ep, mean, "-o", ms=2.5, color=color, label=key.replace("_", " "))
            if len(hists) > 1:
                ax.fill_between(ep, [min(per_epoch[e]) for e in ep], [max(per_epoch[e]) for e in ep],
                                color=color, alpha=0.2, lw=0)
        ax.set_title(f"{name} ({len(hists)} seed{'s' if len(hists) > 1 else ''})", fontsize=10)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(path: str | Path, out: Path, *, overrides: list[str] | tuple[str, ...] = (), progress: bool = False
            ) -> list[dict[str, Any]]:
    """Run the sweep (skipping finished runs) and write curves.png, results.md, results.json into ``out``."""
    sweep = load_sweep(path, overrides)
    out.mkdir(parents=True, exist_ok=True)
    run_sweep(sweep, out, progress=progress)
    rows = summarize(sweep, out)
    plot_curves(sweep, out, out / "curves.png")
    write_json(out / "results.json", {"sweep": str(sweep.path), "rows": rows})
    (out / "results.md").write_text(results_markdown(rows, f"Results of {sweep.path.name}"))
    return rows
