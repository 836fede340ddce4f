"""The ``widedp`` command line.

    widedp train CONFIG [--out DIR] [--set key=value ...]     train (non-private or DP, from the YAML)
    widedp train --resume DIR                                  continue a run after a crash or kill -9
    widedp train CONFIG --nproc N                              on N processes, tables row-sharded (also torchrun)
    widedp train CONFIG --out DIR --overwrite                  replace the run in DIR (never done silently)
    widedp epsilon CONFIG [--set ...]                          the privacy a config would spend, as JSON
    widedp export RUN_DIR [--format word2vec|torch] [--out DIR] the release: weights, vocab, privacy statement
    widedp eval RUN_DIR|RELEASE [--out FILE]                   word similarity (WordSim-353, SimLex-999) -> eval.json
    widedp canary CONFIG [CONFIG ...] --nc 3 9 15 --out DIR    secret-sharer canaries: train, then evaluate
    widedp canary --runs RUN_DIR [RUN_DIR ...] --out DIR       evaluate runs trained with canaries
    widedp compare SWEEP.yaml --out DIR [--set key=value ...]  configs x seeds -> curves.png, results.md/.json
    widedp compare SWEEP.yaml --out DIR --overwrite            rerun the runs whose config changed
    widedp compare SWEEP.yaml --out DIR --keep-going           skip (and report) runs whose config fails
    widedp audit CONFIG --canaries M --out DIR [--per-step]    one-run empirical lower bound on ε (widedp.eval.audit)
    widedp configs [NAME]                                      the example configs shipped with widedp (or one)

Bad input (arguments, config keys, values, files) gives one line on stderr and exit code 2; a new run that fails
that way leaves no run directory behind (``widedp.run.rundir``). glibc malloc is tuned for large batches first
(``widedp.allocator``; ``WIDEDP_MALLOC=system`` keeps its defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from widedp import __version__
from widedp.allocator import tune_malloc
from widedp.errors import ConfigError

if TYPE_CHECKING:
    from widedp.config import Config


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): ``widedp train: error: ... (see widedp train --help)``."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="widedp", description="Differentially private training of wide models.")
    p.add_argument("--version", action="version", version=f"widedp {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model from a YAML config")
    t.add_argument("config", nargs="?", help="YAML config (omit with --resume)")
    t.add_argument("--out", help="run directory (default runs/<config name>)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dp.selection.name=uniform (repeatable)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--overwrite", action="store_true",
                   help="replace a run already in --out (its checkpoint, metrics and spent-budget journal are deleted)")
    t.add_argument("--nproc", type=int, metavar="N",
                   help="train on N local processes, the embedding tables row-sharded across them (as torchrun "
                        "--standalone --nproc_per_node=N -m widedp train ...); resume on the same N")
    s = sub.add_parser("configs", help="list the example configs shipped with widedp, or print one")
    s.add_argument("name", nargs="?", help="a config's name (as listed): print it")
    e = sub.add_parser("epsilon", help="print the privacy a config would spend (JSON), without training")
    e.add_argument("config")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    x = sub.add_parser("export", help="write a run's release (weights, vocab, privacy statement): the only thing to "
                                      "share")
    x.add_argument("run_dir")
    x.add_argument("--format", choices=["word2vec", "torch"], default="word2vec",
                   help="word2vec: CBOW input vectors for gensim (default); torch: the model's weights (any task)")
    x.add_argument("--out", help="release folder (default RUN_DIR/release)")
    x.add_argument("--overwrite", action="store_true", help="replace a release already in --out")
    v = sub.add_parser("eval", help="word-vector quality of a CBOW run or release: Spearman on WordSim-353 and "
                                    "SimLex-999, nearest neighbours -> eval.json")
    v.add_argument("path", metavar="RUN|RELEASE", help="a run directory or a folder written by widedp export")
    v.add_argument("--out", help="report file (default RUN|RELEASE/eval.json)")
    v.add_argument("--words", nargs="+", metavar="WORD", help="words whose nearest neighbours to list (default: the "
                   "8 most frequent vocabulary words that occur in the benchmarks)")
    v.add_argument("--k", type=int, default=5, help="neighbours per word (default 5)")
    c = sub.add_parser("compare", help="run a sweep of configs x seeds; write curves.png, results.md, results.json")
    c.add_argument("sweep", help="sweep YAML ({runs: [{name, config, set, seeds}], panels})")
    c.add_argument("--out", help="output directory (default runs/<sweep name>)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key in every run (applied after the sweep's own overrides)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--overwrite", action="store_true",
                   help="rerun (from scratch) the runs in --out whose recorded config differs from the sweep's; "
                        "without it such a run directory is an error")
    c.add_argument("--keep-going", action="store_true",
                   help="a run whose config fails (e.g. an infeasible target epsilon) is reported and skipped; the "
                        "results cover the others and the exit status is 2")
    _canary_parser(sub)
    _audit_parser(sub)
    return p


def _audit_parser(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("audit", help="one-run privacy audit: empirical lower bound on epsilon beside the accountant's")
    a.add_argument("config", help="CBOW training config (YAML)")
    a.add_argument("--canaries", type=int, default=1000, help="m: canaries, each included by a secret fair coin "
                   "(default 1000)")
    a.add_argument("--out", required=True, help="run directory; gets audit.json and audit.png")
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    a.add_argument("--per-step", action="store_true", help="also score every step's released noisy update (the "
                   "accountant's adversary; the headline bound then uses it)")
    a.add_argument("--confidence", type=float, default=0.95, help="one-sided confidence of the bound (default 0.95)")
    a.add_argument("--canary-scale", type=float, help="norm of each canary output row at init (default 4 * dp.clip1; "
                   "input rows: a tenth)")
    a.add_argument("--seed", type=int, default=0, help="public seed of the canaries, their init and tie-breaking")
    a.add_argument("--coin-seed", type=int, help="derive the coins from this seed (tests: NOT secret)")
    a.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    a.add_argument("--no-plot", action="store_true", help="no audit.png")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")


def _canary_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("canary", help="secret-sharer canary evaluation (train with canaries, rank, chi2, exposure)")
    k.add_argument("configs", nargs="*", metavar="CONFIG", help="training configs; one run per config and n_c")
    k.add_argument("--runs", nargs="+", metavar="RUN_DIR", help="evaluate these runs (trained with canaries) instead")
    k.add_argument("--nc", nargs="+", type=int, default=[3, 9, 15], help="insertions per canary (default 3 9 15)")
    k.add_argument("--out", default="runs/canary", help="output directory (default runs/canary)")
    k.add_argument("--num-canaries", type=int, help="canaries (and as many controls); default 1000 when training, "
                   "all saved ones with --runs")
    k.add_argument("--num-candidates", type=int, default=10_000, help="random phrases per rank (default 10000)")
    k.add_argument("--bins", type=int, help="rank-histogram bins of the chi2 test (default 20, at most "
                   "--num-candidates + 1)")
    k.add_argument("--seed", type=int, default=0, help="seeds the canaries, their positions and the candidates")
    k.add_argument("--method", choices=["auto", "factorized", "log_prob"], default="auto",
                   help="rank computation (auto: closed form for the CBOW)")
    k.add_argument("--device", help="evaluation device (default: the run's train.device)")
    k.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of every CONFIG (repeatable)")
    k.add_argument("--no-plot", action="store_true", help="no canary_ranks.png")
    k.add_argument("--overwrite", action="store_true", help="replace a run directory that holds a run with other "
                   "canaries or another config (its checkpoint and spent-budget journal are deleted)")
    k.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, one line on stderr)
        return e.code if isinstance(e.code, int) else 2
    from widedp.distributed import outcome, signals

    with signals.handled():  # SIGINT / SIGTERM: one line, exit 130 / 143 (widedp.distributed.signals)
        try:
            tune_malloc()  # before the first large allocation (widedp.allocator)
            return _run(args)
        except BrokenPipeError:  # stdout closed early (`widedp epsilon ... | head`): stop quietly, as `yes | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except (Exception, KeyboardInterrupt) as e:  # bad input, the machine's errors, an interrupt: one line
            end = outcome.ending(e, command=args.cmd)
            if end is None:  # a bug: its traceback
                raise
            return outcome.report(end)


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand ``args.cmd`` (``COMMANDS``); its exit status."""
    command = COMMANDS.get(args.cmd)
    if command is None:  # pragma: no cover
        raise AssertionError(args.cmd)
    return command(args)


