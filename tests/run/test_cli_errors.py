"""Malformed input through the CLI, table-driven: every case exits 2 with exactly one line on stderr that
names the problem, no traceback, and leaves no run directory half-written (a new run's --out holds no run files; a
resumed or exported run is byte-for-byte unchanged)."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import tiny_corpus
import torch

from widedp.cli import main

WORDS, GOOD = tiny_corpus.text(), tiny_corpus.GOOD_CONFIG


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.is_dir() else {}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A corpus, a good config and one finished DP run (copied for the cases that corrupt it)."""
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "corpus.txt").write_text(WORDS)
    (root / "good.yaml").write_text(GOOD.format(corpus=root / "corpus.txt", cache=root / "cache"))
    assert main(["train", str(root / "good.yaml"), "--out", str(root / "done"), "--no-progress"]) == 0
    unfinished = root / "unfinished"  # a run that checkpointed but did not finish (no summary.json)
    shutil.copytree(root / "done", unfinished)
    (unfinished / "summary.json").unlink()
    return root


def _config(tmp, text):
    p = tmp / "c.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return ["train", str(p), "--out", str(tmp / "new"), "--no-progress"]


def _corpus(tmp, content, **data):
    c = tmp / "corpus.txt"
    c.write_bytes(content if isinstance(content, bytes) else content.encode())
    extra = "".join(f", {k}: {v}" for k, v in data.items())
    return _config(tmp, f"data: {{preset: custom, corpus: 'text:{c}', cache_dir: '{tmp / 'cache'}', vocab_size: 11, "
                        f"splits: [100, 10, 10]{extra}}}\ntrain: {{epochs: 1, batch_size: 4, optimizer: sgd}}\n")


def _good(tmp, base, *sets):
    shutil.copy(base / "corpus.txt", tmp / "corpus.txt")
    (tmp / "good.yaml").write_text(GOOD.format(corpus=tmp / "corpus.txt", cache=tmp / "cache"))
    return ["train", str(tmp / "good.yaml"), "--out", str(tmp / "new"), "--no-progress",
            *[x for s in sets for x in ("--set", s)]]


def _one_sentence(tmp):
    (tmp / "one.txt").write_text("the cat sat on the mat with a hat\n")
    good = GOOD.format(corpus=tmp / "one.txt", cache=tmp / "cache")
    return _config(tmp, good.replace("vocab_size: 11", "vocab_size: 5").replace("splits: [1000, 100, 100], ", ""))


def _run_copy(tmp, base, name="done", corrupt=None):
    d = tmp / "run"
    shutil.copytree(base / name, d)
    if corrupt:
        rel, data = corrupt
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def _resume(tmp, base, rel, data, name="unfinished"):
    return ["train", "--resume", str(_run_copy(tmp, base, name, (rel, data))), "--no-progress"]


def _no_checkpoint(tmp, base):
    d = _run_copy(tmp, base, "unfinished")
    (d / "checkpoint.pt").unlink()
    return ["train", "--resume", str(d), "--no-progress"]


def _exported(tmp, base):
    """A release of the finished run in tmp/rel, and another run to export there."""
    assert main(["export", str(base / "done"), "--out", str(tmp / "rel")]) == 0
    return ["export", str(_run_copy(tmp, base)), "--out", str(tmp / "rel")]


def _zero_steps(tmp, base):
    summary = json.loads((base / "done" / "summary.json").read_text())
    summary["steps"], summary["dp"]["target_epsilon"] = 0, 0.01
    return ["export", str(_run_copy(tmp, base, corrupt=("summary.json", json.dumps(summary).encode()))), "--out",
            str(tmp / "rel")]


def _fifo(tmp):
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _sweep(tmp, base, text):
    shutil.copy(base / "good.yaml", tmp / "base.yaml")
    (tmp / "sweep.yaml").write_text(text)
    return ["compare", str(tmp / "sweep.yaml"), "--out", str(tmp / "new"), "--no-progress"]


