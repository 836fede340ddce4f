"""The paper's Theorem 3 cannot drive a run (config refusal) and ``widedp epsilon`` prints clean JSON with the
paper's figure as a labelled reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from widedp.cli import main
from widedp.config import DPConfig, UniformSelectionConfig, load_config
from widedp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
KEY = "paper_theorem3_reference_NOT_A_BOUND"


def test_config_refuses_paper_accountant_with_reason(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dp: {accountant: paper, selection: {name: uniform, k: 5}}\n")
    for load in (lambda: load_config(cfg),
                 lambda: load_config("configs/brown_cbow_sparse_exp.yaml", ["dp.accountant=paper"]),
                 lambda: DPConfig(accountant="paper", selection=UniformSelectionConfig(k=5))):
        with pytest.raises(ConfigError) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("dp.accountant: paper")
        assert "not a valid DP bound" in msg and KEY in msg and "widedp epsilon" in msg
    for ok in ("pld", "rdp"):
        assert load_config("configs/brown_cbow_sparse_exp.yaml", [f"dp.accountant={ok}"]).dp.accountant == ok


def test_cli_refuses_paper_accountant_in_one_line(capsys):
    for cmd in ("epsilon", "train"):
        rc = main([cmd, "configs/brown_cbow_dpsgd.yaml", "--set", "dp.accountant=paper"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "dp.accountant" in err and KEY in err


def test_epsilon_command_prints_clean_json_with_labelled_reference():
    env = {**os.environ, "PYTHONWARNINGS": "default", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "widedp.cli", "epsilon", "configs/brown_cbow_sparse_exp.yaml"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no "file.py:NN: PaperAccountantWarning: ..." (or any other) line
    rep = json.loads(proc.stdout)  # the whole stdout is one JSON document
    assert rep["accountant"] == "pld" and rep["epsilon"] == rep["epsilon_pld"]
    ref = rep[KEY]
    assert set(ref) == {"epsilon", "delta", "note"} and ref["epsilon"] > 0 and "NOT a valid DP bound" in ref["note"]
    assert not any(k.startswith("epsilon_paper") for k in rep)  # the figure appears only under its label


def test_epsilon_command_headline_follows_the_configs_accountant(capsys):
    assert main(["epsilon", "configs/brown_cbow_dpsgd.yaml", "--set", "dp.accountant=rdp"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["accountant"] == "rdp" and rep["epsilon"] == rep["epsilon_rdp"] > rep["epsilon_pld"]
    assert "RDP accountant" in rep["privacy"]
