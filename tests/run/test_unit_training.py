"""Training in privacy units end to end: sentence units with the DP vocabulary, the statement, `widedp
epsilon`, resume, canaries as their own units, a public word list, and the recommender's user unit."""

import json

import numpy as np
import pytest
import torch
from snapshots import train_with_snapshot

import widedp.run.trainers.sparse as sparse_mod
from widedp import accounting
from widedp.accounting.statement import SIZE_NOT_COVERED
from widedp.cli import main
from widedp.config import load_config
from widedp.dp import vocab as vocab_dp
from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError
from widedp.run.train import train
from widedp.tasks.cbow import COUNTED_SPLITS_NOT_COVERED

rng = np.random.default_rng(0)
WORDS = [f"w{i}" for i in range(30)]
TEXT = "\n".join(" ".join(rng.choice(WORDS[: 12 if i % 3 else 30], rng.integers(2, 12))) + ("\n" if i % 25 == 24
                 else "") for i in range(700)) + "\n"


def _config(tmp_path, *, unit="sentence", vocabulary="dp", steps_epochs=2, extra_dp="", cap=4):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
data: {{preset: custom, corpus: "text:{corpus}", vocab_size: 20, remove_stopwords: false, alpha_only: false,
       splits: [2000, 200, 200], cache_dir: "{tmp_path / 'cache'}", privacy_unit: {unit},
       max_samples_per_unit: {cap}, vocabulary: "{vocabulary}",
       vocab_dp: {{noise_multiplier: 2.0, max_words_per_unit: 6}}}}
model: {{dim: 8, tied: false}}
train: {{epochs: {steps_epochs}, batch_size: 20, optimizer: lazy_adam, lr: 0.01, log_every: 10, eval_max_samples: 50,
        checkpoint_every: 20}}
dp:
  clip1: 1.0
  clip2: 1.0
  noise_multiplier: 1.0
  rng: reproducible
  {extra_dp}
  selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}
