"""Signals on one process and on several (``widedp.distributed.signals``, ``widedp.distributed.outcome``), with real
``python -m widedp train`` processes:

- SIGTERM / Ctrl-C (SIGINT): exit 143 / 130 and ONE line saying the step, the last checkpoint and the resume
  command; the lock released; the checkpoint and the journal intact: the run resumes (then is interrupted again);
- ``--nproc 2``: the same, one line for the whole run; ``kill -9`` of the launcher ends its ranks (no orphan keeps
  running or keeps the lock) and the run resumes; an exception in rank 1 is one line naming the rank.

The cheap parts (the launcher's line from the ranks' reports, the watchdog without torch) run without training.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_corpus import data_section

from widedp import accounting
from widedp.distributed import outcome, signals

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WAIT_S = 300  # (the test machine is shared: a process importing torch may start slowly)
LINE = re.compile(r"widedp: interrupted \((SIG\w+)\) at step ([\d,]+) of [\d,]+; the last checkpoint is step "
                  r"([\d,]+): resume with `widedp train --resume (\S+)( --nproc 2)?`")


def _config(tmp_path: Path) -> Path:
    """A DP CBOW run far longer than the tests wait (it is always stopped), a checkpoint every 20 steps."""
    cfg = tmp_path / "cbow.yaml"
    cfg.write_text(f"""
{data_section(tmp_path)}
model: {{dim: 8, tied: false}}
train: {{epochs: 1000, max_steps: 100000, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 25,
        checkpoint_every: 20, eval_max_samples: 50, seed: 3}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible,
     selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}}}
""")
    return cfg


def _start(*args: str, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "widedp", "train", *args, "--no-progress"] + (["--nproc", str(nproc)] if nproc > 1
                                                                               else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV,
                            preexec_fn=_sigint_default)


def _sigint_default() -> None:
    """A run started where SIGINT is ignored (pytest in a background job or under nohup) inherits that, and widedp
    rightly leaves an ignored signal alone: the Ctrl-C cases need SIGINT as a terminal would deliver it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _checkpoint_step(run: Path) -> int | None:
    try:
        return int(torch.load(run / "checkpoint.pt", weights_only=True)["step"])
    except (OSError, RuntimeError, EOFError, KeyError):
        return None


