"""``widedp compare``'s outputs: ``curves.png`` (loss per epoch of every run of a sweep, with ε, δ and the privacy
unit) and the ``results.md`` table.

Without named panels, one panel per run (train and test loss, mean over seeds with a min/max band, like the paper's
Fig. 1). With ``panels: {title: [run, ...]}`` one panel per title overlays its runs (test loss solid, train loss
dashed), e.g. every method at the same target ε. The table puts a CBOW run's word similarity (``widedp eval``'s
Spearman ρ on WordSim-353 and SimLex-999) beside its losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from widedp.extras import pyplot

PAPER_KEY = "paper_theorem3_reference_NOT_A_BOUND"  # = widedp.accounting.REFERENCE_KEY (not imported: heavy)
#: results.md's word-similarity columns: row key -> header
SIMILARITY = {"wordsim353": "WS353 ρ", "simlex999": "SimLex ρ"}


def privacy_label(summaries: list[dict[str, Any]], *, with_unit: bool = True) -> str:
    """``ε=2.51, δ=1e-05 per (target, context) pair`` (mean ε over seeds), or why the run is not private."""
    privs = [s.get("privacy") if isinstance(s.get("privacy"), dict) else {} for s in summaries]
    eps = [p.get("epsilon") for p in privs if isinstance(p.get("epsilon"), (int, float))]
    p0 = privs[0] if privs else {}
    if not eps:
        return "non-private"
    text = f"ε={sum(eps) / len(eps):.3g}"
    if with_unit:
        text += f", δ={p0.get('delta'):g} per {p0.get('unit', '?')}"
    if not all(p.get("private", True) for p in privs):
        text = "NOT PRIVATE (reproducible rng), nominal " + text
    return text


def _curve(hists: list[list[dict[str, Any]]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(epochs, mean, min, max) over seeds of ``key`` per epoch."""
    per_epoch: dict[int, list[float]] = {}
    for h in hists:
        for rec in h:
            if rec.get(key) is not None:
                per_epoch.setdefault(int(rec["epoch"]), []).append(float(rec[key]))
    ep = sorted(per_epoch)
    return (ep, [sum(per_epoch[e]) / len(per_epoch[e]) for e in ep], [min(per_epoch[e]) for e in ep],
            [max(per_epoch[e]) for e in ep])


def _same(values: list[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def plot_curves(sweep: Any, runs: dict[str, tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]],
                path: Path) -> None:
    """Write ``path`` for ``sweep`` (a ``widedp.commands.compare.Sweep``); ``runs``: each run's name -> (its seeds'
    per-epoch histories, their summaries)."""
    plt = pyplot(f"the sweep's curves ({path.name})")
    if plt is None:
        return
    def runs_of(name: str) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        return runs[name]

    groups = sweep.groups if sweep.groups is not None else tuple((n, (n,)) for n in sweep.panels)
    overlay = sweep.groups is not None
    ncols = min(2 if overlay else 3, len(groups))
    nrows = -(-len(groups) // ncols)
    w, h = (6.0, 4.2) if overlay else (4.2, 3.4)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), dpi=100, sharey=True, squeeze=False)
    for ax, (title, members) in zip(axes.flat, groups):
        sums_all = []
        for i, name in enumerate(members):
            hists, sums = runs_of(name)
            sums_all += sums
            seeds = f"{len(hists)} seed{'s' if len(hists) > 1 else ''}"
            styles = (("test_loss", "-", f"C{i}" if overlay else "tab:orange"),
                      ("train_loss", "--" if overlay else "-", f"C{i}" if overlay else "tab:blue"))
            for key, ls, color in styles:
                ep, mean, lo, hi = _curve(hists, key)
                label = (f"{name}: {privacy_label(sums, with_unit=False)} ({seeds})" if key == "test_loss"
                         else None) if overlay else key.replace("_", " ")
                ax.plot(ep, mean, ls, marker="o", ms=2.5, lw=1.4 if key == "test_loss" else 0.9, color=color,
                        label=label)
                if len(hists) > 1 and (key == "test_loss" or not overlay):  # overlays: a band for test only
                    ax.fill_between(ep, lo, hi, color=color, alpha=0.15, lw=0)
            if not overlay:
                ax.set_title(f"{name} ({seeds})\n{privacy_label(sums)}", fontsize=8.5)
        if overlay:
            privs = [p for p in (s.get("privacy") or {} for s in sums_all) if p.get("epsilon") is not None]
            delta, unit = _same([p.get("delta") for p in privs]), _same([p.get("unit") for p in privs])
            sub = ("non-private" if not privs else f"δ={delta:g} per {unit}" if delta is not None and unit
                   else "δ or unit differ across runs (see results.md)")
            ax.set_title(f"{title}\n{sub}; solid: test loss, dashed: train loss", fontsize=9)
            ax.legend(fontsize=7)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss")
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    if not overlay:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(st: dict[str, float | None] | None, digits: int = 4, pm: bool = True) -> str:
    if st is None or st["mean"] is None:
        return "–"
    m = f"{st['mean']:.{digits}f}"
    return f"{m} ± {st['std']:.{digits}f}" if pm and st["std"] else m


