"""Checks a task makes before it spends anything: a CBOW run's ``model.init_vectors`` file is refused before a DP
vocabulary is drawn; the recommender's statement with no user table (``data.user_feature: false``) names no user
id."""

from tiny_corpus import data_section

from widedp.cli import main
from widedp.config import config_from_dict
from widedp.tasks.recsys import RecsysTask


def test_a_missing_vectors_file_is_refused_before_the_dp_vocabulary(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, words=13, extra=", privacy_unit: sentence, max_samples_per_unit: 3, vocabulary: dp, "
                                         "vocab_dp: {noise_multiplier: 2.0, max_words_per_unit: 6}")}
model: {{dim: 8, tied: false, init_vectors: "{tmp_path / 'missing.txt'}"}}
train: {{epochs: 1, max_steps: 5, batch_size: 10, optimizer: lazy_adam, lr: 0.01, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: null, noise_multiplier: 1.0, rng: reproducible, selection: {{name: all}}}}
""")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "model.init_vectors" in capsys.readouterr().err
    assert not (out / "vocab_release.json").exists()  # nothing private drawn for a run that cannot start


def test_interaction_unit_without_a_user_table_names_no_user_ids(tmp_path):
    (tmp_path / "r.csv").write_text("userId,movieId,rating,timestamp\nu1,1,4,10\nu2,2,3,20\n")
    cfg = config_from_dict({"task": "recsys", "data": {"preset": "custom", "source": f"ratings:{tmp_path / 'r.csv'}",
                                                       "cache_dir": "", "user_feature": False}})
    facts = RecsysTask().privacy(cfg)
    assert facts.not_covered and not [g for g in facts.not_covered if "user and item id" in g or "distinct users" in g]
