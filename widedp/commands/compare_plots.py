"""``widedp compare``'s ``curves.png``: loss per epoch of every run of a sweep, with ε, δ and the privacy unit.

Without named panels, one panel per run (train and test loss, mean over seeds with a min/max band, like the paper's
Fig. 1). With ``panels: {title: [run, ...]}`` one panel per title overlays its runs (test loss solid, train loss
dashed), e.g. every method at the same target ε.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from widedp.extras import pyplot


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
