"""The DP step at embedding-row level (paper Alg. 3; privacy.md §1): per-sample rows in, noisy selected rows out."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from widedp.dp.clipping import restrict
from widedp.dp.layout import RowLayout, SingleProcess
from widedp.dp.noise import GRID_SLACK, sensitivity
from widedp.dp.rowgrads import PerSampleRows, SparseRows
from widedp.dp.selection import SelectionContext, Selector
from widedp.dp.selection.public import with_selector_rows
from widedp.dp.selection.scores import selection_scores
from widedp.dp.spend import DiscreteGaussianSpend, GaussianSpend, StepSpend

#: The default layout: every row on this process.
SINGLE_PROCESS = SingleProcess()


@dataclass(frozen=True)
class StepStats:
    """Diagnostics of one step, kept as 0-dim tensors (no host sync in the step); ``as_floats`` for logging.

    rows_selected: k. touched_share: share of the selected rows the batch touched (always-selected rows count as
    touched; on a layout over several processes, the part of this process's rows: the processes' shares sum to
    the step's). clipped1: fraction of samples clipped at S1. clipped2: was Δ̂ clipped at S2. nonfinite: number of
    samples whose gradient had a NaN or an inf and so contributed zero. Nothing here is computed from the noise: the
    noise's norm together with one released value tells membership apart, so it is neither computed nor
    logged.
    """

    rows_selected: int
    touched_share: Tensor
    clipped1: Tensor
    clipped2: Tensor
    nonfinite: Tensor

    def as_floats(self) -> dict[str, float]:
        return {
            "rows_selected": float(self.rows_selected),
            "touched_share": float(self.touched_share),
            "clipped1": float(self.clipped1),
            "clipped2": float(self.clipped2),
            "nonfinite": float(self.nonfinite),
        }


@dataclass(frozen=True)
class StepResult:
    """grad: the noisy gradient on the selected rows only; selected: [k] their ids; spend: what the step spent."""

    grad: SparseRows
    selected: Tensor
    spend: StepSpend
    stats: StepStats


def dp_step_spend(selector: Selector, *, sampling_rate: float, noise_multiplier: float, clip1: float,
                  clip2: float | None, batch_size: float, noise: str = "gaussian") -> StepSpend:
    """What one ``dp_step`` with these arguments spends, known before it runs: the Gaussian noise at
    Δ₂ = min(S1/b, 2·S2) (``noise: secure``: the discrete Gaussian on a grid, ``DiscreteGaussianSpend``) and
    ``selector.spend()``, on the same Poisson(q) batch (composed jointly by the accountant). The one statement of a
    step's cost, whatever the layout: the step and the privacy plan (``widedp.run.plan``) use it.
    """
    d2 = sensitivity(clip1=clip1, clip2=clip2, batch_size=batch_size)
    part = (DiscreteGaussianSpend(noise_multiplier, d2, GRID_SLACK) if noise == "secure"
            else GaussianSpend(noise_multiplier, d2))
    return StepSpend(sampling_rate, (part, selector.spend()))


def dp_step(
    g: PerSampleRows,
    *,
    batch_size: float,
    sampling_rate: float,
    clip1: float,
    clip2: float | None,
    noise_multiplier: float,
    selector: Selector,
    ctx: SelectionContext,
    generator: torch.Generator,
    always_rows: int | None = None,
    fused: bool | None = None,
    public_rows: Tensor | None = None,
    noise: str = "gaussian",
    layout: RowLayout = SINGLE_PROCESS,
) -> StepResult:
    """One DP step on a Poisson(q) batch of per-sample row gradients (B may be 0).

    clip each sample at S1 (a sample with a NaN or an inf contributes zero) -> ĝ = (1/b) Σ_j (b the expected
    batch size) -> the selector's scores (``selector.score_kind``: u_r = min(||ĝ_r||, S0) with Δu = min(S0, S1/b),
    sample counts, or ℓ2-normalised contribution counts with ℓ2 sensitivity 1; ``widedp.dp.selection.scores``) ->
    select rows M among ALL R rows -> Δ̂ = clip_S2(M ⊙ ĝ) -> + N(0, (σΔ₂)²) on every coordinate of every selected
    row, Δ₂ = min(S1/b, 2·S2). The spend: ``dp_step_spend``. ``g``'s samples may be privacy units (a unit's rows
    merged): every sensitivity is per input sample.

    ``layout`` (``widedp.dp.layout``): where the rows live; ``g`` holds the rows of this process (all of them on
    ``SingleProcess()``, the default; its own row blocks and the replicated rows on ``RowBlocks``). Every option
    below works on every layout unless ``layout.refuses`` it (``widedp.dp.layout.check_options``).

    ``always_rows`` A (default: ``g.always_rows`` when ``g`` carries one, e.g. a recommender's dense MLP stored as
    rows, else 0): the last A rows [R − A, R) are selected every step besides the mechanism's picks, and the
    mechanism ranges over [0, R − A) only. Their inclusion is data-independent, so it spends no selection budget;
    they are still part of each sample's S1 clip, of Δ̂'s S2 clip and get the same N(0, (σΔ₂)²) noise, so Δ₂ and
    the spend are unchanged. A = 0 is exactly the step without this option.

    ``fused``: clip and aggregate in one native pass (C++ on the CPU, Triton on CUDA: ``clipping.clip_aggregate``;
    None: when available; one process only).

    ``public_rows`` [P] sorted unique selectable ids chosen without looking at the batch (``data.negatives_pool``'s
    pool): selected this step besides the mechanism's picks, for free (their inclusion does not depend on the
    batch), with the same clip and noise; the scores see only the other rows (a sample's contribution is
    normalised over its non-public rows), as if the public ones were untouched. None = no public rows. A selector
    with a public head (``selector.public_rows``: ``public_top``, ``gaussian_threshold``'s ``public_head``) adds
    its head to them.

    ``noise``: ``gaussian`` (Δ̂ + torch's N(0, (σΔ₂)²) draws) | ``secure`` (``widedp.dp.noise.snapped_release``: Δ̂
    rounded onto a power-of-two grid plus discrete Gaussian noise of the same std, exact multiples of the grid, one
    grid for the whole release over every process; charged as ``DiscreteGaussianSpend``). Unselected rows are
    untouched either way.

    Returns the ``StepResult``: ``grad`` holds the rows this process releases (global ids: ``layout.local`` maps
    them to its own row space), ``selected`` every selected row (the same on every process).
    """
    n_always = getattr(g, "always_rows", 0) if always_rows is None else always_rows
    selectable = g.num_rows - n_always
    # [U], [U, D], finite; the always-selected rows count as touched, so the selectable ones are the first U − A
    touched, ghat, clip = layout.clip_aggregate(g, clip1=clip1, batch_size=batch_size, fused=fused,
                                                always_from=selectable if n_always else None)
    u = touched.numel() - n_always
    selected = _select(g, touched[:u], ghat[:u], selector=selector, ctx=ctx, generator=generator, layout=layout,
                       selectable=selectable, public_rows=public_rows, clip1=clip1, batch_size=batch_size)
    always = torch.arange(selectable, g.num_rows, device=selected.device)
    mine = torch.cat([layout.own(selected), always]) if n_always else layout.own(selected)
    selected = torch.cat([selected, always]) if n_always else selected

    delta, hit = restrict(touched, ghat, mine)  # [k', D]; zeros on selected rows the batch did not touch
    delta, clipped2 = layout.clip_l2(delta, clip=clip2, replicated=n_always)
    d2 = sensitivity(clip1=clip1, clip2=clip2, batch_size=batch_size)
    released = layout.release(delta, replicated=n_always, std=noise_multiplier * d2, sensitivity=d2, noise=noise,
                              generator=generator, released_dim=selected.numel() * ghat.shape[1])

    k, b = selected.numel(), g.batch_size
    stats = StepStats(
        rows_selected=k,
        touched_share=hit.sum() / max(k, 1),
        clipped1=clip.clipped.sum() / max(b, 1),
        clipped2=clipped2,
        nonfinite=clip.nonfinite.sum(),
    )
    spend = dp_step_spend(selector, sampling_rate=sampling_rate, noise_multiplier=noise_multiplier, clip1=clip1,
                          clip2=clip2, batch_size=batch_size, noise=noise)
    return StepResult(SparseRows(mine, released, g.num_rows), selected, spend, stats)


def _select(g: PerSampleRows, touched: Tensor, ghat: Tensor, *, selector: Selector, ctx: SelectionContext,
            generator: torch.Generator, layout: RowLayout, selectable: int, public_rows: Tensor | None,
            clip1: float, batch_size: float) -> Tensor:
    """The selected selectable rows [k] (the mechanism's picks, then the public rows), from the selectable touched
    rows [U] and their ĝ [U, D] (``dp_step``). The selector's own public rows (a public head) join ``public_rows``."""
    public_rows = with_selector_rows(selector, public_rows, selectable_rows=selectable, device=touched.device)
    public = public_rows is not None and public_rows.numel() > 0
    if public:
        private = (~torch.isin(touched, public_rows)).nonzero().squeeze(1)  # (one host sync for both)
        touched, ghat = touched.index_select(0, private), ghat.index_select(0, private)
    kind = selector.score_kind
    sample_rows = layout.sample_rows(g, touched) if kind == "contribution" else None
    scores, score_sens = selection_scores(kind, g, touched, ghat, score_clip=selector.score_clip, clip1=clip1,
                                          batch_size=batch_size, sample_rows=sample_rows)
    selected = layout.select(selector, touched, scores, selectable_rows=selectable, score_sensitivity=score_sens,
                             ctx=ctx, generator=generator)
    if public:
        assert public_rows is not None
        selected = torch.cat([selected[~torch.isin(selected, public_rows)], public_rows])
    return selected
