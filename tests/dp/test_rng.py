"""The randomness that protects the data stays secret (issue: audit §1) and what is released is labelled (§5)."""

import json
import shutil
import stat

import pytest
import torch
from snapshots import train_with_snapshot
from tiny_corpus import data_section

from widedp import accounting
from widedp.cli import main
from widedp.config import load_config
from widedp.dp import rng
from widedp.errors import ConfigError
from widedp.run.train import train

SHAREABLE_IF_ANYTHING = ("config.yaml", "checkpoint.pt", "metrics.jsonl", "summary.json", "spent.json", "vocab.json",
                         "loss.png")


def _config(tmp_path, *, rng_mode: str | None = None, steps: int = 100, ckpt_every: int = 0):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path)}
model: {{dim: 8, tied: false}}
train: {{epochs: {steps // 100 + 1}, max_steps: {steps}, batch_size: 10, optimizer: lazy_adam, lr: 0.01,
        log_every: 25, checkpoint_every: {ckpt_every}, eval_max_samples: 50, seed: 3}}
dp:
  clip1: 1.0
  clip2: 1.0
  noise_multiplier: 1.0
  {'' if rng_mode is None else f'rng: {rng_mode}'}
  selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}
""")
    return cfg


def _train(tmp_path, name, **kw):
    d = tmp_path / name
    d.mkdir()
    out = d / "run"
    assert main(["train", str(_config(d, **kw)), "--out", str(out), "--no-progress"]) == 0
    return out


def _weights(run):
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def _secret_patterns(seeds: rng.RunSeeds) -> list[bytes]:
    out = []
    for s in (seeds.sampling, seeds.noise):
        out += [str(s).encode(), s.to_bytes(8, "little"), s.to_bytes(8, "big")]
    return out


def test_default_is_secret_and_kept_only_in_private(tmp_path):
    run = _train(tmp_path, "a")
    seeds = rng.load_seeds(run)
    assert seeds is not None and seeds.mode == "secure" and seeds.private
    priv = run / rng.PRIVATE_DIR
    assert stat.S_IMODE(priv.stat().st_mode) == 0o700
    for f in priv.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    # nothing outside private/ holds the seeds or a generator state
    for f in run.rglob("*"):
        if f.is_file() and priv not in f.parents:
            data = f.read_bytes()
            for pat in _secret_patterns(seeds):
                assert pat not in data, (f.name, pat)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert not {k for k in ckpt if "gen" in k or "rng" in k}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["private"] and summary["privacy"]["private"] and summary["dp"]["rng"] == "secure"


def test_secure_runs_differ_reproducible_runs_repeat(tmp_path):
    a, b = _weights(_train(tmp_path, "a")), _weights(_train(tmp_path, "b"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # same config.yaml, different noise: it is not in the config
    r1, r2 = _weights(_train(tmp_path, "r1", rng_mode="reproducible")), _weights(_train(tmp_path, "r2",
                                                                                        rng_mode="reproducible"))
    assert all(torch.equal(r1[k], r2[k]) for k in r1)


def test_reproducible_run_says_not_private_everywhere(tmp_path, capsys):
    run = _train(tmp_path, "r", rng_mode="reproducible")
    cap = capsys.readouterr()
    printed = json.loads(cap.out.strip().splitlines()[-1])
    assert printed["privacy"].startswith("NOT PRIVATE") and "WARNING: NOT PRIVATE" in cap.err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["private"] is False and summary["privacy"]["text"].startswith("NOT PRIVATE")
    assert main(["export", str(run), "--out", str(tmp_path / "rel")]) == 0
    assert "NOT PRIVATE" in capsys.readouterr().err
    assert json.loads((tmp_path / "rel" / "privacy.json").read_text())["private"] is False


def _run_with_snapshot(tmp_path, monkeypatch):
    """A 200-step run, and a copy of its run directory taken right after its checkpoint at step 60 (a crash)."""
    d = tmp_path / "s"
    d.mkdir()
    cfg = load_config(_config(d, steps=200, ckpt_every=60))
    run, snap = d / "run", d / "snap"
    full = train_with_snapshot(cfg, run, snap, step=60, monkeypatch=monkeypatch)
    return cfg, run, snap, full


def test_secure_run_resumes_exactly_from_private_state(tmp_path, monkeypatch):
    """A snapshot of the run directory at its first checkpoint, resumed, ends with the uninterrupted weights."""
    cfg, run, snap, full = _run_with_snapshot(tmp_path, monkeypatch)
    resumed = train(cfg, snap, resume=True, progress=False)
    a, b = _weights(run), _weights(snap)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full["dp"]["ledger"] == resumed["dp"]["ledger"] and resumed["steps"] == 200


def _redrawn_warning(err: str, lost: str) -> str:
    """The one stderr line that says the lost steps' randomness is redrawn and charged again."""
    lines = [x for x in err.splitlines() if "is missing" in x]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"widedp: warning: {lost}"), lines[0]
    assert "drawn fresh" in lines[0] and "charged again" in lines[0] and "conservative" in lines[0]
    return lines[0]


