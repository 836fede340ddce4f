"""Calibration: the noise multiplier or the selection's per-mechanism epsilon that spends a target eps, and the
largest number of steps within a budget.

Both calibrations return a parameter whose eps is <= target and >= (1 - tolerance) * target (default 1%). Search:
a bracket grown geometrically from a start point (for the pld accountant, the cheap rdp answer), then the Illinois
variant of regula falsi on (log x, log eps), which converges superlinearly from both sides.

``prefix``: runs spent before the steps and composed with them (e.g. a one-shot pre-selection of rows,
``[(StepSpend(1.0, ...), 1)]``); the target covers prefix + steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from widedp.accounting.accountant import _check, compose_epsilon, noise_part, selection_part
from widedp.accounting.base import Accountant
from widedp.accounting.parts import costs_of
from widedp.accounting.pld import PLDRangeError
from widedp.accounting.registry import accountant as named
from widedp.dp.spend import StepSpend
from widedp.errors import ConfigError

_MAX_ITER = 60


def _log(v: float) -> float:
    return math.log(v) if v > 0 else -math.inf


Prefix = Sequence[tuple[StepSpend, int]]


def _eps(step: StepSpend, steps: int, delta: float, accountant: str, prefix: Prefix) -> float:
    return compose_epsilon([*prefix, (step, steps)], delta=delta, accountant=accountant)


def _eps_or_inf(step: StepSpend, steps: int, delta: float, accountant: str, prefix: Prefix = ()) -> float:
    try:
        return _eps(step, steps, delta, accountant, prefix)
    except PLDRangeError:  # loss range too wide for a grid: far above any sensible target
        return math.inf


def _illinois_step(lo: float, hi: float, f_lo: float, f_hi: float) -> float:
    """Root of the line through (lo, f_lo), (hi, f_hi), or the midpoint when that is undefined."""
    if math.isfinite(f_lo) and math.isfinite(f_hi) and f_hi != f_lo:
        return lo - f_lo * (hi - lo) / (f_hi - f_lo)
    return 0.5 * (lo + hi)


@dataclass
class _Bracket:
    """An Illinois (modified regula falsi) bracket [lo, hi] with g(lo) good, g(hi) bad: a new point replaces the end
    of its side, and when the same side moves twice in a row the other end's g is halved (no stalled end)."""

    lo: float
    hi: float
    g_lo: float
    g_hi: float
    side: int = 0

    def update(self, x: float, g_x: float, *, good: bool) -> None:
        if good:
            self.lo, self.g_lo = x, g_x
            if self.side == -1:
                self.g_hi /= 2.0
            self.side = -1
        else:
            self.hi, self.g_hi = x, g_x
            if self.side == 1:
                self.g_lo /= 2.0
            self.side = 1


def _solve(
    f: Callable[[float], float],
    target: float,
    *,
    increasing: bool,
    x0: float,
    x_min: float,
    x_max: float,
    tol: float,
    floor: float = 0.0,
) -> float:
    """x in [x_min, x_max] with (1 - tol) target <= f(x) <= target, f monotone; x_max if f(x_max) <= target.

    ``floor`` < target is the limit of f at the cheap end (the other mechanism's eps alone): interpolating
    log(f - floor) instead of log f keeps the secant accurate near it.
    """
    aim = math.log(target * (1.0 - tol / 2.0) - floor)
    sign = 1.0 if increasing else -1.0
    cache: dict[float, float] = {}

    def g(u: float) -> float:  # u = sign * log x, so g is increasing in u; root at g = 0
        x = math.exp(sign * u)
        if x not in cache:
            cache[x] = f(x)
        return _log(cache[x] - floor) - aim

    def done(u: float) -> bool:
        v = cache[math.exp(sign * u)]
        return (1.0 - tol) * target <= v <= target

    u_min, u_max = sorted((sign * math.log(x_min), sign * math.log(x_max)))
    u = min(max(sign * math.log(x0), u_min), u_max)
    step = math.log(1.25)
    g_u = g(u)
    if done(u):
        return math.exp(sign * u)
    if g_u <= 0:  # grow until a bad point
        lo, g_lo = u, g_u
        while True:
            if lo >= u_max:
                return math.exp(sign * lo)
            u = min(lo + step, u_max)
            g_u = g(u)
            if g_u > 0:
                hi, g_hi = u, g_u
                break
            if done(u):
                return math.exp(sign * u)
            lo, g_lo, step = u, g_u, 2 * step
    else:  # shrink until a good point
        hi, g_hi = u, g_u
        while True:
            if hi <= u_min:
                raise ConfigError(
                    f"calibration: no value in [{x_min:g}, {x_max:g}] reaches eps <= {target:g}"
                )
            u = max(hi - step, u_min)
            g_u = g(u)
            if g_u <= 0:
                lo, g_lo = u, g_u
                break
            hi, g_hi, step = u, g_u, 2 * step
    br = _Bracket(lo, hi, g_lo, g_hi)
    for _ in range(_MAX_ITER):
        if done(br.lo) or cache[math.exp(sign * br.lo)] <= target and br.hi - br.lo < 1e-12:
            break
        u = _illinois_step(br.lo, br.hi, br.g_lo, br.g_hi)
        u = min(max(u, br.lo + 1e-3 * (br.hi - br.lo)), br.hi - 1e-3 * (br.hi - br.lo))
        g_u = g(u)
        br.update(u, g_u, good=cache[math.exp(sign * u)] <= target)
    return math.exp(sign * br.lo)


