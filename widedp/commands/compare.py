"""``widedp compare SWEEP.yaml --out DIR``: run configs x seeds, then one figure and one table for all of them.

A sweep file::

    runs:
      - name: dp-sgd-0.5                      # panel title and folder name: DIR/<name>/seed<k>
        config: brown_cbow_dpsgd.yaml          # relative to the sweep file's folder (or to the working directory)
        set: {dp.noise_multiplier: 0.5}        # optional dotted-key overrides (a value replaces that key's subtree)
        seeds: [0, 1, 2]                       # optional, default [0]; sets train.seed
    set: {train.epochs: 5}                     # optional, applied to every run (before the run's own set)
    panels: [dp-sgd-0.5, ...]                  # optional: a panel per run, in this order (default: the runs' order)
    panels: {"ε = 3": [run, run, ...], ...}    # or: named panels, each overlaying the test loss of several runs

A run directory is reused only when the config hash it recorded (``summary.json``, else ``checkpoint.pt``) is the
hash of the run's config now: finished -> reused, checkpointed -> resumed. A directory holding another config's run
is refused (one line: use a new ``--out``, or ``--overwrite`` to rerun it); a directory that holds run files but no
checkpoint (it crashed before its first one: nothing was released) is restarted. Every decision is printed on
stderr before anything trains. Written: ``DIR/curves.png`` (``widedp.commands.compare_plots``: train and test loss per
epoch, mean over seeds with a min/max band, like the paper's Fig. 1; titles with ε, δ and the privacy unit),
``DIR/results.md`` and ``DIR/results.json`` (final losses mean ± std over seeds, the honest accountant's epsilon
(summary ``dp.epsilon``), its RDP epsilon, wall time, samples/s, and — to compare with the paper's reported eps —
the paper's Theorem 3 figure for the same steps, ``paper_theorem3_reference_NOT_A_BOUND``: NOT a valid DP bound,
never a run's privacy).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from widedp.commands.compare_plots import PAPER_KEY, plot_curves, results_markdown
from widedp.commands.evaluate import run_similarity
from widedp.config import Config, config_from_dict
from widedp.config.tools import apply_overrides, read_config_file, read_yaml_file, show
from widedp.errors import ConfigError
from widedp.run import rundir
from widedp.run.checkpoint import CHECKPOINT, load_checkpoint, read_json, write_json

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
_RUN_KEYS = {"name", "config", "set", "seeds"}
_TOP_KEYS = {"runs", "set", "panels"}


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
        raw = read_config_file(self.config_path)  # UTF-8, no repeated keys, no bare dp:
        for key, value in self.sets:
            _set(raw, key, copy.deepcopy(value))
        apply_overrides(raw, self.cli)
        _set(raw, "train.seed", seed)
        return config_from_dict(raw)


@dataclass(frozen=True)
class Sweep:
    """``panels``: run names in table order; ``groups``: (panel title, run names overlaid) when the sweep names its
    panels, else None (one panel per run)."""

    path: Path
    runs: tuple[SweepRun, ...]
    panels: tuple[str, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...] | None = None


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read and validate a sweep file (every run's config is loaded once per seed, so bad keys fail here)."""
    p = Path(path)
    raw = _read_sweep_file(p)
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
    panels, groups = _panels(path, raw.get("panels"), [r.name for r in runs])
    return Sweep(p, tuple(runs), panels, groups)


def _panels(path: str | Path, raw: Any, names: list[str]
            ) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...] | None]:
    """``panels:`` -> (run names in order, named groups or None)."""
    if raw is None:
        return tuple(names), None
    if isinstance(raw, dict):
        groups = []
        for title, members in raw.items():
            if not isinstance(title, str) or not title.strip():
                raise ConfigError(f"{path}: panels: a panel title must be a non-empty string, got {show(title)}")
            if not isinstance(members, list) or not members or not all(isinstance(x, str) for x in members):
                raise ConfigError(f"{path}: panels.{title}: expected a non-empty list of run names")
            groups.append((title, tuple(members)))
        flat = [x for _, m in groups for x in m]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        groups, flat = None, list(raw)
    else:
        raise ConfigError(f"{path}: panels: expected a list of run names, or a mapping of panel titles to lists")
    unknown = [x for x in flat if x not in names]
    if unknown:
        raise ConfigError(f"{path}: panels: {unknown[0]!r} is not a run name")
    order = tuple(dict.fromkeys(flat))
    return order, (tuple(groups) if groups is not None else None)