def test_resume_without_private_keeps_journaled_spend(tmp_path, monkeypatch, capsys):
    cfg, run, snap, _ = _run_with_snapshot(tmp_path, monkeypatch)
    journal = accounting.Ledger.from_json(json.loads((snap / "spent.json").read_text()))
    assert journal.steps == 75  # reserved ahead of the interval [50, 75) in which the checkpoint at 60 fell
    shutil.rmtree(snap / rng.PRIVATE_DIR)  # e.g. the directory was copied without its private part
    capsys.readouterr()
    resumed = train(cfg, snap, resume=True, progress=False)
    # fresh randomness cannot replay steps 60..75: they stay spent, on top of the 140 steps run after 60
    assert accounting.Ledger.from_json(resumed["dp"]["ledger"]).steps == 75 + 140
    line = _redrawn_warning(capsys.readouterr().err, str(snap / rng.PRIVATE_DIR / rng.SEEDS_FILE))
    assert "the 15 step(s) journaled after it (steps 61-75)" in line and "at step 60" in line


def test_resume_with_seeds_but_lost_generator_states_draws_fresh_randomness(tmp_path, monkeypatch, capsys):
    """private/seeds.json kept, rng-STEP.pt lost: restarting the generators from the seeds would redraw step 0's
    noise (and the lost steps' batches) at step 60; the run must take fresh seeds instead, and the lost steps stay
    spent (audit)."""
    import widedp.dp.noise as noise_mod

    noise: list[torch.Tensor] = []
    orig = noise_mod.gaussian_noise  # the step's noise (``noise.noisy``)
    monkeypatch.setattr(noise_mod, "gaussian_noise", lambda *a, **k: noise.append(z := orig(*a, **k)) or z)
    cfg, run, snap, _ = _run_with_snapshot(tmp_path, monkeypatch)
    first = [z.clone() for z in noise[:3]]
    old = rng.load_seeds(snap)
    for p in (snap / rng.PRIVATE_DIR).glob("rng-*.pt"):
        p.unlink()
    noise.clear()
    capsys.readouterr()
    resumed = train(cfg, snap, resume=True, progress=False)
    line = _redrawn_warning(capsys.readouterr().err, str(snap / rng.PRIVATE_DIR / "rng-60.pt"))
    assert "the 15 step(s) journaled after it" in line
    new = rng.load_seeds(snap)
    assert new.mode == "secure" and new.sampling != old.sampling and new.noise != old.noise
    for a, b in zip(first, noise[:3]):  # steps 0, 1, 2 of the first run vs steps 60, 61, 62 of the resumed one
        assert a.shape != b.shape or not torch.equal(a, b)
    assert accounting.Ledger.from_json(resumed["dp"]["ledger"]).steps == 75 + 140


