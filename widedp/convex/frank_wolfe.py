"""Private stochastic Frank-Wolfe with variance reduction on the l1 ball (polyhedral setup; Bassily, Guzman & Nandi,
"Non-Euclidean DP-SCO", Sec. 6, Algorithm 2), for the GLM W: [d, K] flattened (the ball has 2 d K vertices
+-r e_j).

Single pass over the data: every sample is assigned, independently and uniformly at random, to the first batch
with probability ``first_batch_fraction`` and otherwise to one of the T - 1 later batches (so adding a sample changes
one batch; denominators are the public expected sizes b1 = f n and b = (1 - f) n / (T - 1)). With constant step eta
and rho = eta (the paper's choice of the averaging factor):

    grad_1 = (1/b1) sum_{B1} grad(w_1; z)
    grad_t = (1 - rho) (grad_{t-1} + (1/b) sum_{B_t} [grad(w_t; z) - grad(w_{t-1}; z)])
             + rho (1/b) sum_{B_t} grad(w_t; z)
    v_t    = argmin_{v in vertices} <v, grad_t> + noise      (report noisy max over the 2 d K vertices)
    w_{t+1} = (1 - eta) w_t + eta v_t

l_inf sensitivity of grad_t (add/remove; L0 = 1 = sup ||grad||_inf, L1 = 1/4 the l1->l_inf smoothness, D = 2 r the
ball's l1 diameter; see widedp.models.glm):  s_t = max((1 - rho)^(t-1) L0 / b1, ((1 - rho) L1 D eta + rho L0) / b)
(a sample in B_k moves grad_k by at most the second term and later estimates by (1 - rho)^(t-k) times it, the
iterates being fixed by the earlier private outputs). The score of vertex v is -<v, grad_t>, sensitivity r s_t, so
each oracle call is eps0-DP with Lap(2 r s_t / eps0) noise (``noise: laplace``; 2x because +-r e_j's scores move in
opposite directions) or eps0-bounded-range with Gumbel noise of scale 2 r s_t / eps0 (``noise: gumbel``, the
exponential mechanism). eps0 is calibrated so that T oracle calls compose to the target (PLD accountant) instead
of the paper's advanced composition.

Adjacency add/remove of one example z; the size n of the dataset enters only through b1 = f n and b = c n
(c = (1 - f) / (T - 1)), and therefore does NOT matter: grad_t = G_t / n with G_t built from batch SUMS with the
n-free denominators f and c, and s_t = s^_t / n with s^_t n-free, so the oracle's noisy argmax over scores
-+r grad_t with noise scale 2 r s_t / eps0 has exactly the law of the argmax over -+r G_t with scale
2 r s^_t / eps0 (argmax is scale-invariant). The mechanism is thus the n-free one on G_t, whose add/remove
sensitivity is s^_t = n s_t (z's slot is drawn independently of the others' with n-free probabilities, so the
others' batches are unchanged; the iterates are functions of earlier private outputs). The constants L0, L1 need
||x||_inf <= 1 for every example (the data builder's unit L2 / L1 rows; ``glm.check_row_norms`` enforces it) --
they hold for signed features too (see ``widedp.models.glm``).

With ``epsilon0=None`` the oracle is exact (non-private FW; use full batches and step 2/(t+2) for the classical
method via ``frank_wolfe_nonprivate``).
"""

from __future__ import annotations

import math

import torch

from widedp import accounting
from widedp.convex.common import Callback, ConvexResult, gumbel, laplace, step
from widedp.dp.spend import ExponentialSpend
from widedp.models import glm


