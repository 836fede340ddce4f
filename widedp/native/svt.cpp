// The sparse vector selector's host scan (widedp/dp/selection/svt.py: scan, the reference), registered as
// torch.ops.widedp.svt_scan. Built with fused.cpp into one library (widedp/native/__init__.py).
//
// The reference finds each segment's first touched row above its threshold with a NumPy pass over the touched rows
// left, O(c·U) per step (~9 ms at U = 5,000, c = 1,024). Here "first row at index >= i with score >= t" costs
// O(64 + log U): a sparse table of maxima over blocks of 64 rows' noisy scores,
//
//   level 0: m0 m1 m2 m3 ...                 (m_b: max over block b)
//   level l: entry b = max(m_b .. m_{b + 2^l - 1}); descend from the top level, skipping runs whose max is < t,
//
// then a scan inside the block found.
//
// The picks are the reference's, bit for bit: the same libm calls in the same order (-ffp-contract=off), the same
// comparisons; tests/native/test_native.py checks them against it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

// P(Lap(0, scale) >= t)
double laplace_tail(double t, double scale) {
  return t >= 0 ? 0.5 * std::exp(-t / scale) : 1.0 - 0.5 * std::exp(t / scale);
}

// failures before the first success of Bernoulli(p) trials, from v uniform on (0, 1] (inversion); may be inf
double geometric_failures(double v, double p) {
  return p >= 1.0 ? 0.0 : std::floor(std::log(v) / std::log1p(-p));
}

// tpos [U] int64 ascending positions of the touched rows in the visiting order; tnoisy [U] float64 their noisy
// scores; tid [U] int64 their ids; thr [c], unif [c] float64 the segments' thresholds and (0, 1] uniforms.
// Returns [<= c] int64: a touched id, or -1 for an untouched answer.
Tensor svt_scan(const Tensor& tpos_t, const Tensor& tnoisy_t, const Tensor& tid_t, const Tensor& thr_t,
                const Tensor& unif_t, int64_t num_rows, double query_scale) {
  for (const Tensor* t : {&tpos_t, &tnoisy_t, &tid_t, &thr_t, &unif_t}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->is_contiguous(), "svt_scan: 1-D contiguous CPU tensors");
  }
  TORCH_CHECK(tpos_t.scalar_type() == at::kLong && tid_t.scalar_type() == at::kLong, "svt_scan: tpos, tid int64");
  TORCH_CHECK(tnoisy_t.scalar_type() == at::kDouble && thr_t.scalar_type() == at::kDouble &&
                  unif_t.scalar_type() == at::kDouble, "svt_scan: tnoisy, thr, unif float64");
  const int64_t u = tpos_t.numel(), c = thr_t.numel(), m = num_rows - u;
  TORCH_CHECK(tnoisy_t.numel() == u && tid_t.numel() == u && unif_t.numel() == c && m >= 0, "svt_scan: sizes");
  const int64_t* tpos = tpos_t.data_ptr<int64_t>();
  const double* tnoisy = tnoisy_t.data_ptr<double>();
  const int64_t* tid = tid_t.data_ptr<int64_t>();
  const double* thr = thr_t.data_ptr<double>();
  const double* unif = unif_t.data_ptr<double>();

  // Blocks of 64 touched rows; levels[l][b] = max of block maxima b .. b + 2^l - 1 (NaN as -inf: a NaN score never
  // passes, as in the reference). O(U/64 · log U) memory: the scan stays O(U + c) in memory, like the reference.
  constexpr int64_t kBlock = 64;
  const int64_t nb = (u + kBlock - 1) / kBlock;
  std::vector<std::vector<double>> levels(1, std::vector<double>(nb, -std::numeric_limits<double>::infinity()));
  for (int64_t k = 0; k < u; ++k) {
    if (tnoisy[k] > levels[0][k / kBlock]) levels[0][k / kBlock] = tnoisy[k];  // (false for NaN)
  }
  for (int64_t len = 2; len <= nb; len *= 2) {
    const std::vector<double>& prev = levels.back();
    std::vector<double> cur(nb - len + 1);
    for (int64_t b = 0; b + len <= nb; ++b) cur[b] = std::max(prev[b], prev[b + len / 2]);
    levels.push_back(std::move(cur));
  }
  auto first_in = [&](int64_t from, int64_t to, double t) {  // first k in [from, to) with tnoisy[k] >= t, else u
    for (int64_t k = from; k < to; ++k) {
      if (tnoisy[k] >= t) return k;
    }
    return u;
  };
  // first index >= i whose score is >= t, else u: the rest of i's block, then the first later block whose maximum
  // is >= t (descending the levels, skipping blocks whose maximum is < t), then inside that block
  auto first_at_least = [&](int64_t i, double t) {
    if (i >= u) return u;
    const int64_t in_block = first_in(i, std::min(u, (i / kBlock + 1) * kBlock), t);
    if (in_block < u) return in_block;
    int64_t b = i / kBlock + 1;
    for (int64_t l = static_cast<int64_t>(levels.size()) - 1; l >= 0; --l) {
      const int64_t len = int64_t{1} << l;
      if (b + len <= nb && !(levels[l][b] >= t)) b += len;
    }
    return b < nb ? first_in(b * kBlock, std::min(u, (b + 1) * kBlock), t) : u;
  };

  std::vector<int64_t> skipped(u);  // untouched positions before each touched one (non-decreasing)
  for (int64_t k = 0; k < u; ++k) skipped[k] = tpos[k] - k;
  std::vector<int64_t> picks;
  int64_t p = 0, i = 0;  // next position to visit; first touched row (in visiting order) at a position >= p
  for (int64_t j = 0; j < c; ++j) {
    const double t = thr[j];
    const int64_t a = first_at_least(i, t);
    const int64_t x_touched = a < u ? tpos[a] : num_rows;
    int64_t x_untouched = num_rows;
    const double p0 = laplace_tail(t, query_scale);
    if (m > 0 && p0 > 0) {
      // untouched rank (0-based) of the first passing untouched row at a position >= p
      const double k = static_cast<double>(p - i) + geometric_failures(unif[j], p0);
      if (k < static_cast<double>(m)) {
        const int64_t kk = static_cast<int64_t>(k);
        x_untouched = kk + (std::upper_bound(skipped.begin(), skipped.end(), kk) - skipped.begin());
      }
    }
    if (x_touched == num_rows && x_untouched == num_rows) break;  // the scan reached the end of the order
    if (x_touched < x_untouched) {
      picks.push_back(tid[a]);
      p = x_touched + 1;
    } else {
      picks.push_back(-1);
      p = x_untouched + 1;
    }
    i = std::lower_bound(tpos, tpos + u, p) - tpos;
  }
  Tensor out = at::empty({static_cast<int64_t>(picks.size())}, at::kLong);
  std::copy(picks.begin(), picks.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widedp, m) {
  m.def("svt_scan(Tensor tpos, Tensor tnoisy, Tensor tid, Tensor thr, Tensor unif, int num_rows, float query_scale)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(widedp, CPU, m) { m.impl("svt_scan", &svt_scan); }