NUL = b"\x00\x01\x02binary\x00" * 8
LATIN1 = "data: {corpus: 'caf\xe9'}\n".encode("latin-1")
CASES = {
    # ------------------------------------------------------------------------------------------------ config files
    "config missing": (lambda t, b: ["train", str(t / "nope.yaml"), "--out", str(t / "new")], "config file not found"),
    "config empty": (lambda t, b: _config(t, ""), "the file is empty"),
    "config binary": (lambda t, b: _config(t, NUL), "not a UTF-8 text file"),
    "config non-UTF-8": (lambda t, b: _config(t, LATIN1), "not UTF-8 text"),
    "config a list": (lambda t, b: _config(t, "- 1\n- 2\n"), "expected a mapping"),
    "data: a list": (lambda t, b: _config(t, "data: [1, 2]\n"), "data"),
    "data: a string": (lambda t, b: _config(t, "data: brown\n"), "data"),
    "task: a list": (lambda t, b: _config(t, "task: [cbow]\n"), "task"),
    "selection name a list": (lambda t, b: _config(t, "dp: {selection: {name: [exponential]}}\n"),
                              "dp.selection.name"),
    "unknown section": (lambda t, b: _config(t, "trian: {epochs: 1}\n"), "trian: unknown key"),
    "unknown key": (lambda t, b: _config(t, "train: {epocs: 3}\n"), "train.epocs: unknown key"),
    "negative epochs": (lambda t, b: _config(t, "train: {epochs: -1}\n"), "train.epochs"),
    "lr a word": (lambda t, b: _config(t, "train: {lr: fast}\n"), "train.lr"),
    "duplicate key": (lambda t, b: _config(t, "dp: {noise_multiplier: 1.0, noise_multiplier: 0.01}\n"),
                      "duplicate key"),
    "bare dp:": (lambda t, b: _config(t, "dp:\n#  noise_multiplier: 1.0\n"), "dp: is present but empty"),
    "invalid YAML": (lambda t, b: _config(t, "train: {epochs: 1\n"), "invalid YAML"),
    # ------------------------------------------------------------------------------------------------ text corpora
    "corpus missing": (lambda t, b: _config(t, f"data: {{preset: custom, corpus: 'text:{t / 'no.txt'}'}}\n"),
                       "no.txt"),
    "corpus a directory": (lambda t, b: _config(t, f"data: {{preset: custom, corpus: 'text:{t}'}}\n"),
                           "is a directory, not a regular file"),
    "corpus /dev/zero": (lambda t, b: _config(t, "data: {preset: custom, corpus: 'text:/dev/zero'}\n"),
                         "data.corpus: /dev/zero is a device, not a regular file"),
    "corpus a FIFO": (lambda t, b: _config(t, f"data: {{preset: custom, corpus: 'text:{_fifo(t)}'}}\n"),
                      "is a FIFO (named pipe), not a regular file"),
    "corpus empty": (lambda t, b: _corpus(t, ""), "corpus"),
    "corpus binary": (lambda t, b: _corpus(t, NUL), "NUL byte"),
    "corpus non-UTF-8": (lambda t, b: _corpus(t, "caf\xe9 ol\xe9\n".encode("latin-1") * 50), "corpus"),
    "corpus one word": (lambda t, b: _corpus(t, "hello\n" * 50), "corpus"),
    "corpus all stop words": (lambda t, b: _corpus(t, "the and of a to\n" * 50), "no tokens left"),
    # ------------------------------------------------------------------------------------------------ --set
    "--set without =": (lambda t, b: _good(t, b, "train.epochs"), "expected KEY=VALUE"),
    "--set empty key": (lambda t, b: _good(t, b, "=5"), "key before '=' is empty"),
    "--set empty part": (lambda t, b: _good(t, b, "train..epochs=5"), "empty part"),
    "--set bad value": (lambda t, b: _good(t, b, "train.epochs=[1"), "cannot parse value"),
    "--set through a value": (lambda t, b: _good(t, b, "train.epochs.x=1"), "train.epochs is not a section"),
    "--set unknown key": (lambda t, b: _good(t, b, "train.epoch=1"), "train.epoch: unknown key"),
    "--set bare dp": (lambda t, b: _good(t, b, "dp="), "--set dp"),
    "--set selection switch drops a key": (lambda t, b: _good(t, b, "dp.selection.name=all"),
                                           "dp.selection.k of 'uniform' is not a key of all (never dropped silently); "
                                           "set the whole section instead: --set 'dp.selection={name: all}'"),
    "--set selection switch without sigma": (
        lambda t, b: _good(t, b, "dp.selection={name: all}", "dp.selection.name=gaussian_threshold"),
        "dp.selection.sigma: not given; switching dp.selection to gaussian_threshold picks no default"),
    "--set selection switch without epsilon": (lambda t, b: _good(t, b, "dp.selection.name=exponential"),
                                               "dp.selection.epsilon: not given"),
    # ------------------------------------------------------------------------------------------------ --resume
    "resume corrupted checkpoint": (lambda t, b: _resume(t, b, "checkpoint.pt", b"PK\x03\x04 garbage"),
                                    "checkpoint.pt"),
    "resume truncated checkpoint": (
        lambda t, b: _resume(t, b, "checkpoint.pt", (b / "unfinished" / "checkpoint.pt").read_bytes()[:300]),
        "checkpoint.pt"),
    "resume corrupted journal": (lambda t, b: _resume(t, b, "spent.json", b"{not json"), "spent.json"),
    "resume before a checkpoint": (lambda t, b: _no_checkpoint(t, b), "stopped before its first checkpoint); start "
                                   "it again with --overwrite"),
    "resume journal not a ledger": (lambda t, b: _resume(t, b, "spent.json", b"[1, 2, 3]"), "spent.json"),
    "resume corrupted seeds": (lambda t, b: _resume(t, b, "private/seeds.json", b"\x00\x01"), "seeds"),
    "resume seeds not seeds": (lambda t, b: _resume(t, b, "private/seeds.json", b'{"mode": 3}'), "seeds"),
    "resume binary config.yaml": (lambda t, b: _resume(t, b, "config.yaml", NUL), "config.yaml"),
    "resume config.yaml of another": (lambda t, b: _resume(t, b, "config.yaml", b"train: {epochs: 2}\n"),
                                      "different config"),
    "resume a non-run dir": (lambda t, b: ["train", "--resume", str(t)], "not a widedp run directory"),
    "resume a missing dir": (lambda t, b: ["train", "--resume", str(t / "nope")], "not a directory"),
    "resume a finished run": (lambda t, b: ["train", "--resume", str(_run_copy(t, b)), "--no-progress"],
                              "the run has finished (100 steps); nothing to resume: export it"),
    "target epsilon allows no step": (lambda t, b: _good(t, b, "dp.target_epsilon=0.01"),
                                      "dp.target_epsilon: 0.01 allows no training step (one step spends ε="),
    "resume with a config": (lambda t, b: ["train", str(b / "good.yaml"), "--resume", str(_run_copy(t, b))],
                             "give only the run directory"),
    # ------------------------------------------------------------------------------------------------ out, device
    "out under a file": (lambda t, b: [*_good(t, b)[:3], str(t / "corpus.txt" / "run"), "--no-progress"],
                         "cannot create the run directory"),
    "out holds a run": (lambda t, b: [*_good(t, b)[:3], str(_run_copy(t, b)), "--no-progress"],
                        "already holds a run"),
    "device cuda without CUDA": (lambda t, b: _good(t, b, "train.device=cuda"), "CUDA is not available"),
    # ------------------------------------------------------------------------------------------------ out of range
    "batch above the training set": (lambda t, b: _good(t, b, "train.batch_size=10000000"),
                                     "train.batch_size: 10,000,000 is above the"),
    "one-sentence corpus": (lambda t, b: _one_sentence(t), "train.batch_size: 10 is above the 2 training pairs"),
    "target epsilon beyond the accountant": (
        lambda t, b: _good(t, b, "dp.target_epsilon=1000", "dp.calibrate=noise_multiplier"),
        "dp.target_epsilon: 1000 is beyond what the pld accountant resolves"),
    "model larger than memory": (lambda t, b: _good(t, b, "model.dim=10000000000"), "model.dim: 10,000,000,000 over"),
    "seed 2^70": (lambda t, b: _good(t, b, f"train.seed={2**70}"), "train.seed: must be in [0, 2^63)"),
    "seed negative": (lambda t, b: _good(t, b, "train.seed=-1"), "train.seed: must be in [0, 2^63)"),
    "delta 0.5": (lambda t, b: _good(t, b, "dp.delta=0.5"), "dp.delta: 0.5 is not below 1/N"),
    "delta 0.999": (lambda t, b: _good(t, b, "dp.delta=0.999"), "dp.delta: 0.999 is not below 1/N"),
    "no config": (lambda t, b: ["train", "--out", str(t / "new")], "CONFIG file"),
    "unknown command": (lambda t, b: ["trian", "x.yaml"], "invalid choice"),
    "epsilon bad config": (lambda t, b: ["epsilon", str(_config(t, "train: {epochs: 0}\n")[1])], "train.epochs"),
    # ------------------------------------------------------------------------------------------------ export
    "export a non-run dir": (lambda t, b: ["export", str(t), "--out", str(t / "rel")], "not a widedp run directory"),
    "export a missing dir": (lambda t, b: ["export", str(t / "nope"), "--out", str(t / "rel")], "not a directory"),
    "export an unfinished run": (lambda t, b: ["export", str(_run_copy(t, b, "unfinished")), "--out",
                                               str(t / "rel")], "has not finished"),
    "export into the run dir": (lambda t, b: ["export", str(_run_copy(t, b)), "--out", str(t / "run")],
                                "folder of its own"),
    "export over a release": (lambda t, b: _exported(t, b), "already holds a release (privacy.json, vectors.txt, "
                              "vocab.json), perhaps another run's; replace it with --overwrite"),
    "export a 0-step run": (lambda t, b: _zero_steps(t, b), "trained 0 steps (dp.target_epsilon=0.01 allowed none); "
                            "nothing to release"),
    "export bad format": (lambda t, b: ["export", str(t), "--format", "onnx"], "invalid choice"),
    # ------------------------------------------------------------------------------------------------ canary
    "canary nothing to do": (lambda t, b: ["canary", "--out", str(t / "c")], "give CONFIG files"),
    "canary both": (lambda t, b: ["canary", str(b / "good.yaml"), "--runs", str(t), "--out", str(t / "c")],
                    "not both"),
    "canary nc 0": (lambda t, b: ["canary", str(b / "good.yaml"), "--nc", "0", "--out", str(t / "c")], "--nc"),
    "canary nc a word": (lambda t, b: ["canary", "--runs", str(t), "--nc", "x"], "invalid int value"),
    "canary not cbow": (lambda t, b: ["canary", "configs/brown_glm_dp_agd.yaml", "--out", str(t / "c")],
                        "canary needs task cbow"),
    "canary one candidate": (lambda t, b: ["canary", "--runs", str(_run_copy(t, b)), "--num-candidates", "1",
                                           "--out", str(t / "c")], "canar"),  # (the --bins default fits it)
    "canary bins over candidates": (lambda t, b: ["canary", "--runs", str(t), "--num-candidates", "1", "--bins", "5"],
                                    "--bins: need 2 <= bins <= num_candidates + 1 = 2, got 5"),
    "canary runs not canary runs": (lambda t, b: ["canary", "--runs", str(_run_copy(t, b)), "--out",
                                                  str(t / "c")], "canar"),
    # ------------------------------------------------------------------------------------------------ compare
    "compare missing sweep": (lambda t, b: ["compare", str(t / "nope.yaml")], "sweep file not found"),
    "compare bad sweep": (lambda t, b: _sweep(t, b, "runs: [{name: a, config: base.yaml, seeds: [-1]}]\n"),
                          "runs[0].seeds"),
    "compare duplicate key in sweep": (lambda t, b: _sweep(t, b, "runs: []\nruns: []\n"), "duplicate key"),
    "compare bare dp in set": (lambda t, b: _sweep(t, b, "set:\n  dp:\nruns: [{name: a, config: base.yaml}]\n"),
                               "present but empty"),
    "compare bad --set": (lambda t, b: [*_sweep(t, b, "runs: [{name: a, config: base.yaml}]\n"), "--set",
                                        "train.nope=1"], "train.nope: unknown key"),
    "compare bad panels": (lambda t, b: _sweep(t, b, "runs: [{name: a, config: base.yaml}]\npanels: {x: [b]}\n"),
                           "'b' is not a run name"),
}


