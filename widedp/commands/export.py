"""``widedp export RUN_DIR [--format word2vec|torch] [--out DIR]``: the release — the only thing to share.

A run directory is private working state (secret seeds in ``private/``, non-private batch statistics in
``metrics.jsonl`` / ``summary.json``, optimizer state in ``checkpoint.pt``). The release directory holds exactly:

    DIR/vectors.txt     (word2vec)  the CBOW input embeddings; gensim: KeyedVectors.load_word2vec_format(path)
    DIR/model.pt        (torch)     the model's weights only (a state dict of tensors, written one table at a time)
    DIR/vocab.json      (CBOW)      the vocabulary, row order
    DIR/ids.json        (recsys)    the raw id of every row of every released table (``widedp.tasks.recsys``)
    DIR/privacy.json                the privacy statement: ε, δ, unit, adjacency, accountant, what is not covered

and nothing else (``widedp eval`` may add its eval.json, computed from the release alone). A recommender trained
with ``data.privacy_unit: user`` whose user rows are the data's raw user ids releases no user table and no user id
(``widedp.tasks.recsys.release_parts``: ids.json names it under ``withheld``); its item ids are still listed, as its
statement says. Every export of a run that is not private says so, in privacy.json and on stderr.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from widedp.distributed import shards
from widedp.errors import ConfigError
from widedp.run import rundir
from widedp.run.checkpoint import _atomic_write, load_checkpoint, read_json, write_json

FORMATS = ("word2vec", "torch")
RELEASE_FILES = {"word2vec": ("vectors.txt", "vocab.json", "privacy.json"),
                 "torch": ("model.pt", "vocab.json", "ids.json", "privacy.json")}


def _statement(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no summary.json (the run has not finished: resume it, then export)")
    summary = read_json(path)
    if not isinstance(summary, dict) or not isinstance(summary.get("privacy"), dict):
        raise ConfigError(f"{path}: no privacy statement (written by an older widedp: re-run to export)")
    if summary.get("steps") == 0:  # e.g. a dp.target_epsilon that allowed no step: the weights are the init's
        target = (summary.get("dp") or {}).get("target_epsilon")
        why = f" (dp.target_epsilon={target:g} allowed none)" if isinstance(target, (int, float)) else ""
        raise ConfigError(f"{run_dir}: trained 0 steps{why}; nothing to release")
    return summary["privacy"]


@dataclass(frozen=True)
class RunWeights:
    """The run's weights, one tensor at a time: ``specs`` key -> (shape, dtype), ``read(key)`` the tensor. A
    one-process run's checkpoint.pt holds them all; a run on several processes keeps them in a DCP checkpoint
    (``widedp.distributed.shards``), read one table at a time: the export never holds the whole model."""

    specs: dict[str, tuple[torch.Size, torch.dtype]]
    read: Callable[[str], torch.Tensor]


def run_weights(run_dir: Path) -> RunWeights:
    """The weights of run directory ``run_dir`` (``RunWeights``), or a ConfigError naming what is missing."""
    ckpt = load_checkpoint(run_dir)
    if isinstance(ckpt.get("dcp"), str):
        path = run_dir / ckpt["dcp"]
        try:
            every = shards.tensor_specs(path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        specs = {k.removeprefix("model."): v for k, v in every.items() if k.startswith("model.")}
        if not specs:
            raise ConfigError(f"{path}: the checkpoint holds no model weights")
        return RunWeights(specs, lambda key: shards.read_tensor(path, f"model.{key}", specs[key]))
    state = ckpt.get("model") if "model" in ckpt else {k: v for k, v in ckpt.items() if k == "w"}
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{run_dir}: the checkpoint holds no model weights")
    state = {k: v.detach().cpu() for k, v in state.items()}
    return RunWeights({k: (v.shape, v.dtype) for k, v in state.items()}, state.__getitem__)


def _word2vec_lines(run_dir: Path, vocab: list[str], weights: RunWeights) -> str:
    if "input.weight" not in weights.specs:
        raise ConfigError(f"{run_dir}: --format word2vec needs a CBOW run (no input.weight); use --format torch")
    weight = weights.read("input.weight").to(torch.float32)  # the context (input) embeddings, word2vec's vectors
    if weight.shape[0] < len(vocab):
        raise ConfigError(f"{run_dir}: embedding table has {weight.shape[0]} rows for {len(vocab)} words")
    lines = [f"{len(vocab)} {weight.shape[1]}"]
    for word, row in zip(vocab, weight.tolist()):
        lines.append(word + " " + " ".join(f"{x:.6g}" for x in row))
    return "\n".join(lines) + "\n"


def _save_tables(f: Any, weights: RunWeights) -> None:
    """``torch.save({key: weights.read(key)}, f)`` holding one tensor at a time: torch's format (a zip of the pickled
    dict, then one record per tensor) written as the pickle of shapes and dtypes alone (``skip_data``), then each
    tensor read, written as its record and freed. ``torch.load`` (``weights_only``, ``mmap``) reads it as any."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in weights.specs.items()}
    buf = io.BytesIO()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, buf)
    buf.seek(0)
    skeleton = torch._C.PyTorchFileReader(buf)
    names = skeleton.get_all_records()
    keys = list(weights.specs)  # torch numbers the records data/0, data/1, ... in the dict's order
    writer = torch._C.PyTorchFileWriter(f, True, int(bytes(skeleton.get_record(".storage_alignment")).decode()))
    for name in names:
        if name in ("version", ".data/serialization_id"):  # (the writer's own, at its end)
            continue
        if name.startswith("data/"):
            t = weights.read(keys[int(name.removeprefix("data/"))]).contiguous()
            writer.write_record(name, t.untyped_storage(), t.untyped_storage().nbytes())
            del t
        else:
            data = bytes(skeleton.get_record(name))
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()