""")
    return cfg


def test_sentence_units_with_dp_vocabulary_end_to_end(tmp_path, monkeypatch, capsys):
    cfg = load_config(_config(tmp_path))
    seen = []
    orig_step = sparse_mod.dp_step

    def step(g, **kw):
        seen.append((g.batch_size, kw["batch_size"], kw["sampling_rate"]))
        return orig_step(g, **kw)

    monkeypatch.setattr(sparse_mod, "dp_step", step)
    run = tmp_path / "run"
    summary = train(cfg, run, progress=False)
    units = summary["units"]
    n_units = units["n_units"]
    assert units["privacy_unit"] == "sentence" and units["max_samples_per_unit"] == 4
    assert units["samples_dropped_by_cap"] > 0 and n_units < summary["n_train"]
    # the DP step gets one "sample" per drawn unit, at q = b / N_units, b in units
    assert all(b == 20 and q == pytest.approx(20 / n_units) for _, b, q in seen)
    assert np.mean([u for u, _, _ in seen]) == pytest.approx(20, rel=0.3)
    assert summary["steps"] == len(seen) == 2 * round(n_units / 20)
    # the ledger: the vocabulary (once, q = 1) then the steps; the reported eps includes it
    ledger = accounting.Ledger.from_json(summary["dp"]["ledger"])
    first, count = ledger.runs[0]
    assert count == 1 and first.sampling_rate == 1.0 and first.parts[0].noise_multiplier == 2.0
    training_only = accounting.compose_epsilon(ledger.runs[1:], delta=1e-5)
    assert summary["dp"]["epsilon"] > training_only
    text = summary["privacy"]["text"]
    assert "one sentence (≤ 4 pairs)" in text and "includes: the DP vocabulary" in text
    # the vocabulary and the split are covered; the data's size and the counted split sizes are not
    assert summary["privacy"]["not_covered"] == [COUNTED_SPLITS_NOT_COVERED, SIZE_NOT_COVERED]
    # the run's vocabulary is its release; negatives come from its noisy counts
    release = vocab_dp.load_release(run)
    assert json.loads((run / "vocab.json").read_text()) == release.words
    assert "warning" not in capsys.readouterr().err
    # widedp epsilon: the same figure, with the training-only one beside it
    capsys.readouterr()
    assert main(["epsilon", str(tmp_path / "c.yaml")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon"] == pytest.approx(summary["dp"]["epsilon"], rel=0.05)
    assert rep["epsilon_training_only"] < rep["epsilon"] and rep["privacy_unit"] == "sentence"
    # the steps alone at dp.delta (the ledger is read at delta - delta_tau; the joint part is that)
    steps = StepSpend(rep["sampling_rate"], (GaussianSpend(1.0, min(1.0 / 20, 2 * 1.0)), ExponentialSpend(0.5, 4)))
    by_hand = accounting.compose_epsilon([(steps, rep["steps"])], delta=1e-5)
    assert rep["epsilon_training_only"] == pytest.approx(by_hand, rel=1e-9)
    assert by_hand < rep["parts"]["joint"]["pld"]
    assert rep["vocabulary"]["noise_multiplier"] == 2.0 and "sentence (≤ 4 pairs)" in rep["privacy"]


def test_resume_reuses_the_vocabulary_and_counts_it_once(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path, steps_epochs=3))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    before = (snap / vocab_dp.RELEASE_FILE).read_bytes()
    resumed = train(cfg, snap, resume=True, progress=False)
    assert (snap / vocab_dp.RELEASE_FILE).read_bytes() == before  # loaded, not drawn again
    assert resumed["dp"]["ledger"] == full["dp"]["ledger"]  # the vocabulary once, the same steps
    a = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(snap / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a resume that lost the release never draws a second one (nor touches vocab.json)
    vocab = (snap / "vocab.json").read_bytes()
    (snap / vocab_dp.RELEASE_FILE).unlink()
    with pytest.raises(ConfigError, match="vocab_release.json: missing, so the run's DP vocabulary is lost"):
        train(cfg, snap, resume=True, progress=False)
    assert not (snap / vocab_dp.RELEASE_FILE).exists() and (snap / "vocab.json").read_bytes() == vocab


def test_the_vocabulary_is_journaled_before_it_is_drawn(tmp_path, monkeypatch):
    """A run killed right after it wrote its DP vocabulary (before any step or checkpoint) has it in spent.json."""
    import widedp.tasks.cbow as cbow_task

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cbow_task, "prepare_cbow", killed)  # the preparation right after the draw
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(load_config(_config(tmp_path)), run, progress=False)
    assert vocab_dp.load_release(run) is not None and not (run / "checkpoint.pt").exists()
    journal = accounting.Ledger.from_json(json.loads((run / "spent.json").read_text()))
    (first, count), = journal.runs
    assert count == 1 and first.sampling_rate == 1.0 and first.parts[0].noise_multiplier == 2.0


def test_private_top_warns_and_says_so_pair_is_unchanged(tmp_path, capsys, monkeypatch):
    from widedp.tasks import cbow

    monkeypatch.setattr(cbow, "WARNED", set())  # (once per process: an earlier test may have said it)
    cfg = load_config(_config(tmp_path, unit="pair", vocabulary="private_top"))
    summary = train(cfg, tmp_path / "run", progress=False)
    assert "warning: data.vocabulary: private_top" in capsys.readouterr().err
    train(cfg, tmp_path / "run2", progress=False)  # a second run of the process (a sweep, a benchmark): once
    assert "warning: data.vocabulary" not in capsys.readouterr().err
    assert "units" not in summary and summary["privacy"]["unit"] == "(target, context) pair"
    assert "vocabulary not private" in summary["privacy"]["text"]


def test_public_word_list(tmp_path):
    (tmp_path / "words.txt").write_text("".join(f"w{i}\n" for i in range(15)) + "\n")
    cfg = load_config(_config(tmp_path, vocabulary=f"file:{tmp_path / 'words.txt'}"))
    summary = train(cfg, tmp_path / "run", progress=False)
    assert json.loads((tmp_path / "run" / "vocab.json").read_text()) == [f"w{i}" for i in range(15)]
    assert "public word list" in summary["privacy"]["text"] and summary["privacy"]["not_covered"] == [
        COUNTED_SPLITS_NOT_COVERED, SIZE_NOT_COVERED]
    assert len(accounting.Ledger.from_json(summary["dp"]["ledger"]).runs) == 1  # nothing before the steps


def test_config_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="needs data.privacy_unit"):
        load_config(_config(tmp_path, unit="pair"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(_config(tmp_path, vocabulary="file:/no/such/list.txt"))
    with pytest.raises(ConfigError, match="must be below dp.delta"):
        train(load_config(_config(tmp_path, extra_dp="delta: 1.0e-7")), tmp_path / "r1", progress=False)
    with pytest.raises(ConfigError, match=r"^data\.vocab_dp\.sigma: unknown key"):
        load_config(_config(tmp_path), ["data.vocab_dp.sigma=3"])
    with pytest.raises(ConfigError, match=r"^data\.privacy_unit: expected one of pair, sentence, document"):
        load_config(_config(tmp_path), ["data.privacy_unit=word"])
    cfg = _config(tmp_path, vocabulary="private_top", extra_dp="engine: opacus")
    text = cfg.read_text().replace("{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}", "{name: all}")
    cfg.write_text(text)
    assert main(["train", str(cfg), "--out", str(tmp_path / "r2"), "--no-progress"]) == 2
    assert "opacus" in capsys.readouterr().err


def test_default_keys_keep_old_config_hashes(tmp_path):
    import hashlib

    from widedp.config import config_from_dict

    d = load_config(_config(tmp_path, unit="pair", vocabulary="private_top")).to_dict()
    for k in ("privacy_unit", "max_samples_per_unit", "vocabulary", "vocab_dp", "min_count", "negatives_pool"):
        d["data"].pop(k)  # a config written before privacy units (and before data.min_count, data.negatives_pool)
    d["dp"].pop("sampling_rate")  # (and before dp.sampling_rate)
    d["dp"].pop("noise")  # (and before dp.noise)
    d["dp"].pop("allow_large_delta")  # (and before dp.allow_large_delta, never hashed)
    d["dp"].pop("max_batch_size")  # (and before dp.max_batch_size)
    d["model"].pop("init_vectors"), d["model"].pop("init_output")  # (and before model.init_vectors)
    before = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]  # the hash it was recorded with
    cfg = config_from_dict(d)
    assert cfg.data.privacy_unit == "pair" and cfg.hash() == before
    assert load_config(_config(tmp_path)).hash() != before


def test_canaries_are_their_own_units(tmp_path):
    from widedp.eval.canary_runs import train_canary_run

    cfg = load_config(_config(tmp_path, cap=8))
    run = train_canary_run(cfg, tmp_path / "can", label="s", n_c=2, num_canaries=5, seed=1)
    info = json.loads((run / "canaries.json").read_text())
    # a 3-word canary sentence with window 4 gives 3 x 2 ordered pairs, all of them train samples
    assert info["canary_samples"] == 5 * 2 * 6 and info["canary_units"] == "own"
    summary = json.loads((run / "summary.json").read_text())
    words = vocab_dp.load_release(run).words
    assert all(w in words for p in info["canaries"] for w in p)  # canaries drawn from the run's DP vocabulary
    ledger = accounting.Ledger.from_json(summary["dp"]["ledger"])
    assert ledger.runs[0][1] == 1 and ledger.runs[0][0].sampling_rate == 1.0
    # the clean units are those of a run without canaries (same reproducible vocabulary); each insertion adds one
    clean = train(cfg, tmp_path / "clean", progress=False)
    assert clean["units"]["vocabulary"] == summary["units"]["vocabulary"]
    assert summary["units"]["n_units"] == clean["units"]["n_units"] + 10


def test_recommender_user_unit(tmp_path, capsys):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"""
task: recsys
data: {{num_users: 60, num_items: 200, num_interactions: 3000, cache_dir: "{tmp_path / 'cache'}",
       privacy_unit: user, max_samples_per_unit: 16}}
model: {{dim: 4, hidden: [8]}}
train: {{epochs: 1, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 5}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible,
     selection: {{name: exponential, k: 20, epsilon: 0.1, score_clip: 0.05}}}}
""")
    c = load_config(cfg)
    summary = train(c, tmp_path / "run", progress=False)
    from widedp.data_prep.interactions import prepare_interactions

    users = prepare_interactions(c.data).train.features["user"][:, 0]
    _, per_user = np.unique(users, return_counts=True)
    assert summary["units"]["n_units"] == len(per_user)
    assert summary["units"]["samples_dropped_by_cap"] == int(np.maximum(per_user - 16, 0).sum())
    assert "one user (≤ 16 interactions)" in summary["privacy"]["text"]
    assert summary["steps"] == round(len(per_user) / 10)
    assert main(["epsilon", str(cfg)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n_units"] == len(per_user) and rep["sampling_rate"] == pytest.approx(10 / len(per_user))
    assert rep["epsilon"] == pytest.approx(summary["dp"]["epsilon"], rel=1e-6)
