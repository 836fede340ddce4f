"""``widedp train`` on two gloo processes (``widedp.distributed.ranks``, ``widedp.run.trainers.sharded``) against
one process.

- selection ``all`` and (almost) no noise: the 2-process run's final weights equal the 1-process run's (1e-6) and
  so do the ledgers (CBOW through torchrun, CBOW with a negatives pool and recsys through ``--nproc``);
- the exponential mechanism with noise: the 2-process run's ledger is the 1-process run's and its losses are in
  the same range; that the sharded selection and noise follow the single-process LAW is tested by chi^2 in
  tests/dp/test_distributed.py (exponential mechanism) and tests/dp/selection/test_selection_distributed.py
  (other selectors);
  nothing secret lies outside private/;
- kill -9 of ONE rank, resume on a different N (one-line error, exit 2), resume on the same N: the final weights
  are bit-equal to an uninterrupted 2-process run's, the journal is never lowered.

The cheap checks (refused keys, shard files, rank generator files) run in this process.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_corpus import data_section

from widedp import accounting
from widedp.cli import main
from widedp.config import config_from_dict
from widedp.distributed import ranks, shards
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.run.trainers.sharded import check_shardable

EXACT = ["--set", "dp.noise_multiplier=1e-6", "--set", "dp.accountant=rdp", "--set", "dp.selection={name: all}",
         "--set", "train.optimizer=sgd"]  # sigma > 0 is required; 1e-6 noise moves sgd's weights by ~1e-9
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cbow(tmp_path: Path, *, epochs: int = 1, ckpt_every: int = 20, rng_mode: str = "reproducible",
          data: str = "") -> Path:
    cfg = tmp_path / "cbow.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, extra=data)}
model: {{dim: 8, tied: false}}
train: {{epochs: {epochs + 1}, max_steps: {100 * epochs}, batch_size: 10, optimizer: lazy_adam, lr: 0.01,
        log_every: 25, checkpoint_every: {ckpt_every}, eval_max_samples: 50, seed: 3}}
dp:
  clip1: 1.0
  clip2: 1.0
  noise_multiplier: 1.0
  rng: {rng_mode}
  selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}
""")
    return cfg


def _recsys(tmp_path: Path) -> Path:
    cfg = tmp_path / "recsys.yaml"
    cfg.write_text(f"""
task: recsys
data: {{preset: synthetic, num_users: 40, num_items: 60, num_interactions: 3000, num_tags: 8,
       context_cardinality: 5, cache_dir: "{tmp_path / 'cache'}"}}
model: {{dim: 4, hidden: [8]}}
train: {{epochs: 1, batch_size: 50, optimizer: lazy_adam, lr: 0.05, log_every: 10, checkpoint_every: 10,
        eval_max_samples: 200, seed: 1}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible, selection: {{name: all}}}}
""")
    return cfg


def _one(cfg: Path, out: Path, *extra: str) -> None:
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", *extra]) == 0


def _nproc(*args: str, n: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "widedp", "train", *args, "--nproc", str(n), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "widedp", "train", *args, "--no-progress"], capture_output=True, text=True, env=ENV,
                          timeout=300)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def _model(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _same_ledgers(a: Path, b: Path) -> None:
    assert json.loads((a / "spent.json").read_text()) == json.loads((b / "spent.json").read_text())
    sa, sb = _summary(a), _summary(b)
    assert sa["dp"]["ledger"] == sb["dp"]["ledger"] and sa["dp"]["epsilon"] == sb["dp"]["epsilon"]
    assert sa["steps"] == sb["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cbow", "cbow_pool", "recsys"])
