"""train.keep_best: a run ends with the weights (and reports the losses) of its lowest-validation-loss epoch."""

import json

import torch
from tiny_corpus import data_section

from widedp.cli import main


def test_keep_best_ends_with_the_best_validation_epoch(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, splits='[300, 300, 100]')}
model: {{dim: 16, tied: false, sparse: false}}
train: {{epochs: 12, batch_size: 10, optimizer: adam, lr: 0.3, keep_best: true, eval_max_samples: 300}}
""")  # a large lr on few samples: the validation loss does not fall monotonically
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    best = min(epochs, key=lambda r: r["valid_loss"])
    assert best["epoch"] != epochs[-1]["epoch"]  # the case this test is about: the last epoch is not the best
    assert summary["kept_epoch"] == best["epoch"]
    assert summary["valid_loss"] == best["valid_loss"] and summary["test_loss"] == best["test_loss"]
    # the saved weights are that epoch's: their validation loss is the best one, not the last one
    from widedp.run.loop import evaluate
    from widedp.run.train import load_run_config
    from widedp.tasks.cbow import SplitTensors, build_cbow

    cfg_obj = load_run_config(out)
    (tmp_path / "scratch").mkdir()
    splits, model = build_cbow(cfg_obj, tmp_path / "scratch", device=torch.device("cpu"))
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["model"])
    assert isinstance(splits["valid"], SplitTensors)
    v = evaluate(model, splits["valid"], batch_size=4096, max_samples=300)
    assert abs(v - best["valid_loss"]) < 1e-6


def test_keep_best_with_dp_is_listed_as_not_covered(tmp_path):
    """Choosing the released epoch by a non-private validation loss is outside ε: the statement says so."""
    from widedp.accounting.statement import KEEP_BEST_NOT_COVERED

    cfg = tmp_path / "c.yaml"
    base = f"""
{data_section(tmp_path, splits='[0.5, 0.25, 0.25]')}
model: {{dim: 4, tied: false}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {{name: all}}}}
"""
    for keep in (True, False):
        cfg.write_text(base + f"train: {{epochs: 2, max_steps: 6, batch_size: 50, optimizer: sgd, lr: 0.1, "
                              f"keep_best: {str(keep).lower()}, eval_max_samples: 50}}\n")
        out = tmp_path / f"run{keep}"
        assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
        privacy = json.loads((out / "summary.json").read_text())["privacy"]
        assert (KEEP_BEST_NOT_COVERED in privacy["not_covered"]) == keep
        assert ("keep_best" in privacy["text"]) == keep