def _resolvable(target: float, acct: Accountant) -> None:
    """A ConfigError naming dp.target_epsilon when ``target`` is above what ``acct`` resolves (``max_epsilon``)."""
    if acct.max_epsilon is not None and target > acct.max_epsilon:
        raise ConfigError(f"dp.target_epsilon: {target:g} is beyond what the {acct.name} accountant resolves (at most "
                          f"{acct.max_epsilon:g}; an epsilon that large bounds nothing, and its privacy-loss grid "
                          "would not fit in memory); lower it, or use dp.accountant: rdp")


def _solve_resolved(f: Callable[[float], float], target: float, *, accountant: str, tol: float,
                    **kw: float | bool) -> float:
    """``_solve``, refusing in one line a result short of the target when points the accountant could not
    resolve (``PLDRangeError``: counted as infinite) stood between it and the target."""
    unresolved: list[float] = []

    def g(x: float) -> float:
        v = f(x)
        if v == math.inf:
            unresolved.append(x)
        return v

    x = _solve(g, target, tol=tol, **kw)  # type: ignore[arg-type]
    reached = f(x)
    if unresolved and reached < (1.0 - tol) * target:
        raise ConfigError(f"dp.target_epsilon: {target:g} is beyond what the {accountant} accountant resolves here "
                          f"(the largest epsilon it could compute was {reached:.4g}); lower it, or use "
                          "dp.accountant: rdp")
    return x


def _rdp_start(solver: Callable[..., float], x_default: float, accountant: str, **kw: object) -> float:
    """Where the search starts: the answer of the accountant's cheaper ``start_from`` (5%), else ``x_default``."""
    start = named(accountant, baselines=True).start_from
    if start is None:
        return x_default
    try:
        return solver(**kw, accountant=start, tolerance=0.05)
    except ConfigError:
        return x_default


def _fixed_part_eps(step: StepSpend, steps: int, delta: float, accountant: str, prefix: Prefix,
                    target: float, what: str, advice: str) -> float:
    """eps of the part calibration holds fixed; a ConfigError when it alone reaches the target (no solution) or
    the target is beyond what the accountant resolves."""
    acct = _check(delta, accountant)
    if not target > 0:
        raise ConfigError(f"dp.target_epsilon: must be > 0, got {target}")
    _resolvable(target, acct)
    eps = _eps(step, steps, delta, accountant, prefix)
    if eps >= target:
        raise ConfigError(f"dp.target_epsilon: {target:g} is infeasible: {what} eps = {eps:.4g} over {steps} steps "
                          f"at delta={delta:g} ({accountant}){' ' if advice[0] != ';' else ''}{advice}")
    return eps


def calibrate_noise_multiplier(make_step: Callable[[float], StepSpend], *, steps: int, delta: float,
                               target_epsilon: float, accountant: str = "pld", tolerance: float = 0.01,
                               prefix: Prefix = ()) -> float:
    """sigma with eps(make_step(sigma), steps) in [(1 - tolerance) target, target] (so eps <= target).

    The selection (everything but the Gaussian parts of ``make_step(sigma)``) is held fixed. Raises ConfigError when
    the selection alone already spends >= target (no sigma can reach it).
    """
    sel_eps = _fixed_part_eps(selection_part(make_step(1.0)), steps, delta, accountant, prefix, target_epsilon,
                              "the selection alone already spends", "even with infinite noise; lower the selection's "
                              "epsilon or raise the target")
    kw = dict(make_step=make_step, steps=steps, delta=delta, target_epsilon=target_epsilon, prefix=prefix)
    x0 = _rdp_start(calibrate_noise_multiplier, 1.0, accountant, **kw)
    return _solve_resolved(
        lambda s: _eps_or_inf(make_step(s), steps, delta, accountant, prefix), target_epsilon, accountant=accountant,
        increasing=False, x0=x0, x_min=1e-3, x_max=1e4, tol=tolerance, floor=sel_eps,
    )