def test_two_processes_equal_one_without_noise(tmp_path, task):
    cfg = (_recsys(tmp_path) if task == "recsys"
           else _cbow(tmp_path, data=", negatives_pool: 6" if task == "cbow_pool" else ""))
    one, two = tmp_path / "one", tmp_path / "two"
    _one(cfg, one, *EXACT)
    if task == "cbow":  # torchrun itself
        r = _torchrun(str(cfg), "--out", str(two), *EXACT)
        assert r.returncode == 0, r.stderr
    else:
        _finish(_nproc(str(cfg), "--out", str(two), *EXACT))
    a, b = _model(one), _model(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    _same_ledgers(one, two)
    assert torch.load(two / "checkpoint.pt", weights_only=True)["world_size"] == 2
    assert sorted(p.name for p in (two / "shards").iterdir()) == [f"rank{r}-{_summary(two)['steps']}.pt"
                                                                   for r in (0, 1)]


def _secret_patterns(seeds: rng.RunSeeds) -> list[bytes]:
    values = [seeds.sampling, seeds.noise, *(ranks.derive_seed(seeds.noise, f) for f in ("rank0", "rank1", "shared"))]
    return [p for s in values for p in (str(s).encode(), s.to_bytes(8, "little"), s.to_bytes(8, "big"))]


@pytest.mark.slow
def test_exponential_with_noise_keeps_the_ledger_and_its_secrets(tmp_path):
    cfg = _cbow(tmp_path, rng_mode="secure")
    one, two = tmp_path / "one", tmp_path / "two"
    _one(cfg, one)
    _finish(_nproc(str(cfg), "--out", str(two)))
    _same_ledgers(one, two)
    la, lb = _summary(one)["valid_loss"], _summary(two)["valid_loss"]
    assert abs(la - lb) < 0.1 * la  # the same law (chi^2: tests/dp/test_distributed.py), not the same noise
    seeds = rng.load_seeds(two)
    assert seeds is not None and seeds.mode == "secure"
    priv = two / rng.PRIVATE_DIR
    assert stat.S_IMODE(priv.stat().st_mode) == 0o700
    assert {p.name for p in priv.iterdir()} == {"seeds.json", "rng-100-rank0.pt", "rng-100-rank1.pt"}
    for f in priv.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    for f in two.rglob("*"):  # nothing outside private/ holds a seed (or a derived one)
        if f.is_file() and priv not in f.parents:
            data = f.read_bytes()
            for pat in _secret_patterns(seeds):
                assert pat not in data, (f.name, pat)


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the child of ``parent`` whose environment says RANK=``rank`` (None: not started yet)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if f"RANK={rank}".encode() in (p / "environ").read_bytes().split(b"\0"):
                return int(p.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def _journal_steps(run: Path) -> int:
    return accounting.Ledger.from_json(json.loads((run / "spent.json").read_text())).steps


def _kill_rank1_after_a_checkpoint(cfg: Path, out: Path) -> int:
    """Start a 2-process run of ``cfg`` into ``out``, kill -9 rank 1 right after its first checkpoint; the step."""
    proc = _nproc(str(cfg), "--out", str(out))
    deadline = time.time() + 120
    while not (out / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    victim = _rank_pid(proc.pid, 1)
    assert proc.poll() is None and victim is not None, "the run finished before it could be killed: make it longer"
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    return torch.load(out / "checkpoint.pt", weights_only=True)["step"]


@pytest.mark.slow
def test_kill_9_of_one_rank_then_resume_matches_uninterrupted_run(tmp_path, capsys):
    cfg = _cbow(tmp_path, epochs=3, ckpt_every=25)  # 300 steps, dp.rng: reproducible (the reference repeats it)
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    killed_at = _kill_rank1_after_a_checkpoint(cfg, crashed)
    assert 0 < killed_at < 300
    journal = _journal_steps(crashed)
    assert journal >= killed_at

    for n in (1, 3):  # another number of processes: one line, exit 2, nothing touched
        if n == 1:
            assert main(["train", "--resume", str(crashed), "--nproc", "1", "--no-progress"]) == 2
            err = capsys.readouterr().err
        else:
            p = _nproc("--resume", str(crashed), n=3)
            err = p.communicate(timeout=120)[1]
            assert p.returncode == 2
        err = "\n".join(x for x in err.splitlines() if not x.startswith("widedp: warning: --nproc"))  # (2 cores)
        assert err.startswith("widedp: error:") and len(err.strip().splitlines()) == 1, err
        assert "trained on 2 process(es)" in err and "--nproc 2" in err
    assert torch.load(crashed / "checkpoint.pt", weights_only=True)["step"] == killed_at

    resume, seen = _nproc("--resume", str(crashed)), []
    while resume.poll() is None:
        seen.append(_journal_steps(crashed))
        time.sleep(0.02)
    _finish(resume)
    seen.append(_journal_steps(crashed))
    assert seen == sorted(seen) and seen[0] >= journal  # the journal is never lowered
    _finish(_nproc(str(cfg), "--out", str(ref)))

    _same_ledgers(ref, crashed)  # nothing forgotten, nothing counted twice
    a, b = _model(ref), _model(crashed)
    for k in a:  # every rank replays the lost steps exactly (its generator states are in private/)
        assert torch.equal(a[k], b[k]), k
    for r in (0, 1):
        sa = torch.load(shards.shard_path(ref, step=300, rank=r), weights_only=True)
        sb = torch.load(shards.shard_path(crashed, step=300, rank=r), weights_only=True)
        for part in ("model", "optimizer"):
            assert all(torch.equal(sa[part][k], sb[part][k]) for k in sa[part]), (r, part)


def test_resume_without_generator_states_takes_fresh_seeds_on_every_rank(tmp_path):
    """rng-STEP-rankR.pt lost (seeds.json kept): every rank continues from rank 0's fresh seeds, not from the old
    ones (which would redraw step 0's noise and the lost steps' batches), and the lost steps stay spent."""
    cfg = _cbow(tmp_path, epochs=3, ckpt_every=25, rng_mode="secure")
    crashed = tmp_path / "crashed"
    killed_at = _kill_rank1_after_a_checkpoint(cfg, crashed)
    journal, old = _journal_steps(crashed), rng.load_seeds(crashed)
    for p in (crashed / rng.PRIVATE_DIR).glob("rng-*.pt"):
        p.unlink()
    proc = _nproc("--resume", str(crashed))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    said = [x for x in err.splitlines() if "is missing" in x]  # said once (by rank 0), with the steps charged again
    assert len(said) == 1 and f"rng-{killed_at}-rank*.pt" in said[0] and "charged again" in said[0], err
    new = rng.load_seeds(crashed)
    assert new.sampling != old.sampling and new.noise != old.noise and new.mode == "secure"
    assert _summary(crashed)["steps"] == 300
    assert _journal_steps(crashed) == journal + 300 - killed_at  # the lost steps [killed_at, journal) stay spent


def _cfg(**over) -> object:
    base = {"train": {"optimizer": "sgd"}, "dp": {"clip1": 1.0, "noise_multiplier": 1.0, "selection": {"name": "all"}}}
    for key, value in over.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return config_from_dict(base)


@pytest.mark.parametrize(("over", "key"), [
    ({"dp__engine": "opacus"}, "dp.engine"),
    ({"data__privacy_unit": "sentence"}, "data.privacy_unit"),
    ({"data__vocabulary": "dp"}, "data.vocabulary"),
    ({"train__keep_best": True}, "train.keep_best"),
])
def test_refused_keys_are_named(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        check_shardable(_cfg(**over))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^dp:"):
        check_shardable(config_from_dict({"train": {"optimizer": "sgd"}}))
    check_shardable(_cfg())


def test_module_task_has_no_sharded_model():
    from widedp.run.trainers.sharded import shard_model

    with pytest.raises(ConfigError, match="task: module has no sharded model"):
        shard_model("module", None, 0, 2)


def test_shard_files_are_checked(tmp_path):
    state = {"model": {"w": torch.ones(2, 3)}, "optimizer": {}}
    shards.save_shard(tmp_path, state, step=7, rank=1, world=2)
    doc, err = shards.load_shard(tmp_path, step=7, rank=1, world=2, device=torch.device("cpu"))
    assert err is None and torch.equal(doc["model"]["w"], torch.ones(2, 3))
    assert "missing" in shards.load_shard(tmp_path, step=7, rank=0, world=2, device=torch.device("cpu"))[1]
    shards.shard_path(tmp_path, step=7, rank=0).write_bytes(b"not a checkpoint")
    assert "cannot be loaded safely" in shards.load_shard(tmp_path, step=7, rank=0, world=2,
                                                          device=torch.device("cpu"))[1]
    shards.save_shard(tmp_path, state, step=9, rank=1, world=2)
    shards.prune_shards(tmp_path, 9, rank=1)
    assert sorted(p.name for p in (tmp_path / shards.SHARDS_DIR).iterdir()) == ["rank0-7.pt", "rank1-9.pt"]


def test_rank_generator_states_are_kept_apart(tmp_path):
    g = torch.Generator().manual_seed(1)
    for step, rank in ((5, None), (5, 0), (5, 1), (9, 1)):
        rng.save_states(tmp_path, step, {"noise": g.get_state()}, rank=rank)
    rng.prune_states(tmp_path, 9, rank=1)
    names = sorted(p.name for p in (tmp_path / rng.PRIVATE_DIR).iterdir())
    assert names == ["rng-5-rank0.pt", "rng-5.pt", "rng-9-rank1.pt"]
    assert rng.load_states(tmp_path, 9, rank=1) is not None and rng.load_states(tmp_path, 9) is None
    assert ranks.derive_seed(12345, "rank0") != ranks.derive_seed(12345, "rank1") < 2**62
