"""``widedp audit``: the one-run bound's arithmetic against an independent reference, and end to end on tiny data:
a broken mechanism (noise × 0.1, the clip skipped, the selection charged nothing) is caught at a claimed ε ≤ 1, the
correct one is not, a non-private run reaches near the cap. Fixed seeds (public coins: ``coin_seed``), one-sided
95%, m = 400 canaries, about 3 s per run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import stat

import numpy as np
import pytest
import torch
from tiny_corpus import data_section

import widedp.dp.selection.exponential as exponential
import widedp.dp.step as step_mod
from widedp.cli import main
from widedp.config import load_config
from widedp.dp.spend import FreeSpend
from widedp.eval import audit as audit_mod
from widedp.eval import audit_bound as ab

M = 400
EXPONENTIAL = "{name: exponential, k: 60, epsilon: 20, score_clip: 0.001}"


# ----------------------------------------------------------------------------------------- the bound's arithmetic


def _ref_pmf(r: int, eps: float) -> list[float]:
    """Bin(r, e^eps / (1 + e^eps)) pmf from log-gamma terms (no scipy)."""
    lp, lq = -math.log1p(math.exp(-eps)), -math.log1p(math.exp(eps))  # log p, log(1 - p)
    return [math.exp(math.lgamma(r + 1) - math.lgamma(i + 1) - math.lgamma(r - i + 1) + i * lp + (r - i) * lq)
            for i in range(r + 1)]


def _ref_p(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """JAX Privacy's one-run p-value (canary_score_auditor._one_run_p_value), re-derived from the pmf: P[Bin >= v]
    plus 2mδ · max_i P[v - i <= Bin < v] / i."""
    pmf = _ref_pmf(r, eps)
    tail = math.fsum(pmf[v:])
    if delta == 0:
        return tail
    gap, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += pmf[v - i]
        gap = max(gap, acc / i)
    return min(1.0, tail + gap * delta * 2 * m)


def _ref_bound(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """Largest eps with p <= beta, by bisection (the reference's search: brentq there, bisection here)."""
    if _ref_p(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _ref_p(m, r, v, mid, delta) <= beta else (lo, mid)
    return lo


@pytest.mark.parametrize("m,r,v,delta", [(100, 20, 20, 0.0), (100, 20, 17, 0.0), (1000, 50, 44, 1e-5),
                                         (1000, 100, 70, 0.0), (200, 30, 30, 1e-3), (50, 10, 4, 0.0)])
def test_bound_matches_independent_reference(m, r, v, delta):
    got = ab.epsilon_lower_bound(m=m, r=r, v=v, beta=0.05, delta=delta)
    assert got == pytest.approx(_ref_bound(m, r, v, 0.05, delta), abs=1e-5)


def test_cap_is_logit_and_delta_only_lowers_it():
    for r in (10, 100, 1000):
        assert ab.bound_cap(m=r, r=r, beta=0.05) == pytest.approx(ab.logit_cap(r, 0.05), abs=1e-5)
    assert ab.bound_cap(m=1000, r=1000, beta=0.05) == pytest.approx(5.81, abs=0.01)  # ~5.8 for 1,000 guesses
    assert ab.bound_cap(m=1000, r=100, beta=0.05, delta=1e-5) < ab.bound_cap(m=1000, r=100, beta=0.05)


def test_guess_grid_is_fixed_and_union_bounded():
    grid = ab.guess_grid(400)
    assert grid == [(10, 10), (20, 0), (20, 20), (40, 0), (40, 40), (80, 0), (100, 100), (200, 0)]
    coins = np.arange(400) % 2 == 0
    scores = coins.astype(float) + np.linspace(0, 0.1, 400)  # perfect separation
    best, allg = ab.audit(scores, coins, beta=0.05, delta=0.0, grid=grid, generator=torch.Generator().manual_seed(0))
    assert all(g.correct == g.guesses for g in allg)
    assert best.epsilon_lower == pytest.approx(ab.logit_cap(200, 0.05 / len(grid)), abs=1e-4)


# ------------------------------------------------------------------------------------------------- end to end


def _cfg(tmp_path, *, dp: bool = True, sigma: float = 4.0, selection: str = "{name: all}"):
    path = tmp_path / "c.yaml"
    dp_section = f"""dp:
  clip1: 1.0
  clip2: null
  noise_multiplier: {sigma}
  sampling_rate: 0.1
  rng: reproducible
  selection: {selection}
""" if dp else ""
    path.write_text(f"""
{data_section(tmp_path, lines=100, splits='[0.8, 0.1, 0.1]')}
model: {{dim: 16, tied: false}}
train: {{epochs: 10, batch_size: 170, optimizer: sgd, lr: 0.5, log_every: 50, eval_max_samples: 50, threads: 1}}
{dp_section}""")
    return path


def _audit(tmp_path, **kw):
    per_step, scale = kw.pop("per_step", True), kw.pop("scale", None)
    cfg = load_config(str(_cfg(tmp_path, **kw)), [])
    return audit_mod.run_audit(cfg, tmp_path / "run", canaries=M, per_step=per_step, coin_seed=1, plot=False,
                               scale=scale)


def _patch_dp_step(monkeypatch, wrapper) -> None:
    """Replace ``dp_step`` wherever the engines imported it (their modules imported first), by ``wrapper(real)``."""
    import importlib
    import pkgutil
    import sys

    import widedp.run.trainers as engines

    for info in pkgutil.iter_modules(engines.__path__, engines.__name__ + "."):
        with contextlib.suppress(ImportError):  # (an optional dependency: not the engine under test)
            importlib.import_module(info.name)
    real = step_mod.dp_step
    fake = wrapper(real)
    for mod in list(sys.modules.values()):
        if getattr(mod, "dp_step", None) is real:
            monkeypatch.setattr(mod, "dp_step", fake)


def _break(monkeypatch, how: str) -> None:
    """A broken mechanism whose accountant still charges the intended one (the step's spend is the claimed one)."""

    def claimed(res, kw):
        spend = step_mod.dp_step_spend(kw["selector"], sampling_rate=kw["sampling_rate"], clip1=kw["clip1"],
                                       noise_multiplier=kw["noise_multiplier"], clip2=kw["clip2"],
                                       batch_size=kw["batch_size"], noise=kw.get("noise", "gaussian"))
        return dataclasses.replace(res, spend=spend)

    if how == "noise_x0.1":  # the noise std a tenth of what is charged
        _patch_dp_step(monkeypatch, lambda real: lambda g, **kw: claimed(
            real(g, **{**kw, "noise_multiplier": 0.1 * kw["noise_multiplier"]}), kw))
    elif how == "clip_skipped":  # samples clipped at 1e6·S1 (none is), the noise std still σ·S1/b
        _patch_dp_step(monkeypatch, lambda real: lambda g, **kw: claimed(
            real(g, **{**kw, "clip1": 1e6 * kw["clip1"], "noise_multiplier": 1e-6 * kw["noise_multiplier"]}), kw))
    elif how == "selection_free":  # the exponential mechanism charged as a free selection
        monkeypatch.setattr(exponential.ExponentialSelector, "spend", lambda self: FreeSpend("uniform"))


@pytest.mark.parametrize("how", ["noise_x0.1", "clip_skipped", "selection_free"])
def test_broken_mechanism_is_caught(tmp_path, monkeypatch, how, capsys):
    _break(monkeypatch, how)
    # (the canaries' rows at 40·S1: a gradient of ~20·S1, which only the clip keeps at S1)
    rep = _audit(tmp_path, selection=EXPONENTIAL if how == "selection_free" else "{name: all}",
                 scale=40.0 if how == "clip_skipped" else None)
    print(how, audit_mod.format_line(rep))
    assert rep["epsilon"] <= 1.0  # the claim
    assert rep["epsilon_lower"] > rep["epsilon"], rep["scores"]  # refuted at 95%


def test_correct_mechanism_stays_below(tmp_path):
    rep = _audit(tmp_path)
    assert rep["epsilon"] <= 1.0  # (dp.rng: reproducible: the run itself says NOT private)
    for name, s in rep["scores"].items():
        assert s["epsilon_lower"] < rep["epsilon"], (name, s)
    assert rep["included"] == int(audit_mod._load_coins(tmp_path / "run").sum())


def test_nonprivate_run_reaches_near_the_cap(tmp_path):
    rep = _audit(tmp_path, dp=False, per_step=False)
    assert rep["epsilon"] is None and not rep["private"]
    assert rep["epsilon_lower"] >= 0.8 * rep["epsilon_cap"], rep["scores"]  # measured: 199/200 correct, 3.31 of 3.66


def test_cross_check_on_the_same_scores(tmp_path, monkeypatch):
    """The report's bound, recomputed from the run's own scores and coins with the independent reference."""
    _break(monkeypatch, "noise_x0.1")
    rep = _audit(tmp_path)
    priv = tmp_path / "run" / "private"
    coins = np.asarray(json.loads((priv / audit_mod.COINS_FILE).read_text())["coins"], dtype=bool)
    scores = np.asarray(json.loads((priv / audit_mod.SCORES_FILE).read_text())["per_step"])
    assert len(np.unique(scores)) == M  # no ties: the ranking is the plain sort
    order = np.argsort(-scores, kind="stable")
    grid = ab.guess_grid(M)
    bounds = []
    for kp, km in grid:
        v = int(coins[order[:kp]].sum()) + (int((~coins[order[M - km:]]).sum()) if km else 0)
        bounds.append(_ref_bound(M, kp + km, v, 0.05 / len(grid), rep["delta"]))
    assert rep["scores"]["per_step"]["epsilon_lower"] == pytest.approx(max(bounds), abs=1e-4)


def test_cli_writes_counts_not_coins(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    out = tmp_path / "cli"
    assert main(["audit", str(cfg), "--canaries", "50", "--out", str(out), "--no-progress", "--coin-seed", "3"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["m"] == 50 and line["epsilon"] is not None and line["primary"] == "white_box"
    rep = json.loads((out / audit_mod.AUDIT_FILE).read_text())
    assert "coins" in rep and "NOT secret" in rep["coins"] and "privacy" in rep and (out / "audit.png").is_file()
    assert not any(isinstance(v, list) and len(v) == 50 for v in rep.values())  # no per-canary list
    mode = os.stat(out / "private" / audit_mod.COINS_FILE).st_mode
    assert stat.S_IMODE(mode) == 0o600


@pytest.mark.parametrize("args,needle", [
    (["--canaries", "1"], "--canaries"), (["--confidence", "1.5"], "--confidence"),
    (["--canary-scale", "-1"], "--canary-scale"), (["--per-step", "--set", "dp=null"], "--per-step"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, needle):
    cfg = _cfg(tmp_path)
    assert main(["audit", str(cfg), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_secret_coins_are_fair_bits():
    coins = audit_mod.draw_coins(4000)
    assert coins.dtype == bool and 0.45 < coins.mean() < 0.55


def test_compare_shows_the_audit_column(tmp_path):
    from widedp.commands.compare import load_sweep, results_markdown, run_dir, summarize

    (tmp_path / "base.yaml").write_text("data: {preset: paper}\ntrain: {epochs: 1}\n")
    (tmp_path / "sweep.yaml").write_text("runs: [{name: a, config: base.yaml}, {name: b, config: base.yaml}]\n")
    sweep, out = load_sweep(tmp_path / "sweep.yaml"), tmp_path / "out"
    for name in ("a", "b"):
        d = run_dir(out, name, 0)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"train_loss": 1.0, "private": True, "steps": 1,
                                                    "dp": {"epsilon": 8.0, "delta": 1e-5, "accountant": "pld"}}))
    (run_dir(out, "a", 0) / audit_mod.AUDIT_FILE).write_text(json.dumps({"epsilon_lower": 2.731}))
    a, b = summarize(sweep, out)
    assert a["epsilon_lower"]["mean"] == 2.731 and b["epsilon_lower"]["mean"] is None
    md = results_markdown([a, b], "t")
    assert "ε lower (audit)" in md and "| 2.731 |" in md


def test_lower_bound_for_any_trainer():
    """The Python entry point a make_private user calls with their own canaries' scores and coins."""
    gen = torch.Generator().manual_seed(5)
    coins = (torch.rand(1000, generator=gen) < 0.5).numpy()
    scores = torch.randn(1000, generator=gen).numpy() + 3.0 * coins  # a strong attack
    res = ab.lower_bound(scores, coins, delta=1e-5)
    assert 1.0 < res["epsilon_lower"] <= res["epsilon_cap"] and res["correct"] <= res["guesses"]
    null = ab.lower_bound(torch.randn(1000, generator=gen).numpy(), coins, delta=1e-5)  # no signal
    assert null["epsilon_lower"] < 0.5


@pytest.mark.parametrize("broken", [False, True])
def test_sentence_unit(tmp_path, monkeypatch, broken):
    """Canaries as two-word sentences (units of two samples, clipped together): noise × 0.1 caught, the correct
    mechanism not."""
    if broken:
        _break(monkeypatch, "noise_x0.1")
    cfg = load_config(str(_cfg(tmp_path)), ["data.privacy_unit=sentence", "train.batch_size=20"])
    rep = audit_mod.run_audit(cfg, tmp_path / "run", canaries=M, per_step=True, coin_seed=1, plot=False)
    assert rep["epsilon"] <= 1.0 and rep["canary"]["unit"] == "sentence"
    print("sentence", "broken" if broken else "correct", audit_mod.format_line(rep))
    assert (rep["epsilon_lower"] > rep["epsilon"]) == broken, rep["scores"]


def test_canaries_have_own_rows_and_the_table_ignores_the_coins():
    from widedp.data_prep.cbow import CBOWData, Split
    from widedp.eval.audit_canaries import init_canary_rows, make_canaries, with_canaries
    from widedp.models.cbow import CBOW

    def split(n: int, units: bool) -> Split:
        ids = np.arange(n) % 5
        extra = (ids, np.zeros(n, dtype=np.int64), np.arange(n)) if units else ()
        return Split(ids, (ids[:, None] + 1) % 5, np.zeros((n, 2), dtype=np.int64), *extra)

    data = CBOWData([f"w{i}" for i in range(5)], np.array([5, 4, 3, 2, 1]), split(8, True), split(2, False),
                    split(2, False), total_samples=12)
    cs = make_canaries(data, m=6, unit="sentence", context_width=1, negatives=2,
                       generator=torch.Generator().manual_seed(0))
    assert cs.target.tolist()[:4] == [5, 6, 7, 8] and cs.owner.tolist()[:4] == [0, 0, 1, 1]
    assert (cs.negatives < 5).all()  # negatives are clean words: no canary row is shared
    for coins in (np.ones(6, bool), np.zeros(6, bool), np.arange(6) % 2 == 0):
        d = with_canaries(data, cs, coins)
        assert len(d.vocab) == 17 and len(d.counts) == 17  # V + 2m, whatever the coins
        assert len(d.train) == 8 + 2 * int(coins.sum()) and len(d.valid) == 2
        new = d.train.sentence[8:]
        assert len(set(new.tolist())) == int(coins.sum()) and (new > d.train.sentence[:8].max()).all()
    model = CBOW(17, 8, tied=False, generator=torch.Generator().manual_seed(0))
    init_canary_rows(model, cs, scale=4.0, generator=torch.Generator().manual_seed(1))
    own = cs.own_rows(model)  # [m, 4]: in[a], in[b], out[a], out[b]
    assert own.shape == (6, 4) and own[0].tolist() == [5, 6, 22, 23]
    w = torch.cat([model.input.weight, model.output.weight]).detach()
    rows = w[own[0]]
    assert torch.allclose(rows.norm(dim=1), torch.tensor([0.4, 0.4, 4.0, 4.0]), atol=1e-5)
    assert abs(float(rows[2] @ rows[1])) < 1e-5 and abs(float(rows[3] @ rows[0])) < 1e-5  # out[a]·in[b] = 0
