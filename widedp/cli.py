"""The ``widedp`` command line.

    widedp train CONFIG [--out DIR] [--set key=value ...]     train (non-private or DP, from the YAML)
    widedp train --resume DIR                                  continue a run after a crash or kill -9
    widedp epsilon CONFIG [--set ...]                          the privacy a config would spend, as JSON
    widedp export RUN_DIR --format word2vec [--out FILE]       vectors for gensim

Bad input (config keys, values, files) gives one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from widedp.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="widedp", description="Differentially private training of wide models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model from a YAML config")
    t.add_argument("config", nargs="?", help="YAML config (omit with --resume)")
    t.add_argument("--out", help="run directory (default runs/<config name>)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dp.selection.name=uniform (repeatable)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = sub.add_parser("epsilon", help="print the privacy a config would spend (JSON), without training")
    e.add_argument("config")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    x = sub.add_parser("export", help="export embeddings of a run")
    x.add_argument("run_dir")
    x.add_argument("--format", choices=["word2vec"], default="word2vec")
    x.add_argument("--out", help="output file (default RUN_DIR/vectors.txt)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ConfigError as e:
        print(f"widedp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("widedp: interrupted (the last checkpoint and the spent-budget journal are kept)", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "train":
        from widedp.config import load_config
        from widedp.train import default_out, load_run_config, train

        if args.resume:
            run_dir = Path(args.resume)
            cfg = load_run_config(run_dir)
            if args.config is not None or args.overrides:
                raise ConfigError("--resume: give only the run directory (its config.yaml is used)")
        else:
            if args.config is None:
                raise ConfigError("train: a CONFIG file (or --resume DIR) is required")
            cfg = load_config(args.config, args.overrides)
            run_dir = Path(args.out) if args.out else default_out(args.config)
        progress = not args.no_progress and sys.stderr.isatty() and not os.environ.get("CI")
        summary = train(cfg, run_dir, resume=bool(args.resume), progress=progress)
        keys = ("train_loss", "valid_loss", "test_loss", "steps", "samples_per_s")
        print(json.dumps({k: summary[k] for k in keys} | {"run_dir": str(run_dir)}
                         | ({"epsilon": summary["dp"]["epsilon"]} if summary.get("dp") else {})))
        return 0
    if args.cmd == "epsilon":
        from widedp.budget import epsilon_report
        from widedp.config import load_config

        cfg = load_config(args.config, args.overrides)
        print(json.dumps(epsilon_report(cfg), indent=2))
        return 0
    if args.cmd == "export":
        from widedp.export import export_word2vec

        run_dir = Path(args.run_dir)
        out = Path(args.out) if args.out else run_dir / "vectors.txt"
        print(export_word2vec(run_dir, out))
        return 0
    raise AssertionError(args.cmd)  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
