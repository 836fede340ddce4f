"""The sentence/document frontier sweeps (bench/frontier_sentence.py) load as `widedp compare` loads them: every
DP cell at a unit of the corpus with the public vocabulary, a fixed sampling rate and delta = 1e-5 refused above 1/N
(no allow_large_delta), its mechanisms as named."""

from pathlib import Path

import pytest

from widedp.commands.compare import load_sweep

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name,unit,targets", [("frontier_sentence_v10k_eps8.yaml", "sentence", {8.0}),
                                               ("frontier_sentence_v10k.yaml", "sentence", {1.0, 3.0}),
                                               ("frontier_sentence_v10k_seeds.yaml", "sentence", {1.0, 3.0}),
                                               ("frontier_sentence_v1k.yaml", "sentence", {1.0, 3.0, 8.0}),
                                               ("frontier_document_v10k.yaml", "document", {8.0})])
def test_frontier_sentence_sweeps_load(name, unit, targets):
    sweep = load_sweep(CONFIGS / name)
    private = [r.config(0) for r in sweep.runs if r.name != "nonprivate"]
    assert {c.dp.target_epsilon for c in private} == targets
    for c in [r.config(0) for r in sweep.runs]:
        assert c.data.privacy_unit == unit and c.data.vocabulary == "wordfreq"
    for c in private:
        assert c.dp.sampling_rate is not None and c.dp.delta == 1e-5 and not c.dp.allow_large_delta
        assert c.dp.accountant == "pld" and c.dp.calibrate == "noise_multiplier"
    names = {c.dp.selection.name for c in private}
    assert {"all", "gaussian_threshold"} <= names or unit == "document" or "seeds" in name
    for r in sweep.runs:
        sel = r.config(0).dp.selection if r.name != "nonprivate" else None
        if r.name.startswith("public_top"):
            assert sel.name == "public_top" and f"H{sel.rows_per_table}" in r.name
        if r.name.startswith("gt_head"):
            assert sel.name == "gaussian_threshold" and f"H{sel.public_head}" in r.name