def _progress(args: argparse.Namespace) -> bool | str:
    """The progress output: none with --no-progress; a bar on a terminal (not under CI); else ``"lines"``, a plain
    line per log interval (CI logs, nohup: no carriage returns)."""
    if args.no_progress:
        return False
    return True if sys.stderr.isatty() and not os.environ.get("CI") else "lines"


def _train(args: argparse.Namespace) -> int:
    """``widedp train``: one process, ``--nproc`` launched ranks, or one rank of them; prints the summary line."""
    from widedp.config import load_config
    from widedp.distributed import ranks
    from widedp.run.train import default_out, train, train_rank
    from widedp.tasks import get_task

    if args.resume:
        if args.config is not None or args.overrides or args.overwrite:
            raise ConfigError("--resume: give only the run directory (its config.yaml is used)")
        run_dir = Path(args.resume)
        cfg = _run_config(run_dir)
        _refuse_finished(run_dir)
    else:
        if args.config is None:
            raise ConfigError("train: a CONFIG file (or --resume DIR) is required")
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(args.out) if args.out else default_out(args.config)
    progress = _progress(args)
    if args.nproc is not None and args.nproc != 1:
        from widedp.distributed.launch import launch

        return launch(args.nproc, _train_argv(args))
    if ranks.env_world() > 1:  # one rank of torchrun's (or --nproc's) processes
        ranks.init(cfg.train.device)
        try:
            summary = train_rank(cfg, run_dir, resume=bool(args.resume), progress=progress,
                                 overwrite=args.overwrite)
        finally:
            ranks.close()
        if not ranks.reports_errors():
            return 0  # rank 0 reports
    else:
        summary = train(cfg, run_dir, resume=bool(args.resume), progress=progress, overwrite=args.overwrite)
    keys = ("train_loss", "valid_loss", "test_loss", "steps", "samples_per_s") + get_task(cfg.task).summary_keys
    print(json.dumps({k: summary.get(k) for k in keys} | {"run_dir": str(run_dir)}
                     | ({"epsilon": summary["dp"]["epsilon"]} if summary.get("dp") else {})
                     | {"privacy": summary["privacy"]["text"], "notice": LOSSES_NOTICE}, ensure_ascii=False))
    _say_privacy(summary["privacy"])
    return 0


