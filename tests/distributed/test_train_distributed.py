"""``widedp train`` on two gloo processes (``widedp.distributed.ranks``, ``widedp.run.trainers.sharded``) against one
process (tests marked ``extended`` run with ``make test-extended``, not in CI).

- selection ``all`` and (almost) no noise: the 2-process run's final weights equal the 1-process run's (1e-6) and
  so do the ledgers (CBOW through torchrun, CBOW with a negatives pool and recsys through ``--nproc``);
- the exponential mechanism with noise: the 2-process run's ledger is the 1-process run's and its losses are in
  the same range; that the sharded selection and noise follow the single-process LAW is tested by chi^2 in
  tests/dp/test_distributed.py (exponential mechanism) and tests/dp/selection/test_selection_distributed.py
  (other selectors); nothing secret lies outside private/;
- kill -9 of ONE rank, resume on one process (one-line error, exit 2), resume on the same N: the final weights and
  optimizer state are bit-equal to an uninterrupted 2-process run's, the journal is never lowered;
- kill -9 of a 2-process run, resume on 3, kill -9 again, resume on 2 (every sample in every step, sigma -> 0): the
  tables and optimizer state load resharded, so the final weights equal an uninterrupted 1-process run's (1e-6);
  each resume draws fresh seeds and says so in one line, and every step journaled before a kill stays charged.

The weights are compared through ``widedp export`` (a DCP checkpoint read one table at a time). The cheap checks
(refused keys, rank generator files) run in this process.
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
from widedp.commands.export import export_release
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


def _recsys(tmp_path: Path, *, user: bool = False) -> Path:
    """A synthetic recommender (``user``: the user is the privacy unit, 5 users a batch)."""
    cfg = tmp_path / "recsys.yaml"
    unit = ", privacy_unit: user, max_samples_per_unit: 16" if user else ""
    cfg.write_text(f"""
task: recsys
data: {{preset: synthetic, num_users: 40, num_items: 60, num_interactions: 3000, num_tags: 8,
       context_cardinality: 5, cache_dir: "{tmp_path / 'cache'}"{unit}}}
model: {{dim: 4, hidden: [8]}}
train: {{epochs: 1, batch_size: {5 if user else 50}, optimizer: lazy_adam, lr: 0.05, log_every: 10,
        checkpoint_every: 10, eval_max_samples: 200, seed: 1}}
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
    """The run's final weights, as ``widedp export --format torch`` releases them."""
    out = run.parent / f"{run.name}-release"
    export_release(run, out, fmt="torch", overwrite=True)
    return torch.load(out / "model.pt", weights_only=True)


def _checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)


def _dcp_tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's DCP checkpoint (weights and row optimizer state), whole."""
    path = run / _checkpoint(run)["dcp"]
    return {k: shards.read_tensor(path, k, spec) for k, spec in shards.tensor_specs(path).items()}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _same_ledgers(a: Path, b: Path) -> None:
    assert json.loads((a / "spent.json").read_text()) == json.loads((b / "spent.json").read_text())
    sa, sb = _summary(a), _summary(b)
    assert all(sa["dp"].get(k) == sb["dp"].get(k) for k in ("ledger", "epsilon", "max_batch_size", "truncated_steps"))
    assert sa["steps"] == sb["steps"]


SENTENCE = ", privacy_unit: sentence, max_samples_per_unit: 8"
DP_VOCABULARY = ", vocabulary: dp, vocab_dp: {noise_multiplier: 1.0, max_words_per_unit: 5, delta: 1.0e-7}"
OPTIONS = ["--set", "dp.preselect={rows: 18, sigma: 1.0}", "--set", "train.keep_best=true",  # on top of EXACT: the
           "--set", "dp.max_batch_size=auto"]  # pre-selection, keep_best, bounded batches (in both summaries)
CASES = {"cbow": "", "cbow_pool": ", negatives_pool: 6", "cbow_sentence": SENTENCE,
         "cbow_options": SENTENCE + DP_VOCABULARY}


@pytest.mark.slow
@pytest.mark.parametrize("task", [*(pytest.param(t, marks=pytest.mark.extended) for t in ("cbow", "cbow_sentence",
                                   "recsys", "cbow_pool")), "cbow_options", "recsys_user"])