def _flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # what happens to which private file -> the words of the error
    "state truncated": ("rng-60.pt", lambda p: p.write_bytes(p.read_bytes()[:200]), "unreadable generator state"),
    "state byte flipped": ("rng-60.pt", lambda p: _flip_byte(p, p.stat().st_size // 2), "fails its CRC check"),
    "state empty": ("rng-60.pt", lambda p: p.write_bytes(b""), "unreadable generator state"),
    "state of another step": ("rng-60.pt", lambda p: torch.save({"step": 50, "states": {}}, p),
                              "not the generator states of step 60"),
    "state without noise": ("rng-60.pt", lambda p: torch.save({"step": 60, "states": {"x": torch.zeros(3)}}, p),
                            "holds no 'noise' generator state"),
    "state of the wrong size": ("rng-60.pt", lambda p: torch.save(
        {"step": 60, "states": {"noise": torch.zeros(16, dtype=torch.uint8)}}, p), "does not fit"),
    "seeds truncated": (rng.SEEDS_FILE, lambda p: p.write_bytes(p.read_bytes()[:9]), "corrupted"),
    "seeds of another mode": (rng.SEEDS_FILE, lambda p: p.write_text('{"sampling": 1, "noise": 2, "mode": "x"}'),
                              "corrupted"),
}


@pytest.fixture(scope="module")
def crashed_at_60(tmp_path_factory):
    """A secure run's directory as a crash right after its checkpoint at step 60 left it."""
    d = tmp_path_factory.mktemp("crash")
    with pytest.MonkeyPatch.context() as mp:
        _, _, snap, _ = _run_with_snapshot(d, mp)
    return snap


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_private_file_is_refused_not_redrawn(tmp_path, crashed_at_60, capsys, case):
    """A truncated or corrupted secrets / generator-state file stops the resume with one line naming it and how to go
    on (treating it as absent redrew the lost steps without a word), and leaves every file as it was."""
    name, damage, words = DAMAGE[case]
    snap = tmp_path / "run"
    shutil.copytree(crashed_at_60, snap)
    path = snap / rng.PRIVATE_DIR / name
    damage(path)
    before = {p.relative_to(snap): p.read_bytes() for p in snap.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(snap), "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("widedp: warning: data.vocabulary")]
    assert len(lines) == 1 and "Traceback" not in err and "is missing" not in err, err
    err = lines[0]
    assert err.startswith(f"widedp: error: {path}: ") and words in err and "--overwrite" in err, err
    assert "restore it" in err and "charged again" in err
    after = {p.relative_to(snap): p.read_bytes() for p in snap.rglob("*") if p.is_file()}
    assert after == before  # checkpoint, journal, seeds, metrics: nothing lost


def test_api_load_private_refuses_a_damaged_state(tmp_path):
    """``PrivacyEngine.load_private`` on a corrupted generator state names the file (it said 'no generator state
    for step N', as if save_private had been called at another step)."""
    from api_toys import TorchrecMLP, collate_kjt, interactions
    from torch.utils.data import DataLoader

    from widedp.api import PrivacyEngine

    def setup():
        eng = PrivacyEngine(selection={"name": "uniform", "k": 2}, clip1=1.0, clip2=1.0, noise_multiplier=1.0)
        model = TorchrecMLP()
        eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(interactions(20), batch_size=4, collate_fn=collate_kjt), epochs=1)
        return eng

    eng = setup()
    eng.save_private(tmp_path)
    path = tmp_path / rng.PRIVATE_DIR / "rng-0.pt"
    _flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(ConfigError, match="rng-0.pt: corrupted"):
        setup().load_private(tmp_path)


def test_every_bit_of_a_seed_matters():
    """torch's CPU generator keeps only the low 32 bits of manual_seed: 2^32 guesses would rebuild a secret stream.
    rng.generator fills its whole state from the 62-bit seed (audit)."""
    s = (1 << 61) + 12345
    twin = s + (1 << 40)  # the same low 32 bits
    plain = [torch.randn(4, generator=torch.Generator().manual_seed(x)) for x in (s, twin)]
    assert torch.equal(*plain)  # why rng.generator exists
    a, b, again = (torch.randn(4, generator=rng.generator(x)) for x in (s, twin, s))
    assert not torch.equal(a, b) and torch.equal(a, again)
    from widedp.dp.sampling import PoissonSampler  # every generator that protects data is seeded this way

    batches = [PoissonSampler(1000, sampling_rate=0.05, seed=x).batch(0) for x in (s, twin)]
    assert not torch.equal(*batches)


def test_a_changed_cpu_generator_layout_is_refused(monkeypatch):
    monkeypatch.setattr(rng, "_MT_STATE_BYTES", 5000)
    with pytest.raises(RuntimeError, match="cannot seed it with all"):
        rng.generator(7)


def test_secure_rng_key_is_an_error(tmp_path):
    cfg = _config(tmp_path)
    text = cfg.read_text().replace("  selection:", "  secure_rng: true\n  selection:")
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="dp.secure_rng"):
        load_config(cfg)