def _epsilon(args: argparse.Namespace) -> int:
    """``widedp epsilon``: the config's privacy report, as JSON."""
    from widedp.commands.epsilon import epsilon_report
    from widedp.config import load_config

    rep = epsilon_report(load_config(args.config, args.overrides))
    print(json.dumps(rep, indent=2, ensure_ascii=False))
    return 0


def _configs(args: argparse.Namespace) -> int:
    """``widedp configs``: the shipped configs' folder and one line on each, or one config's text."""
    from widedp.commands.configs import listing, show

    print(listing() if args.name is None else show(args.name), end="\n" if args.name is None else "")
    return 0


def _export(args: argparse.Namespace) -> int:
    """``widedp export``: write a run's release; prints its folder."""
    from widedp.commands.export import export_release

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "release"
    privacy = export_release(run_dir, out, fmt=args.format, overwrite=args.overwrite)
    print(out)
    _say_privacy(privacy)
    return 0


def _eval(args: argparse.Namespace) -> int:
    """``widedp eval``: word similarity of a run's or a release's vectors; a few lines, then where eval.json went."""
    from widedp.commands.evaluate import EVAL_FILE, evaluate, format_report

    path = Path(args.path)
    out = Path(args.out) if args.out else path / EVAL_FILE
    print(format_report(evaluate(path, out=out, probes=args.words, k=args.k)))
    print(f"widedp eval: wrote {out}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    """``widedp audit``: the one-run privacy audit; its figures as JSON, its line on stderr."""
    from widedp.config import load_config
    from widedp.eval.audit import format_line, run_audit

    report = run_audit(load_config(args.config, args.overrides), Path(args.out), canaries=args.canaries,
                       per_step=args.per_step, confidence=args.confidence, scale=args.canary_scale,
                       seed=args.seed, coin_seed=args.coin_seed, overwrite=args.overwrite, progress=_progress(args),
                       plot=not args.no_plot)
    print(json.dumps({k: report[k] for k in ("epsilon_lower", "epsilon", "ratio", "m", "guesses", "correct",
                                             "confidence", "primary", "epsilon_cap")}, ensure_ascii=False))
    print(format_line(report), file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    """``widedp compare``: train a sweep; prints its results table."""
    from widedp.commands.compare import compare
    from widedp.run.train import default_out

    out = Path(args.out) if args.out else default_out(args.sweep)
    compare(args.sweep, out, overrides=args.overrides, progress=_progress(args), overwrite=args.overwrite,
            keep_going=args.keep_going)
    print((out / "results.md").read_text(), end="")
    return 0


def _train_argv(args: argparse.Namespace) -> list[str]:
    """``widedp train`` arguments of ``args`` without --nproc (what each launched rank runs)."""
    argv = ["train", *([args.config] if args.config else []), *(["--out", args.out] if args.out else [])]
    argv += [a for kv in args.overrides for a in ("--set", kv)]
    argv += (["--resume", args.resume] if args.resume else []) + (["--overwrite"] if args.overwrite else [])
    return argv + (["--no-progress"] if args.no_progress else [])


def _run_config(run_dir: Path) -> Config:
    """The resolved config of a run directory (``config.yaml``), read as strictly as a config file."""
    from widedp.config import config_from_dict
    from widedp.config.tools import read_config_file

    if not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: not a directory")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a widedp run directory)")
    try:
        return config_from_dict(read_config_file(path))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


def _refuse_finished(run_dir: Path) -> None:
    """``--resume`` of a run that has finished (its summary.json written): nothing to resume, and nothing of it is
    rewritten."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    from widedp.run.checkpoint import read_json

    summary = read_json(path)
    steps = summary.get("steps") if isinstance(summary, dict) else None
    stopped = isinstance(summary, dict) and (summary.get("dp") or {}).get("stopped_by_budget")
    raise ConfigError(f"--resume {run_dir}: the run has finished"
                      + (f" ({steps} steps{', stopped by dp.target_epsilon' if stopped else ''})"
                         if isinstance(steps, int) else "")
                      + f"; nothing to resume: export it (widedp export {run_dir}), or train it again with "
                        "--overwrite")


#: beside the losses ``widedp train`` prints: they are computed on the private data, outside the privacy statement
LOSSES_NOTICE = ("the losses are NON-PRIVATE diagnostics (computed on the private data without DP) for whoever holds "
                 "it; the release is what `widedp export` writes")


def _say_privacy(privacy: dict) -> None:
    """The privacy statement on stderr: one line, loud when the run is not private."""
    prefix = "widedp: " if privacy.get("private") else "widedp: WARNING: "
    print(prefix + privacy["text"], file=sys.stderr)


def _canary(args: argparse.Namespace) -> int:
    from widedp.eval import canary_runs as cr

    if bool(args.runs) == bool(args.configs):
        raise ConfigError("canary: give CONFIG files to train, or --runs RUN_DIR ... to evaluate (not both)")
    num = args.num_canaries if args.num_canaries is not None else (1000 if args.configs else None)
    if args.bins is None:  # the default fits the candidates: a rank takes num_candidates + 1 values
        args.bins = max(2, min(20, args.num_candidates + 1))
    cr.check_args(ncs=args.nc, num_canaries=1 if num is None else num, num_candidates=args.num_candidates,
                  bins=args.bins)
    out = Path(args.out)
    if args.configs:
        from widedp.config import load_config

        cfgs = [(Path(p).stem.removeprefix("canary_"), load_config(p, args.overrides)) for p in args.configs]
        for p, (_, cfg) in zip(args.configs, cfgs):
            if cfg.task != "cbow":
                raise ConfigError(f"{p}: canary needs task cbow (it inserts word sequences into the corpus), got "
                                  f"task {cfg.task}")
            cr.check_vocab(cfg.data.vocab_size)
        progress = _progress(args)
        dirs = []
        for label, cfg in cfgs:
            for nc in args.nc:
                print(f"widedp canary: training {label} with n_c={nc} into {out / label / f'nc{nc}'}", file=sys.stderr)
                dirs.append(cr.train_canary_run(cfg, out / label / f"nc{nc}", label=label, n_c=nc, num_canaries=num,
                                                seed=args.seed, progress=progress, overwrite=args.overwrite))
    else:
        dirs = [Path(d) for d in args.runs]
    runs = [cr.load_canary_run(d, device=args.device) for d in dirs]  # all errors before the first evaluation
    results = [cr.evaluate_run(r, num_candidates=args.num_candidates, bins=args.bins, seed=args.seed,
                               num_canaries=num, method=args.method) for r in runs]
    report = cr.write_report(results, out, num_candidates=args.num_candidates, bins=args.bins, seed=args.seed,
                             plot=not args.no_plot)
    print(cr.format_table(report))
    print(f"widedp canary: wrote {out / cr.REPORT_FILE}" + ("" if args.no_plot else f" and {out / cr.PLOT_FILE}"))
    return 0


#: the subcommands: name -> the function that runs it (its exit status)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train, "epsilon": _epsilon, "export": _export, "canary": _canary, "audit": _audit, "compare": _compare,
    "eval": _eval, "configs": _configs,
}


if __name__ == "__main__":
    sys.exit(main())