def _read_sweep_file(p: Path) -> Any:
    """A sweep file's YAML (UTF-8, no repeated keys; a ``dp:`` given no value under ``set`` is refused)."""
    raw, empty = read_yaml_file(p, what="sweep file")
    bare = sorted(k for k in empty if k.endswith(".dp") and ".set." in f".{k}")
    if bare:
        raise ConfigError(f"{p}: {bare[0]}: is present but empty; give its keys, or write dp: null for non-private "
                          "training")
    return raw


def _overrides(path: str | Path, key: str, raw: Any) -> list[tuple[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k for k in raw):
        raise ConfigError(f"{path}: {key}: expected a mapping of dotted keys to values, got {raw!r}")
    return list(raw.items())


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


#: what compare does with a run directory -> the words it prints
ACTIONS = {"new": "training", "reuse": "reusing it (finished, same config)",
           "resume": "resuming it from its checkpoint (same config)",
           "restart": "restarting it (it stopped before its first checkpoint: nothing was released)",
           "rerun": "rerunning it (--overwrite: it holds a run of another config)"}


def recorded_hash(d: Path) -> str | None:
    """The config hash a run directory recorded (``summary.json``, else ``checkpoint.pt``); None if unreadable."""
    try:
        if (d / "summary.json").is_file():
            s = read_json(d / "summary.json")
            if isinstance(s, dict) and isinstance(s.get("config_hash"), str):
                return s["config_hash"]
        if (d / CHECKPOINT).is_file():
            h = load_checkpoint(d).get("config_hash")
            return h if isinstance(h, str) else None
    except (ConfigError, AttributeError):
        return None
    return None


def plan(d: Path, cfg: Config, *, overwrite: bool = False) -> str:
    """What to do with run directory ``d`` for ``cfg`` (a key of ``ACTIONS``); a directory holding another config's
    run is a ConfigError unless ``overwrite``."""
    if not rundir.holds_run(d):
        return "new"
    finished, checkpointed = (d / "summary.json").is_file(), (d / CHECKPOINT).is_file()
    if not finished and not checkpointed:
        return "restart"
    h = recorded_hash(d)
    if h == cfg.hash() and checkpointed:
        return "reuse" if finished else "resume"
    if overwrite:
        return "rerun"
    why = (f"a finished run whose {CHECKPOINT} is gone" if h == cfg.hash() else
           f"holds a run of another config (recorded hash {h or 'unreadable'}, this sweep's {cfg.hash()})")
    raise ConfigError(f"{d}: {why}; use a new --out, or pass --overwrite to rerun it")


def run_sweep(sweep: Sweep, out: Path, *, progress: bool | str = False, overwrite: bool = False,
              keep_going: bool = False) -> dict[Path, str]:
    """Train every run x seed the plan says to (``plan``); every directory is checked before anything trains.
    Returns run directory -> action (``"failed: <one line>"`` for a run whose config error ``keep_going`` passed
    over: the sweep goes on with the next run)."""
    from widedp.run.train import train
    from widedp.tasks import AlgorithmTask, get_task

    todo = []
    for run in sweep.runs:
        for seed in run.seeds:
            d = run_dir(out, run.name, seed)
            cfg = run.config(seed)
            todo.append((run, seed, d, cfg, plan(d, cfg, overwrite=overwrite)))
    data_cache: dict[Any, Any] = {}
    failed: dict[Path, str] = {}
    for run, seed, d, cfg, action in todo:
        print(f"widedp compare: {run.name} seed {seed} -> {d}: {ACTIONS[action]}", file=sys.stderr, flush=True)
        if action == "reuse":
            continue
        task = get_task(cfg.task)
        data = None
        if not isinstance(task, AlgorithmTask):  # data several runs may share (a corpus; not a DP vocabulary)
            key = json.dumps(cfg.to_dict()["data"], sort_keys=True)  # (a module task's kwargs are not hashable)
            if key not in data_cache:
                data_cache = {key: task.shared_data(cfg)}  # keep one prepared corpus in memory at a time
            data = data_cache[key]
        try:
            train(cfg, d, resume=action == "resume", overwrite=action in ("restart", "rerun"), progress=progress,
                  data=data)
        except ConfigError as e:
            if not keep_going:
                raise
            print(f"widedp compare: {run.name} seed {seed}: FAILED: {e}", file=sys.stderr, flush=True)
            failed[d] = f"failed: {e}"
    return {d: failed.get(d, action) for _, _, d, _, action in todo}


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
                  "test_accuracy", "test_auc", "test_ne"):
            row[k] = _stats([s.get(k) for s in sums])
        row["epsilon"] = _stats([d.get("epsilon") for d in dps]) if row["private"] else None
        row["epsilon_rdp"] = _stats([d.get("epsilon_rdp") for d in dps]) if row["private"] else None
        row[PAPER_KEY] = _stats([_paper_reference(d) for d in dps]) if row["private"] else None
        row["epsilon_lower"] = _stats([_audit_lower(run_dir(out, name, s)) for s in run.seeds])
        row |= _similarity([run_dir(out, name, s) for s in run.seeds])
        priv = [s.get("privacy") if isinstance(s.get("privacy"), dict) else {} for s in sums]
        row["delta"] = dps[0].get("delta") if row["private"] else None
        row["unit"] = priv[0].get("unit")
        row["privacy"] = priv[0].get("text")  # the first seed's statement (ε differs a little across seeds)
        row["run_dirs"] = [str(run_dir(out, name, s)) for s in run.seeds]
        rows.append(row)
    return rows