def test_two_processes_equal_one_without_noise(tmp_path, task):
    cfg = _recsys(tmp_path, user=task == "recsys_user") if task.startswith("recsys") else _cbow(tmp_path,
                                                                                                 data=CASES[task])
    extra = [*EXACT, *(OPTIONS if task == "cbow_options" else ())]
    one, two = tmp_path / "one", tmp_path / "two"
    _one(cfg, one, *extra)
    if task == "cbow":  # torchrun itself
        r = _torchrun(str(cfg), "--out", str(two), *extra)
        assert r.returncode == 0, r.stderr
    else:
        _finish(_nproc(str(cfg), "--out", str(two), *extra))
    if task == "cbow_options":  # drawn once by rank 0 with the run's seed: the one process's draws
        assert (one / "vocab_release.json").read_bytes() == (two / "vocab_release.json").read_bytes()
        assert (one / "private/preselect.json").read_bytes() == (two / "private/preselect.json").read_bytes()
        assert _summary(two)["kept_epoch"] == _summary(one)["kept_epoch"] is not None
    if task in ("cbow_sentence", "cbow_options", "recsys_user"):
        assert _summary(two)["units"] == _summary(one)["units"] and _summary(two)["units"]["n_units"] > 0
    a, b = _model(one), _model(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    _same_ledgers(one, two)
    if task.startswith("recsys"):  # the task's final metrics, computed collectively on the blocks
        for k in ("valid_auc", "test_auc", "valid_ne"):
            assert _summary(two)[k] == pytest.approx(_summary(one)[k], abs=1e-6), k
    ckpt = _checkpoint(two)
    assert ckpt["world_size"] == 2 and ckpt["model"] == {}  # no weights in checkpoint.pt: a DCP checkpoint
    folders = [p for p in two.iterdir() if p.name.startswith(shards.PREFIX)]
    assert [p.name for p in folders] == [ckpt["dcp"]] and ckpt["dcp"].startswith(f"dcp-{_summary(two)['steps']}")
    assert sorted(p.name for p in folders[0].iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


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


def _checkpoint_step(run: Path) -> int:
    """The step of the run's checkpoint (-1: none yet); checkpoint.pt is replaced atomically."""
    return _checkpoint(run)["step"] if (run / "checkpoint.pt").exists() else -1


def _kill_after_a_checkpoint(out: Path, *args: str, n: int = 2, after: int = 0) -> tuple[int, str]:
    """Start ``widedp train ARGS --nproc n`` (into ``out``), kill -9 its last rank right after its first checkpoint
    past step ``after``; the step of the checkpoint it leaves, and what the run said on stderr."""
    proc = _nproc(*args, n=n)
    deadline = time.time() + 240
    while _checkpoint_step(out) <= after and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    victim = _rank_pid(proc.pid, n - 1)
    assert proc.poll() is None and victim is not None, "the run finished before it could be killed: make it longer"
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    return _checkpoint_step(out), proc.stderr.read()


def _kill_rank1_after_a_checkpoint(cfg: Path, out: Path) -> int:
    """Start a 2-process run of ``cfg`` into ``out``, kill -9 rank 1 right after its first checkpoint; the step."""
    return _kill_after_a_checkpoint(out, str(cfg), "--out", str(out))[0]


@pytest.mark.extended  # (CI: the 2 -> 3 -> 2 resharding resume below kills and resumes too)
def test_kill_9_of_one_rank_then_resume_matches_uninterrupted_run(tmp_path, capsys):
    cfg = _cbow(tmp_path, epochs=3, ckpt_every=25)  # 300 steps, dp.rng: reproducible (the reference repeats it)
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    killed_at = _kill_rank1_after_a_checkpoint(cfg, crashed)
    assert 0 < killed_at < 300
    journal = _journal_steps(crashed)
    assert journal >= killed_at

    assert main(["train", "--resume", str(crashed), "--nproc", "1", "--no-progress"]) == 2  # one process: refused
    err = capsys.readouterr().err
    assert err.startswith("widedp: error:") and len(err.strip().splitlines()) == 1, err
    assert "trained on 2 process(es)" in err and "2 or more" in err and "--nproc 2" in err
    assert _checkpoint(crashed)["step"] == killed_at

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
    sa, sb = _dcp_tensors(ref), _dcp_tensors(crashed)
    assert sa.keys() == sb.keys() and any(k.startswith("optim.") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.extended  # (CI: the resharding resume draws fresh seeds on every rank)
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


def _every_sample(tmp_path: Path, steps: int) -> Path:
    """``steps`` steps of a CBOW over every training sample (q = 1: the batches are the same whatever the seeds),
    selection ``all``, lazy Adam (per-row moments and step counts), a checkpoint every step. sigma = 1e-20: Adam
    divides by sqrt(v) + eps, so on a row no sample moves the noise must stay far below eps for the weights not to
    follow it."""
    cfg = tmp_path / "every.yaml"
    cfg.write_text(f"""
{data_section(tmp_path)}
model: {{dim: 8, tied: false}}
train: {{epochs: {steps}, batch_size: 1000, optimizer: lazy_adam, lr: 0.01, log_every: 5, eval_max_samples: 50,
        seed: 3}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0e-20, sampling_rate: 1.0, accountant: rdp, rng: reproducible,
     selection: {{name: all}}}}
""")
    return cfg


@pytest.mark.slow
def test_resume_on_another_number_of_processes_reshards_tables_and_optimizer(tmp_path):
    steps = 40
    cfg = _every_sample(tmp_path, steps)
    ref, run = tmp_path / "ref", tmp_path / "run"
    _one(cfg, ref)
    k1, _ = _kill_after_a_checkpoint(run, str(cfg), "--out", str(run), n=2)
    j1, seeds1 = _journal_steps(run), rng.load_seeds(run)
    assert 0 < k1 < steps and j1 >= k1
    k2, err = _kill_after_a_checkpoint(run, "--resume", str(run), n=3, after=k1)  # 2 -> 3
    j2, seeds2 = _journal_steps(run), rng.load_seeds(run)
    said = [x for x in err.splitlines() if "resumed on 3" in x]
    assert len(said) == 1 and "trained on 2 processes" in said[0] and "drawn fresh" in said[0], err
    assert k1 < k2 < steps and j2 >= j1 + k2 - k1 and seeds2 != seeds1  # the steps past k1 journaled stay charged
    proc = _nproc("--resume", str(run), n=2)  # 3 -> 2
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    said = [x for x in err.splitlines() if "resumed on 2" in x]
    assert len(said) == 1 and "trained on 3 processes" in said[0] and "drawn fresh" in said[0], err
    assert rng.load_seeds(run) not in (seeds1, seeds2)
    assert _summary(run)["steps"] == steps and _journal_steps(run) == j2 + steps - k2
    assert {p.name for p in (run / rng.PRIVATE_DIR).iterdir()} == {"seeds.json", f"rng-{steps}-rank0.pt",
                                                                   f"rng-{steps}-rank1.pt"}
    a, b = _model(ref), _model(run)  # the tables and the lazy Adam state went through both reshardings
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


@pytest.mark.extended
def test_keep_best_survives_a_resume_on_another_number_of_processes(tmp_path):
    """train.keep_best at lr 5 (the validation loss is lowest after epoch 2 of 4): killed past its epoch-2
    checkpoint and resumed on 3 processes, the run ends with epoch 2's weights, read back resharded from the DCP
    checkpoint's best.* blocks: an uninterrupted 2-process run's, bit for bit."""
    cfg = _cbow(tmp_path, epochs=3, data=SENTENCE)
    extra = [*EXACT, "--set", "train.lr=5", "--set", "train.keep_best=true"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _finish(_nproc(str(cfg), "--out", str(ref), *extra))
    killed_at, _ = _kill_after_a_checkpoint(run, str(cfg), "--out", str(run), *extra, after=59)
    best = _checkpoint(run)["best"]
    assert 60 <= killed_at < 116 and best["epoch"] == 2 and best["model"] == {}  # (its blocks: in dcp-STEP/)
    _finish(_nproc("--resume", str(run), n=3))
    assert _summary(run)["kept_epoch"] == _summary(ref)["kept_epoch"] == 2
    a, b = _model(ref), _model(run)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _cfg(**over) -> object:
    base = {"train": {"optimizer": "sgd"}, "dp": {"clip1": 1.0, "noise_multiplier": 1.0, "selection": {"name": "all"}}}
    for key, value in over.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return config_from_dict(base)


def test_what_cannot_run_on_several_processes_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^dp\.engine: opacus runs on one process") as e:
        check_shardable(_cfg(dp__engine="opacus"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^dp:"):
        check_shardable(config_from_dict({"train": {"optimizer": "sgd"}}))
    for over in ({"data__privacy_unit": "sentence"}, {"data__privacy_unit": "document", "data__vocabulary": "dp"},
                 {"train__keep_best": True}, {"dp__preselect": {"rows": 10, "sigma": 1.0}}):
        check_shardable(_cfg(**over))  # every privacy unit and option runs on several processes


def test_module_task_has_no_sharded_model():
    from widedp.run.trainers.sharded import shard_model

    with pytest.raises(ConfigError, match="task: module has no sharded model"):
        shard_model("module", None, 0, 2)


def test_rank_generator_states_are_kept_apart(tmp_path):
    g = torch.Generator().manual_seed(1)
    for step, rank in ((5, None), (5, 0), (5, 1), (9, 1)):
        rng.save_states(tmp_path, step, {"noise": g.get_state()}, rank=rank)
    rng.prune_states(tmp_path, 9, rank=1)
    names = sorted(p.name for p in (tmp_path / rng.PRIVATE_DIR).iterdir())
    assert names == ["rng-5-rank0.pt", "rng-5.pt", "rng-9-rank1.pt"]
    assert rng.load_states(tmp_path, 9, rank=1) is not None and rng.load_states(tmp_path, 9) is None
    assert ranks.derive_seed(12345, "rank0") != ranks.derive_seed(12345, "rank1") < 2**62