def _recsys_release(run_dir: Path, state: dict[str, Any], ids: Any) -> tuple[dict[str, Any], Any]:
    """The weights and ids.json a recommender's release holds (``widedp.tasks.recsys.release_parts`` of the run's
    resolved config.yaml): without the tables its privacy unit keeps private."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (without it the release cannot tell which tables it may hold)")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        raise ConfigError(f"{path}: not a readable config") from None
    data = cfg.get("data") if isinstance(cfg, dict) else None
    if not isinstance(data, dict) or not isinstance(ids, dict):
        raise ConfigError(f"{run_dir}: config.yaml has no data: section or ids.json is not an id map")
    from widedp.tasks.recsys import release_parts

    try:
        return release_parts(data, state, ids)
    except ConfigError as e:
        raise ConfigError(f"{run_dir}: {e}") from None


def export_release(run_dir: Path, out: Path, *, fmt: str = "word2vec", overwrite: bool = False) -> dict[str, Any]:
    """Write the release of ``run_dir`` into ``out`` (created; must not hold anything else; a release already
    there is replaced only with ``overwrite``); returns the statement. The release's files are 0644, its folder
    0755: they are what is shared (the run directory's private state stays 0600/0700)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a directory")
    if not rundir.holds_run(run_dir):
        raise ConfigError(f"{run_dir}: not a widedp run directory (no config.yaml, checkpoint.pt or summary.json)")
    statement = _statement(run_dir)
    weights = run_weights(run_dir)
    vocab_path = run_dir / "vocab.json"
    vocab = read_json(vocab_path) if vocab_path.is_file() else None
    if fmt == "word2vec" and vocab is None:
        raise ConfigError(f"{run_dir}: no vocab.json (--format word2vec needs a CBOW run; use --format torch)")
    ids = None
    if (run_dir / "features.json").is_file():  # a recommender: its rows mean raw ids
        if fmt != "torch":
            raise ConfigError(f"{run_dir}: a recommender run; export it with --format torch")
        if not (run_dir / "ids.json").is_file():
            raise ConfigError(f"{run_dir}: no ids.json (trained by an older widedp: without the id -> row map the "
                              "weights cannot be used; re-run it)")
        ids = read_json(run_dir / "ids.json")
        specs, ids = _recsys_release(run_dir, weights.specs, ids)
        weights = RunWeights(specs, weights.read)
    out = out.resolve()
    _check_out(run_dir, out, fmt, overwrite=overwrite)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "word2vec":
            text = _word2vec_lines(run_dir, vocab, weights).encode()
            _atomic_write(tmp / "vectors.txt", lambda f: f.write(text))
        else:
            _atomic_write(tmp / "model.pt", lambda f: _save_tables(f, weights))
        if vocab is not None:
            write_json(tmp / "vocab.json", vocab)
        if ids is not None:
            write_json(tmp / "ids.json", ids, indent=None)
        write_json(tmp / "privacy.json", statement)
        for p in tmp.iterdir():
            p.chmod(0o644)
        tmp.chmod(0o755)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return statement


def _check_out(run_dir: Path, out: Path, fmt: str, *, overwrite: bool) -> None:
    """``out`` (resolved) may take the release: not the run directory or its private/, nothing but a release in it,
    and a release only with ``overwrite`` (never replaced silently: it may be another run's)."""
    if out == run_dir.resolve() or (run_dir.resolve() / "private") in (out, *out.parents):
        raise ConfigError(f"--out {out}: choose a folder of its own (not the run directory or its private/)")
    if not out.exists():
        return
    names = set(p.name for p in out.iterdir()) if out.is_dir() else {""}
    if names - set(RELEASE_FILES[fmt]) - {"eval.json"}:  # (widedp eval's report on the release: replaced with it)
        raise ConfigError(f"--out {out}: exists and holds other files; the release folder holds the release only")
    if names and not overwrite:
        raise ConfigError(f"--out {out}: already holds a release ({', '.join(sorted(names))}), perhaps another "
                          "run's; replace it with --overwrite, or choose another folder")