#: cases whose one line does not name the problem yet; the fix is outside the CLI
XFAIL = {
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(reason=XFAIL[c])) if c in XFAIL else c
                                  for c in CASES])
def test_malformed_input_is_one_line_exit_2(case, base, tmp_path, capsys):
    if case == "device cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    build, needle = CASES[case]
    argv = build(tmp_path, base)
    watched = {p: _files(p) for p in (tmp_path / "run", base / "done", base / "unfinished")}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    # notices printed before the failure (e.g. the CBOW vocabulary's "not covered by ε" warning) are not errors
    lines = [x for x in err.strip().splitlines() if not x.startswith("widedp: warning:")]
    assert len(lines) == 1, err
    assert "error" in lines[0] and needle in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "new").exists()  # a new run that failed leaves no directory
    for p, before in watched.items():  # a resumed / exported / reused run is untouched
        assert _files(p) == before, p


def test_enough_cases():
    assert len(CASES) >= 30


def test_a_failed_new_run_removes_only_what_it_wrote(base, tmp_path, capsys):
    """Calibration fails after the run wrote config.yaml / vocab.json: those go, the user's own files stay."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = [*_good(tmp_path, base, "dp.target_epsilon=0.000001", "dp.calibrate=noise_multiplier")[:3], str(out),
            "--no-progress", "--set", "dp.target_epsilon=0.000001", "--set", "dp.calibrate=noise_multiplier"]
    assert main(argv) == 2
    assert "calibration" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_the_machine_s_errors_are_one_line_exit_1(base, tmp_path, capsys):
    """A file where a folder should be (a cache folder, an export target): one line naming the path, exit 1."""
    (tmp_path / "afile").write_text("x")
    assert main(_good(tmp_path, base, f"data.cache_dir={tmp_path / 'afile' / 'sub'}")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"widedp: error: {tmp_path / 'afile' / 'sub'}: Not a directory (what was written before is kept)"
    assert main(["export", str(base / "done"), "--out", str(tmp_path / "afile" / "rel")]) == 1
    (line,) = [x for x in capsys.readouterr().err.strip().splitlines() if "error" in x]
    assert line.startswith("widedp: error: ") and str(tmp_path / "afile") in line and "Traceback" not in line


def test_a_release_is_shared_0644_and_replaced_only_with_overwrite(base, tmp_path, capsys):
    rel = tmp_path / "rel"
    assert main(["export", str(base / "done"), "--out", str(rel)]) == 0
    assert stat.S_IMODE(rel.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in rel.iterdir()} == {
        "privacy.json": 0o644, "vectors.txt": 0o644, "vocab.json": 0o644}
    # the run's private state stays private
    assert stat.S_IMODE((base / "done" / "private").stat().st_mode) == 0o700
    assert stat.S_IMODE((base / "done" / "checkpoint.pt").stat().st_mode) == 0o600
    (rel / "vectors.txt").write_text("old")
    assert main(["export", str(base / "done"), "--out", str(rel), "--overwrite"]) == 0
    assert (rel / "vectors.txt").read_text().startswith("11 8\n")


def test_progress_is_a_line_per_interval_off_a_terminal(base, tmp_path, capsys):
    """stderr is not a terminal here: a plain line per log interval (no carriage returns); --no-progress: none."""
    argv = [a for a in _good(tmp_path, base) if a != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("widedp: step ")]
    assert [x.split()[2] for x in lines] == ["25/100", "50/100", "75/100", "100/100"] and "\r" not in err
    assert "train_loss" in lines[0] and "samples/s" in lines[0]
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert "widedp: step " not in capsys.readouterr().err


def test_resume_says_from_which_step(base, tmp_path, capsys):
    d = _run_copy(tmp_path, base, "unfinished")
    assert main(["train", "--resume", str(d), "--no-progress"]) == 0
    assert f"widedp: resuming {d} from step 100 of 100" in capsys.readouterr().err.splitlines()


def test_resume_of_a_read_only_run_says_it_cannot_write_there(base, tmp_path, capsys, monkeypatch):
    """(root ignores file modes: the lock file's open is refused as on a read-only run directory)"""
    from widedp.run import rundir

    d = _run_copy(tmp_path, base, "unfinished")
    (d / ".lock").unlink(missing_ok=True)
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(rundir.LOCK):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(rundir.os, "open", read_only)
    assert main(["train", "--resume", str(d), "--no-progress"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert lines == [f"widedp: error: {d}: cannot write in the run directory (to lock it) (Permission denied)"]


def test_more_processes_than_cores_say_so(capsys, monkeypatch):
    from widedp.distributed.launch import warn_oversubscribed

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    warn_oversubscribed(2)
    assert capsys.readouterr().err == ""
    warn_oversubscribed(64)
    assert capsys.readouterr().err == ("widedp: warning: --nproc 64 on 2 CPU core(s): the processes share them and "
                                       "start slowly (each imports torch); at most 2 is faster here\n")