def l1_ball_oracle(grad: torch.Tensor, *, radius: float, noise_scale: float = 0.0, noise: str = "laplace",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """argmin over the vertices +-radius e_j of <v, grad> (+ noise on the 2 d scores when noise_scale > 0).

    Returns the vertex as a dense tensor shaped like ``grad`` (exactly one nonzero, +-radius).
    """
    if not noise_scale >= 0:  # a negative (or NaN) scale would silently give the exact, noiseless argmax
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    flat = grad.reshape(-1).double()
    scores = torch.cat([-radius * flat, radius * flat])  # vertex +r e_j scores -r g_j; -r e_j scores +r g_j
    if noise_scale > 0:
        if generator is None:
            raise ValueError("a noisy oracle needs a generator")
        if noise == "laplace":
            scores = scores + laplace(scores.shape, noise_scale, generator)
        else:
            scores = scores + noise_scale * gumbel(scores.shape, generator)
    i = int(torch.argmax(scores))
    v = torch.zeros_like(flat)
    v[i % len(flat)] = radius if i < len(flat) else -radius
    return v.reshape(grad.shape).to(grad.dtype)


def _grad_mean(w: torch.Tensor, data: glm.LabeledCSR, denom: float) -> torch.Tensor:
    _, r = glm.residuals(w, data)
    return glm.weighted_grad_sum(data, r) / denom


def vr_update(grad: torch.Tensor, w: torch.Tensor, w_prev: torch.Tensor, batch: glm.LabeledCSR, *, denom: float,
              eta: float) -> torch.Tensor:
    """grad_t from grad_{t-1}: (1 - eta)(grad_{t-1} + mean[g(w_t) - g(w_{t-1})]) + eta mean g(w_t) over ``batch``."""
    g_now = _grad_mean(w, batch, denom)
    return (1.0 - eta) * (grad + g_now - _grad_mean(w_prev, batch, denom)) + eta * g_now


def sensitivities(*, iterations: int, n: int, eta: float, radius: float, first_batch_fraction: float,
                  lipschitz: float = glm.LIPSCHITZ_LINF, smooth: float = glm.SMOOTH_L1) -> list[float]:
    """[T] the l_inf sensitivity s_t of grad_t (see the module docstring); also b1, b are derived from n. The bound
    needs 0 < eta <= 1: the iterates then stay convex combinations inside the ball."""
    if not 0 < eta <= 1:
        raise ValueError(f"Frank-Wolfe's step eta must be in (0, 1], got {eta}")
    b1 = first_batch_fraction * n
    b = (1.0 - first_batch_fraction) * n / max(iterations - 1, 1)
    rho = eta
    later = ((1.0 - rho) * smooth * 2.0 * radius * eta + rho * lipschitz) / b
    return [max((1.0 - rho) ** t * lipschitz / b1, later if t > 0 else 0.0) for t in range(iterations)]


def private_frank_wolfe(data: glm.LabeledCSR, *, epsilon0: float | None, iterations: int, radius: float,
                        eta: float, first_batch_fraction: float, noise: str, generator: torch.Generator,
                        callback: Callback | None = None, log_every: int = 10) -> ConvexResult:
    """Algorithm 2 of the module docstring; each of the T oracle calls is ``epsilon0``-DP (laplace) or
    -bounded-range (gumbel); ``epsilon0=None``: exact oracle. W starts at 0 (the ball's centre)."""
    n, d, k = len(data), data.num_features, data.num_classes
    dtype = data.x.values().dtype
    if epsilon0 is not None:
        glm.check_row_norms(data, p=math.inf)
    T = iterations
    slot = torch.where(torch.rand(n, generator=generator) < first_batch_fraction, torch.zeros(n, dtype=torch.long),
                       1 + torch.randint(0, max(T - 1, 1), (n,), generator=generator))
    order = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot, minlength=T)
    starts = torch.cumsum(counts, 0) - counts
    batches = [order[int(starts[t]):int(starts[t] + counts[t])] for t in range(T)]
    b1 = first_batch_fraction * n
    b = (1.0 - first_batch_fraction) * n / max(T - 1, 1)
    sens = sensitivities(iterations=T, n=n, eta=eta, radius=radius, first_batch_fraction=first_batch_fraction)
    ledger = accounting.Ledger()
    w = torch.zeros(d, k, dtype=dtype)
    w_prev = w
    grad = _grad_mean(w, data.rows(batches[0]), b1)
    for t in range(T):
        if t > 0:
            grad = vr_update(grad, w, w_prev, data.rows(batches[t]), denom=b, eta=eta)
        if epsilon0 is None:
            v = l1_ball_oracle(grad, radius=radius)
        else:
            v = l1_ball_oracle(grad, radius=radius, noise_scale=2.0 * radius * sens[t] / epsilon0, noise=noise,
                               generator=generator)
            ledger.add(step((ExponentialSpend(epsilon0, 1, bounded_range=noise == "gumbel"),)))
        w_prev, w = w, (1.0 - eta) * w + eta * v
        if callback is not None and ((t + 1) % log_every == 0 or t == T - 1):
            callback(t + 1, w, {"sensitivity": sens[t], "l1_norm": float(w.abs().sum())})
    info = {"b1": b1, "b": b, "sensitivity_first": sens[0], "sensitivity_later": sens[-1], "eta": eta,
            "epsilon0": epsilon0, "noise_scale_last": (2.0 * radius * sens[-1] / epsilon0) if epsilon0 else 0.0}
    return ConvexResult(w, ledger, T, info)


def frank_wolfe_nonprivate(data: glm.LabeledCSR, *, iterations: int, radius: float) -> torch.Tensor:
    """Classical full-batch Frank-Wolfe on the l1 ball with step 2/(t+2): W [d, K] (a reference)."""
    w = torch.zeros(data.num_features, data.num_classes, dtype=data.x.values().dtype)
    for t in range(iterations):
        v = l1_ball_oracle(_grad_mean(w, data, len(data)), radius=radius)
        eta = 2.0 / (t + 2.0)
        w = (1.0 - eta) * w + eta * v
    return w


def calibrate_epsilon0(*, iterations: int, target_epsilon: float, delta: float, noise: str,
                       accountant: str = "pld") -> float:
    """eps0 per oracle call such that T full-batch calls spend <= target_epsilon (and >= 99% of it)."""
    br = noise == "gumbel"
    return accounting.calibrate_selection_epsilon(
        lambda e: step((ExponentialSpend(e, 1, bounded_range=br),)), steps=iterations, delta=delta,
        target_epsilon=target_epsilon, accountant=accountant)  # type: ignore[arg-type]


def default_step(iterations: int) -> float:
    return 1.0 / math.sqrt(iterations)