def _similarity(dirs: list[Path]) -> dict[str, Any]:
    """A CBOW run's word-similarity columns (``widedp eval``'s Spearman ρ and share of pairs in the vocabulary per
    benchmark, over seeds); nothing for other tasks."""
    per_seed = [run_similarity(d) for d in dirs]
    if all(x is None for x in per_seed):
        return {}
    return {k: _stats([(x or {}).get(k) for x in per_seed]) for k in next(x for x in per_seed if x is not None)}


def _audit_lower(d: Path) -> float | None:
    """``widedp audit``'s empirical lower bound when the run directory holds its audit.json (docs/audit.md)."""
    p = d / "audit.json"
    return read_json(p).get("epsilon_lower") if p.is_file() else None


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


def finished_part(sweep: Sweep, out: Path) -> Sweep:
    """``sweep`` restricted to the seeds whose run finished (``summary.json``); runs with none are dropped."""
    runs = []
    for r in sweep.runs:
        seeds = tuple(s for s in r.seeds if (run_dir(out, r.name, s) / "summary.json").is_file())
        if seeds:
            runs.append(dataclasses.replace(r, seeds=seeds))
    names = {r.name for r in runs}
    groups = None if sweep.groups is None else tuple(
        (t, tuple(n for n in members if n in names)) for t, members in sweep.groups
        if any(n in names for n in members))
    return dataclasses.replace(sweep, runs=tuple(runs), panels=tuple(n for n in sweep.panels if n in names),
                               groups=groups)


def compare(path: str | Path, out: Path, *, overrides: list[str] | tuple[str, ...] = (), progress: bool | str = False,
            overwrite: bool = False, keep_going: bool = False) -> list[dict[str, Any]]:
    """Run the sweep (reusing finished runs of the same config) and write curves.png, results.md, results.json.
    ``keep_going``: a run's config error is reported and the sweep goes on; the outputs cover the runs that
    finished, and a ``ConfigError`` naming the failed ones is raised at the end."""
    sweep = load_sweep(path, overrides)
    out.mkdir(parents=True, exist_ok=True)
    actions = run_sweep(sweep, out, progress=progress, overwrite=overwrite, keep_going=keep_going)
    failed = [f"{d.parent.name} ({d.name})" for d, a in actions.items() if a.startswith("failed")]
    if failed:
        sweep = finished_part(sweep, out)
    rows = summarize(sweep, out) if sweep.runs else []
    if sweep.runs:
        runs = {r.name: ([history_of(run_dir(out, r.name, s)) for s in r.seeds],
                         [read_json(run_dir(out, r.name, s) / "summary.json") for s in r.seeds]) for r in sweep.runs}
        plot_curves(sweep, runs, out / "curves.png")
    write_json(out / "results.json", {"sweep": str(sweep.path), "rows": rows})
    (out / "results.md").write_text(results_markdown(rows, f"Results of {sweep.path.name}"))
    if failed:
        raise ConfigError(f"{len(failed)} run(s) failed (each reported above; the results cover the others): "
                          + ", ".join(failed))
    return rows