def test_release_holds_weights_vocab_statement_only(tmp_path, capsys):
    run = _train(tmp_path, "a")
    rel = tmp_path / "release"
    assert main(["export", str(run), "--out", str(rel)]) == 0
    assert sorted(p.name for p in rel.iterdir()) == ["privacy.json", "vectors.txt", "vocab.json"]
    st = json.loads((rel / "privacy.json").read_text())
    assert st["private"] and st["unit"] == "(target, context) pair" and st["adjacency"] == "add_remove"
    assert "δ=1e-05" in st["text"] and "(target, context) pair" in st["text"] and "vocabulary" in st["text"]
    assert main(["export", str(run), "--format", "torch", "--out", str(tmp_path / "rel2")]) == 0
    state = torch.load(tmp_path / "rel2" / "model.pt", weights_only=True)
    assert set(state) == set(_weights(run))  # weights only: no optimizer, history, ledger
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.txt").write_text("x")
    assert main(["export", str(run), "--out", str(tmp_path / "busy")]) == 2  # never mixes with other files


def test_metrics_are_labelled_and_hold_no_noise_statistic(tmp_path):
    run = _train(tmp_path, "a")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["kind"] == "notice" and "NON-PRIVATE" in recs[0]["text"]
    assert not any("noise_norm" in r for r in recs)
    summary = json.loads((run / "summary.json").read_text())
    assert "NON-PRIVATE" in summary["notice"]
    last_epoch = [r for r in recs if r["kind"] == "epoch"][-1]
    # the per-epoch ε is the headline accountant's, as in the summary; RDP under its own name
    assert last_epoch["epsilon_accountant"] == "pld"
    assert last_epoch["epsilon"] == pytest.approx(summary["dp"]["epsilon"])
    assert last_epoch["epsilon_rdp"] == pytest.approx(summary["dp"]["epsilon_rdp"])


def test_pruning_removes_the_temp_files_of_a_kill_mid_write(tmp_path):
    """A kill between ``_write_private``'s open and its rename leaves ``.NAME.HEX.tmp``: the next prune of that
    rank deletes it (another rank's, and other files, stay)."""
    g = torch.Generator().manual_seed(1)
    rng.save_states(tmp_path, 9, {"noise": g.get_state()})
    priv = tmp_path / rng.PRIVATE_DIR
    for name in (".rng-5.pt.bfb40dce.tmp", ".rng-5-rank1.pt.0123abcd.tmp", ".seeds.json.0123abcd.tmp"):
        (priv / name).write_bytes(b"half")
    rng.prune_states(tmp_path, 9)
    assert sorted(p.name for p in priv.iterdir()) == [".rng-5-rank1.pt.0123abcd.tmp", ".seeds.json.0123abcd.tmp",
                                                      "rng-9.pt"]
    rng.prune_states(tmp_path, 9, rank=1)
    assert sorted(p.name for p in priv.iterdir()) == [".seeds.json.0123abcd.tmp", "rng-9.pt"]
