"""The issue-13 configs load: configs/brown_cbow_gaussian_threshold.yaml and the frontier sweeps (every run x seed
validated as `widedp compare` does before training), and the new selection keys round-trip."""

from pathlib import Path

import pytest

from widedp.commands.compare import load_sweep
from widedp.config import config_from_dict, load_config
from widedp.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_gaussian_threshold_config_loads():
    cfg = load_config(CONFIGS / "brown_cbow_gaussian_threshold.yaml")
    sel = cfg.dp.selection
    assert sel.name == "gaussian_threshold" and sel.tau == pytest.approx(sel.sigma * sel.threshold_sigmas)
    assert cfg.dp.calibrate == "noise_multiplier" and cfg.dp.target_epsilon > 0
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["frontier_v1k.yaml", "frontier_v10k.yaml", "frontier_full.yaml",
                                  "frontier_v10k_eps8.yaml", "frontier_full_eps8.yaml"])
def test_frontier_sweeps_load(name):
    sweep = load_sweep(CONFIGS / name)
    mechanisms = {r.name.split("-")[0] for r in sweep.runs}
    targets = {r.config(0).dp.target_epsilon for r in sweep.runs if r.name != "nonprivate"}
    if "eps8" in name:
        assert {"dpsgd", "preselect", "gaussian_threshold", "nonprivate"} <= mechanisms and targets == {8}
    else:
        assert mechanisms == {"dpsgd", "exponential", "exponential_count", "sparse_vector", "uniform",
                              "random_sparsification", "gaussian_threshold", "preselect", "nonprivate"}
        assert targets == {1, 3, 8}
    rows = sweep.runs[0].config(0).data.vocab_size * 2
    for r in sweep.runs:
        pre = r.config(0).dp.preselect if r.name != "nonprivate" else None
        assert (pre is not None) == r.name.startswith("preselect") and (pre is None or pre.rows in (rows // 4,
                                                                                                   rows // 2))
    assert all(r.config(0).dp is None for r in sweep.runs if r.name == "nonprivate")
    assert all(r.config(0).dp.calibrate == "noise_multiplier" for r in sweep.runs if r.name != "nonprivate")


def test_new_selection_keys():
    base = {"dp": {"selection": {"name": "exponential", "k": 5, "score": "count", "score_clip": 100.0}}}
    assert config_from_dict(base).dp.selection.score == "count"
    with pytest.raises(ConfigError, match="score_clip"):
        config_from_dict({"dp": {"selection": {"name": "exponential", "k": 5, "score": "count"}}})  # S0 = 0.1
    sv = config_from_dict({"dp": {"selection": {"name": "sparse_vector", "method": "brute"}}}).dp.selection
    assert sv.method == "brute" and sv.score == "norm"
    with pytest.raises(ConfigError, match="threshold"):
        config_from_dict({"dp": {"selection": {"name": "gaussian_threshold", "threshold": 2.0,
                                               "threshold_sigmas": 1.0}}})


@pytest.mark.parametrize("name,new", [("exponential", "auto"), ("sparse_vector", "sparse")])
def test_renamed_method_fast_is_one_line_naming_the_key_and_new_values(name, new):
    sel = {"name": name, **({"k": 5} if name == "exponential" else {})}
    with pytest.raises(ConfigError) as e:
        config_from_dict({"dp": {"selection": {**sel, "method": "fast"}}})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dp.selection.method:") and new in msg and "brute" in msg
    assert config_from_dict({"dp": {"selection": {**sel, "method": new}}}).dp.selection.method == new
    with pytest.raises(ConfigError, match="dp.selection.method"):
        config_from_dict({"dp": {"selection": {"name": "sparse_vector", "method": "auto"}}})