def _similarity_cell(r: dict[str, Any], key: str) -> str:
    """``0.213 ± 0.010 (11% of pairs)``: ρ over seeds and the share of the benchmark's pairs in the vocabulary."""
    share = (r.get(f"{key}_in_vocab") or {}).get("mean")
    return _fmt(r.get(key), 3) + (f" ({share:.0%} of pairs)" if share is not None else "")


def _legend(rec: bool, words: bool) -> str:
    return ("Final losses: mean ± std over seeds. "
            + ("WS353 ρ / SimLex ρ: Spearman's ρ of the CBOW input vectors' cosines with WordSim-353 / SimLex-999 "
               "over the pairs with both words in the vocabulary (that share in brackets; `widedp eval`). "
               if words else "")
            + "ε: the run's accountant (summary dp.epsilon); ε RDP: the RDP accountant. ε lower (audit): `widedp "
            "audit`'s empirical one-run lower bound, where a run directory holds an audit.json. σ: the (calibrated) "
            "noise multiplier. Paper Thm 3: the paper's Theorem 3 for the same steps, shown only to compare with the "
            "paper's reported ε: it is NOT a valid DP bound (it can under-report)."
            + (" NE: normalised entropy (BCE / entropy of the test positive rate)." if rec else ""))


def results_markdown(rows: list[dict[str, Any]], title: str) -> str:
    """``results.md``: one line per run (``widedp.commands.compare.summarize``'s rows), then their statements."""
    rec = any((r.get("test_auc") or {}).get("mean") is not None for r in rows)  # recommenders: AUC, NE
    words = [k for k in SIMILARITY if any(k in r for r in rows)]  # CBOW runs: word similarity
    extra = (["test AUC", "test NE"] if rec else []) + [SIMILARITY[k] for k in words]
    head = ["run", "seeds", "train loss", "valid loss", "test loss", "test acc.", *extra, "ε", "ε RDP",
            "paper Thm 3 (NOT a bound)", "ε lower (audit)", "σ", "steps", "wall s", "samples/s"]
    lines = [f"# {title}", "", _legend(rec, bool(words)), "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        acc = f" ({r['accountant']})" if r["private"] and r["accountant"] else ""
        cells = [r["name"], str(len(r["seeds"])), _fmt(r["train_loss"]), _fmt(r["valid_loss"]), _fmt(r["test_loss"]),
                 _fmt(r["test_accuracy"], 3)]
        cells += [_fmt(r.get("test_auc"), 4), _fmt(r.get("test_ne"), 4)] if rec else []
        cells += [_similarity_cell(r, k) for k in words]
        cells += [f"{_fmt(r['epsilon'], 3)}{acc if r['epsilon'] else ''}", _fmt(r["epsilon_rdp"], 3),
                  _fmt(r.get(PAPER_KEY), 3), _fmt(r.get("epsilon_lower"), 3),
                  _fmt(r["noise_multiplier"], 4, pm=False) if r["private"] else "–", _fmt(r["steps"], 0, pm=False),
                  _fmt(r["wall_s"], 1, pm=False), _fmt(r["samples_per_s"], 0, pm=False)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Privacy statements (each run's first seed: its ε with δ, the unit, the accountant and what it does "
              "not cover):", ""]
    lines += [f"- {r['name']}: {r.get('privacy') or ('not private' if not r['private'] else '–')}" for r in rows]
    return "\n".join(lines) + "\n"