def calibrate_selection_epsilon(make_step: Callable[[float], StepSpend], *, steps: int, delta: float,
                                target_epsilon: float, accountant: str = "pld", tolerance: float = 0.01,
                                max_epsilon: float = 100.0, prefix: Prefix = ()) -> float:
    """Selection epsilon x (e.g. eps'' per pick) with eps(make_step(x), steps) in [(1 - tolerance) target, target],
    sigma held fixed; ``max_epsilon`` when even that stays below the target.

    Raises ConfigError when the noise alone already spends >= target.
    """
    noise_eps = _fixed_part_eps(noise_part(make_step(1.0)), steps, delta, accountant, prefix, target_epsilon,
                                "the Gaussian noise alone already spends", "; raise dp.noise_multiplier or the "
                                "target")
    kw = dict(make_step=make_step, steps=steps, delta=delta, target_epsilon=target_epsilon, max_epsilon=max_epsilon,
              prefix=prefix)
    # Default start 1/(number of selection mechanisms): large totals make wide (slow) PLD grids.
    c = costs_of(make_step(1.0))
    n_mech = sum(n for _, n in c.bounded_range + c.pure) or 1
    x0 = _rdp_start(calibrate_selection_epsilon, min(1.0 / n_mech, max_epsilon), accountant, **kw)
    return _solve_resolved(
        lambda e: _eps_or_inf(make_step(e), steps, delta, accountant, prefix), target_epsilon, accountant=accountant,
        increasing=True, x0=x0, x_min=1e-6, x_max=max_epsilon, tol=tolerance, floor=noise_eps,
    )


def max_steps(
    step: StepSpend, *, delta: float, target_epsilon: float, accountant: str = "pld", limit: int = 10**9,
    prefix: Prefix = (),
) -> int:
    """The largest T <= ``limit`` with eps(prefix + T identical steps) <= target (0 when one step already exceeds
    it)."""
    acct = _check(delta, accountant)
    if not target_epsilon > 0:
        raise ConfigError(f"dp.target_epsilon: must be > 0, got {target_epsilon}")
    _resolvable(target_epsilon, acct)
    cache: dict[int, float] = {}

    def g(t: int) -> float:  # log eps(t) - log target: <= 0 iff t is within budget
        if t not in cache:
            cache[t] = _eps_or_inf(step, t, delta, accountant, prefix)
        return _log(cache[t]) - math.log(target_epsilon)

    if g(1) > 0:
        return 0
    t = 1
    start = acct.start_from
    if start is not None:  # start from the cheaper accountant's answer (usually within a factor of a few)
        t = max(1, max_steps(step, delta=delta, target_epsilon=target_epsilon, accountant=start, limit=limit,
                             prefix=prefix))
    # Bracket lo <= T* < hi, stepping in log T by the local slope of log eps (eps ~ T^p).
    factor = 1.25
    if g(t) <= 0:
        lo = t
        while True:
            if lo >= limit:
                return limit
            t = min(limit, max(lo + 1, int(lo * factor)))
            if g(t) > 0:
                hi = t
                break
            lo, factor = t, factor**2
    else:
        hi = t
        while True:
            t = min(hi - 1, max(1, int(hi / factor)))
            if g(t) <= 0:
                lo = t
                break
            hi, factor = t, factor**2
    br = _Bracket(lo, hi, g(lo), g(hi))
    while br.hi - br.lo > 1:
        if br.hi - br.lo <= 4:
            t = (br.lo + br.hi) // 2
        else:
            u = _illinois_step(math.log(br.lo), math.log(br.hi), br.g_lo, br.g_hi)
            t = min(max(int(round(math.exp(u))), br.lo + 1), br.hi - 1)
        g_t = g(t)
        br.update(t, g_t, good=g_t <= 0)
    return int(br.lo)
