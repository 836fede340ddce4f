"""The Triton kernels behind ``widedp.native.gpu`` (imported only when Triton is installed; ``gpu._kernels``
wraps them in ``triton.jit``)."""

import triton.language as tl


def clip_scatter(x_ptr, slot_ptr, off_ptr, out_ptr, clipped_ptr, nonfinite_ptr, D, CLIP1: tl.constexpr,
                 ALPHA: tl.constexpr, IS64: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    lo = tl.load(off_ptr + j)
    n = (tl.load(off_ptr + j + 1) - lo) * D
    base = x_ptr + lo * D
    k = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, n, BLOCK):
        a = tl.abs(tl.load(base + start + k, mask=start + k < n, other=0.0).to(tl.float64))
        top = tl.maximum(top, tl.where(a == a, a, float("inf")))
    big = tl.max(top, axis=0)
    bad = big == float("inf")
    # 2^e <= big < 2^(e+1): the exponent bits of a float64; a subnormal big gets 2^-1022
    scale = (big.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    scale = tl.where(bad, 1.0, tl.where(scale > 0, scale, 2.2250738585072014e-308))
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    if big < float("inf"):
        for start in range(0, n, BLOCK):
            u = tl.load(base + start + k, mask=start + k < n, other=0.0).to(tl.float64) / scale
            acc += u * u
    root = tl.sqrt(tl.sum(acc, axis=0))  # >= 1 unless the sample is zero, empty or non-finite
    norm = scale * root  # may overflow float64 (entries near 1e308): clipped all the same
    if IS64:
        clipped = (big < float("inf")) & (norm > CLIP1)
    else:  # decided in float32, as the reference (a norm that overflows float32 counts as clipped)
        clipped = (big < float("inf")) & (norm.to(tl.float32) > tl.full([], CLIP1, tl.float32))
    # a clipped sample adds (x / scale) * (S1 / root) / b: neither factor overflows where S1 / norm might underflow
    pre = tl.where(clipped, 1.0 / scale, 1.0)
    w = tl.where(bad, 0.0, tl.where(clipped, CLIP1 / tl.where(clipped, root, 1.0), 1.0)) * ALPHA
    tl.store(clipped_ptr + j, clipped)
    tl.store(nonfinite_ptr + j, bad)
    if w != 0.0:
        for start in range(0, n, BLOCK):
            e = start + k
            m = e < n
            x = tl.load(base + e, mask=m, other=0.0)
            s = tl.load(slot_ptr + lo + e // D, mask=m, other=0)
            tl.atomic_add(out_ptr + s * D + e % D, (x.to(tl.float64) * pre * w).to(x.dtype), mask=m)


def lazy_adam(w_ptr, mom_ptr, cnt_ptr, rows_ptr, g_ptr, coef_ptr, first, count, D, L, LR: tl.constexpr,
              B1: tl.constexpr, B2: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i) - first
    if (r >= 0) & (r < count):
        t = tl.load(cnt_ptr + r) + 1
        tl.store(cnt_ptr + r, t)
        at = tl.minimum(t, L - 1)
        c1 = tl.load(coef_ptr + 2 * at)
        c2 = tl.load(coef_ptr + 2 * at + 1)
        for start in range(0, D, BLOCK):
            d = start + tl.arange(0, BLOCK)
            m = d < D
            g = tl.load(g_ptr + i * D + d, mask=m, other=0.0)
            mo = tl.load(mom_ptr + r * 2 * D + d, mask=m, other=0.0)
            v = tl.load(mom_ptr + r * 2 * D + D + d, mask=m, other=0.0)
            mo = mo + (1 - B1) * (g - mo)
            v = v * B2 + (1 - B2) * g * g
            tl.store(mom_ptr + r * 2 * D + d, mo, mask=m)
            tl.store(mom_ptr + r * 2 * D + D + d, v, mask=m)
            x = tl.load(w_ptr + r * D + d, mask=m, other=0.0)
            tl.store(w_ptr + r * D + d, x - LR * (mo * c1) / (tl.sqrt(v) * c2 + EPS), mask=m)