def _wait_checkpoint_after(proc: subprocess.Popen, run: Path, step: int) -> int:
    """Wait until ``run``'s checkpoint is past ``step``; its step."""
    deadline = time.time() + WAIT_S
    while time.time() < deadline and proc.poll() is None:
        now = _checkpoint_step(run)
        if now is not None and now > step:
            return now
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after step {step}: {proc.poll()=} {proc.stderr.read() if proc.poll() else ''}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(p.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _ranks(proc: subprocess.Popen, n: int) -> list[int]:
    deadline = time.time() + WAIT_S
    while len(kids := _children(proc.pid)) < n and time.time() < deadline:
        time.sleep(0.05)
    assert len(kids) == n, kids
    return kids


def _lock_free(run: Path) -> bool:
    fd = os.open(run / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _said(err: str) -> list[str]:
    """stderr without the warnings and the resume notice: what the run said when it ended."""
    return [x for x in err.splitlines() if x.strip() and not x.startswith(("widedp: warning:", "widedp: resuming"))]


def _interrupt(proc: subprocess.Popen, run: Path, sig: signal.Signals, *, after: int, nproc: int = 1) -> int:
    """Send ``sig`` once a checkpoint past ``after`` is written; check the exit status, the one line, the ranks
    gone, the lock, the checkpoint and the journal; the checkpoint's step."""
    _wait_checkpoint_after(proc, run, after)
    kids = _ranks(proc, nproc) if nproc > 1 else []
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + sig, err
    said = _said(err)
    assert len(said) == 1, err
    m = LINE.fullmatch(said[0])
    assert m, said
    step, saved = int(m[2].replace(",", "")), int(m[3].replace(",", ""))
    assert m[1] == sig.name and m[4] == str(run) and bool(m[5]) == (nproc > 1)
    ckpt = _checkpoint_step(run)
    assert ckpt is not None and after < saved <= ckpt <= step
    assert not [k for k in kids if _alive(k)] and _lock_free(run)
    assert accounting.Ledger.from_json(json.loads((run / "spent.json").read_text())).steps >= ckpt
    return ckpt


def test_sigterm_then_ctrl_c_of_a_resumed_run_on_one_process(tmp_path):
    run = tmp_path / "run"
    first = _interrupt(_start(str(_config(tmp_path)), "--out", str(run)), run, signal.SIGTERM, after=0)
    _interrupt(_start("--resume", str(run)), run, signal.SIGINT, after=first)


@pytest.mark.slow
def test_signals_and_kill_9_of_the_launcher_on_two_processes(tmp_path):
    run = tmp_path / "run"
    first = _interrupt(_start(str(_config(tmp_path)), "--out", str(run), nproc=2), run, signal.SIGTERM, after=0,
                       nproc=2)

    proc = _start("--resume", str(run), nproc=2)  # kill -9 of the launcher: its ranks end, the lock is released
    killed = _wait_checkpoint_after(proc, run, first)
    kids = _ranks(proc, 2)
    proc.kill()
    proc.communicate(timeout=WAIT_S)
    deadline = time.time() + signals.GRACE_S + 60
    while [k for k in kids if _alive(k)] and time.time() < deadline:
        time.sleep(0.05)
    assert not [k for k in kids if _alive(k)] and _lock_free(run)
    killed = _checkpoint_step(run)
    assert killed is not None and killed > first
    assert accounting.Ledger.from_json(json.loads((run / "spent.json").read_text())).steps >= killed

    _interrupt(_start("--resume", str(run), nproc=2), run, signal.SIGINT, after=killed, nproc=2)


@pytest.mark.extended
def test_an_exception_in_rank_1_is_one_line_naming_it(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()  # rank 1 raises at its first log interval (step 25), after the first checkpoint
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from widedp.run import loop\n"
        "    def boom(*a, **k):\n"
        "        raise RuntimeError('boom in rank 1\\nits second line')\n"
        "    loop._Loop.log_interval = boom\n")
    run = tmp_path / "run"
    proc = _start(str(_config(tmp_path)), "--out", str(run), nproc=2, env={**ENV, "PYTHONPATH": str(hook)})
    kids = _ranks(proc, 2)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err
    assert _said(err) == ["widedp: error: rank 1 of 2: RuntimeError: boom in rank 1"], err
    assert not [k for k in kids if _alive(k)] and _lock_free(run)
    assert _checkpoint_step(run) == 20


def _report(folder: Path, rank: int, kind: str, text: str, code: int, at: float) -> None:
    doc = {"rank": rank, "kind": kind, "text": text, "code": code, "detail": f"trace {rank}", "time": at}
    (folder / f"rank{rank}.json").write_text(json.dumps(doc))


def test_the_launcher_says_one_line_from_the_ranks_reports(tmp_path):
    line = outcome.launcher_line
    assert line(tmp_path, nproc=2, signum=15, exits={}) == (  # nothing reported (the ranks had not started)
        "widedp: " + signals.interrupted_text(15, None, command="train"), 143, "")
    _report(tmp_path, 1, "interrupted", "interrupted (SIGTERM) at step 7 of 9", 143, 1.0)
    _report(tmp_path, 0, "interrupted", "interrupted (SIGTERM) at step 8 of 9", 143, 2.0)
    assert line(tmp_path, nproc=2, signum=15, exits={0: 143, 1: 143})[:2] == (
        "widedp: interrupted (SIGTERM) at step 8 of 9", 143)  # rank 0's: where the run was
    assert line(tmp_path, nproc=3, signum=None, exits={0: 143, 1: 143, 2: -9})[:2] == (  # the silent death first
        "widedp: error: rank 2 of 3 killed by SIGKILL (the other ranks were stopped; what was written is kept)", 1)
    assert line(tmp_path, nproc=2, signum=None, exits={0: 143, 1: 143})[:2] == (  # stopped from outside: the first
        "widedp: error: rank 1 of 2: interrupted (SIGTERM) at step 7 of 9", 143)
    _report(tmp_path, 0, "error", "error: RuntimeError: gloo connection closed", 1, 3.0)
    _report(tmp_path, 1, "error", "error: ValueError: the bug", 1, 2.5)
    assert line(tmp_path, nproc=2, signum=None, exits={0: 1, 1: 1}) == (  # the first error, not its echo
        "widedp: error: rank 1 of 2: ValueError: the bug", 1, "trace 1")
    _report(tmp_path, 0, "error", "error: x.yaml: bad key", 2, 9.0)  # an error every rank raised: rank 0 says it
    assert line(tmp_path, nproc=2, signum=None, exits={0: 2, 1: 1})[:2] == ("widedp: error: x.yaml: bad key", 2)


def test_interrupted_text_says_where_and_how_to_go_on():
    pos = signals.Position(Path("runs/a b"), step=1234, total=5000, checkpoint=1200, world=2)
    assert signals.interrupted_text(2, pos, command="train") == (
        "interrupted (SIGINT) at step 1,234 of 5,000; the last checkpoint is step 1,200: resume with "
        "`widedp train --resume 'runs/a b' --nproc 2`")
    first = signals.Position(Path("r"), step=5, total=10, checkpoint=None)
    assert "before its first checkpoint" in signals.interrupted_text(15, first, command="train")
    assert signals.interrupted_text(15, pos, command="compare").endswith("step 1,200 (in runs/a b)")
    try:
        with signals.noting(lambda: pos):
            raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        assert signals.position_of(e) == pos


def test_a_rank_ends_with_its_launcher_killed_by_sigkill(tmp_path):
    """The watchdog and PR_SET_PDEATHSIG, without torch: a "launcher" starts a "rank" that follows it and waits;
    kill -9 of the launcher ends the rank (by SIGTERM: it unwinds) within a second or so."""
    rank = ("import os, sys, time\n"
            "from widedp.distributed import signals\n"
            "with signals.handled():\n"
            "    try:\n"  # (the SIGTERM may come before print returns: the launcher reads the line first)
            "        print('ready', flush=True)\n"
            "        time.sleep(60)\n"
            "    except signals.Interrupted as e:\n"
            f"        open({str(tmp_path / 'ended')!r}, 'w').write(str(e.signum))\n"
            "        sys.exit(143)\n")
    launcher = ("import os, subprocess, sys, time\n"
                "env = {**os.environ, 'WIDEDP_LAUNCHER_PID': str(os.getpid())}\n"
                f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], env=env, stdout=subprocess.PIPE, text=True)\n"
                "p.stdout.readline()\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=ENV)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.time() + 20
    while _alive(child) and time.time() < deadline:
        time.sleep(0.02)
    assert not _alive(child)
    assert (tmp_path / "ended").read_text() == str(int(signal.SIGTERM))


def test_an_interrupt_a_finaliser_swallowed_is_raised_again_by_the_loop(tmp_path):
    """A signal handled inside ``__del__`` raises there and Python drops it ("Exception ignored"); later signals
    are ignored by design, so ``check`` (every training step) must raise it again, or the run would never stop."""
    script = ("import os, signal, sys\n"
              "from widedp.distributed import signals\n"
              "class Finalised:\n"
              "    def __del__(self):\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        sum(range(1000))\n"
              "with signals.handled():\n"
              "    try:\n"
              "        Finalised()\n"  # dropped at once: its __del__ gets the signal
              "        print('went on', flush=True)\n"
              "        signals.check()\n"
              "    except signals.Interrupted as e:\n"
              "        print('raised', e.signum, flush=True)\n"
              "        sys.exit(0)\n"
              "print('not raised', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=WAIT_S)
    assert done.stdout.split("\n")[:2] == ["went on", f"raised {int(signal.SIGTERM)}"], (done.stdout, done.stderr)
    assert "Exception ignored" in done.stderr  # the swallowed first raise (what made the run go on)
