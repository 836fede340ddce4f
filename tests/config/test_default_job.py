"""The default job (Makefile CONFIG, README's first run): private end to end at the unit of a sentence, with the
public vocabulary, delta below 1/N, and the sigma and epsilon README prints (the calibration, without training)."""

import re
from pathlib import Path

import pytest

from widedp import accounting
from widedp.config import load_config
from widedp.dp.selection import make_selector
from widedp.dp.step import dp_step_spend

ROOT = Path(__file__).resolve().parents[2]
N_SENTENCES = 34_544  # sentences with a train pair (paper preset, wordfreq's first 1,000 words), measured


def default_config() -> Path:
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("CONFIG ?="))
    return ROOT / line.split("=", 1)[1].strip()


def test_default_job_is_sentence_level_with_the_public_vocabulary():
    path = default_config()
    assert path.name == "brown_cbow_sentence_wordfreq.yaml"
    cfg = load_config(path)
    assert cfg.data.privacy_unit == "sentence" and cfg.data.vocabulary == "wordfreq"
    assert cfg.dp is not None and cfg.dp.rng == "secure" and cfg.dp.accountant == "pld"
    assert cfg.dp.sampling_rate is not None  # q fixed: the data's size is covered too
    assert cfg.dp.delta < 1 / N_SENTENCES and not cfg.dp.allow_large_delta
    assert cfg.dp.selection.name == "all" and cfg.dp.target_epsilon == 8.0
    assert f"runs/{path.stem}/" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_default_job_sigma_and_epsilon_as_readme_prints_them():
    cfg = load_config(default_config())
    dp, train = cfg.dp, cfg.train
    steps = train.epochs * round(1 / dp.sampling_rate)
    assert steps == 680

    def step(sigma: float):
        return dp_step_spend(make_selector(dp.selection, num_rows=2 * cfg.data.vocab_size),
                             sampling_rate=dp.sampling_rate, noise_multiplier=sigma, clip1=dp.clip1, clip2=dp.clip2,
                             batch_size=train.batch_size)

    sigma = accounting.calibrate_noise_multiplier(step, steps=steps, delta=dp.delta, target_epsilon=8.0)
    eps = accounting.compose_epsilon([(step(sigma), steps)], delta=dp.delta, accountant="pld")
    assert sigma == pytest.approx(0.7966, abs=1e-3)
    assert eps == pytest.approx(7.957, abs=1e-3)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"\(ε=7\.957, δ=1e-05\) for adding/removing one sentence \(≤ 32 pairs\)", readme)
