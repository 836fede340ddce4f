// Fused CPU kernels for the DP step (issue 17), registered as torch.ops.widedp.*.
//
// clip_aggregate: per-sample clip at S1 + (1/b) sum over rows: one radix sort of the row ids, then one pass over
//   the samples (norm, then its rows added into ghat); the clipped [nnz, D] values are never materialised.
// lazy_adam_:     the moment and weight update of the selected rows of every table, in place.
// cbow_row_grads: CBOW's per-sample loss and row gradients (coalesced per sample), in two passes over the batch.
//
// The reference semantics are the PyTorch functions widedp/clipping.py (clip_per_sample, aggregate) and
// widedp/optim.py (LazyAdam.step); tests/test_native.py holds the two together. Only ATen and torch/library.h
// are included (no pybind11 / Python headers): the build is one g++ call of ~20 s, and the library is loaded with
// torch.ops.load_library.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// ATen's CPU kernels round like fused multiply-adds (vec::fmadd in index_add_, lerp, addcmul) where the CPU has
// FMA; so do these inner loops, so that their results match the reference's bit for bit. On x86-64 each is built
// twice, for AVX2+FMA and for the baseline, and the loader picks one for the CPU (GCC target_clones); the baseline
// clone calls libm's exact fma. Elsewhere (aarch64) FMA is baseline. -ffp-contract=off: no other fusing.
#if defined(__x86_64__) && defined(__GNUC__)
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOT
#endif
#define ALWAYS_INLINE __attribute__((always_inline)) inline

// max |p[i]| over the finite entries; *bad = 1 if an entry is NaN or inf.
template <typename T>
ALWAYS_INLINE T scan(const T* p, int64_t n, int* bad) {
  T top = 0;
  int b = 0;
#pragma omp simd reduction(max : top) reduction(| : b)
  for (int64_t i = 0; i < n; ++i) {
    const T a = std::abs(p[i]);
    b |= !(a <= std::numeric_limits<T>::max());
    top = a > top ? a : top;
  }
  *bad = b;
  return top;
}

// sum of (p[i] * inv)^2 in double (inv a power of two: the scaling is exact).
template <typename T>
ALWAYS_INLINE double sumsq(const T* p, int64_t n, double inv) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += (double(p[i]) * inv) * (double(p[i]) * inv);
  return s;
}

// o += a * x (kept sample; index_add_'s rounding), or o += a * round(x * w) (clipped sample: x * w in double).
template <typename T>
ALWAYS_INLINE void axpy(T* o, const T* x, T a, double w, int64_t n) {
  if (w == 1.0) {
    for (int64_t d = 0; d < n; ++d) o[d] = std::fma(a, x[d], o[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) o[d] = std::fma(a, T(double(x[d]) * w), o[d]);
  }
}

// One row of LazyAdam.step, op by op as the reference: m.lerp_(g, w1); v.mul_(b2).addcmul_(g, g, value=1 - b2);
// w.index_add_(-lr * (m * c1) / (sqrt(v) * c2 + eps)).
template <typename T>
ALWAYS_INLINE void adam_row(T* w, T* m, T* v, const T* g, int64_t n, T w1, T b2, T vb2, T c1, T c2, T eps, T nlr) {
  const bool small = std::abs(w1) < T(0.5);  // torch.lerp: start + w (end - start), else end - (end - start)(1 - w)
  const T coeff = small ? w1 : w1 - T(1);
  for (int64_t d = 0; d < n; ++d) {
    m[d] = std::fma(coeff, g[d] - m[d], small ? m[d] : g[d]);
    v[d] = std::fma(vb2 * g[d], g[d], v[d] * b2);
    const T denom = std::sqrt(v[d]) * c2 + eps;
    w[d] = std::fma((m[d] * c1) / denom, nlr, w[d]);
  }
}

// The clones: one overload per dtype (target_clones does not take templates).
#define CLONE(T)                                                                                                  \
  HOT T scan_hot(const T* p, int64_t n, int* bad) { return scan(p, n, bad); }                                    \
  HOT double sumsq_hot(const T* p, int64_t n, double inv) { return sumsq(p, n, inv); }                          \
  HOT void axpy_hot(T* o, const T* x, T a, double w, int64_t n) { axpy(o, x, a, w, n); }                       \
  HOT void adam_row_hot(T* w, T* m, T* v, const T* g, int64_t n, T w1, T b2, T vb2, T c1, T c2, T eps, T nlr) { \
    adam_row(w, m, v, g, n, w1, b2, vb2, c1, c2, eps, nlr);                                                      \
  }
CLONE(float)
CLONE(double)
#undef CLONE

// Per-call scratch, kept per thread and only grown: a fresh multi-MB buffer per call costs more in page faults
// than the sums themselves.
struct Scratch {
  std::vector<int64_t> key, key2, idx, idx2, slot, uniq;
  std::vector<double> weight;
};

// slot[i]: the rank of pair i's row among the distinct rows; returns the distinct rows, ascending. A stable LSD
// radix sort of the pairs by row id, digits of <= 12 bits (a 32 KiB count table): 1 pass up to 4096 rows,
// 2 up to 16.7M.
const std::vector<int64_t>& rank_rows(const int64_t* rows, int64_t n, int64_t num_rows, Scratch& s) {
  s.key.assign(rows, rows + n);
  s.key2.resize(n);
  s.idx.resize(n);
  s.idx2.resize(n);
  s.slot.resize(n);
  s.uniq.clear();
  for (int64_t i = 0; i < n; ++i) s.idx[i] = i;
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < num_rows) ++bits;
  const int passes = (bits + 11) / 12;
  const int width = passes ? (bits + passes - 1) / passes : 0;
  std::vector<int64_t> count((int64_t(1) << width) + 1);
  for (int shift = 0; shift < bits; shift += width) {
    const int64_t mask = (int64_t(1) << width) - 1;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[((s.key[i] >> shift) & mask) + 1];
    for (size_t d = 1; d < count.size(); ++d) count[d] += count[d - 1];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = count[(s.key[i] >> shift) & mask]++;
      s.key2[at] = s.key[i];
      s.idx2[at] = s.idx[i];
    }
    s.key.swap(s.key2);
    s.idx.swap(s.idx2);
  }
  for (int64_t p = 0; p < n; ++p) {
    if (p == 0 || s.key[p] != s.key[p - 1]) s.uniq.push_back(s.key[p]);
    s.slot[s.idx[p]] = int64_t(s.uniq.size()) - 1;
  }
  return s.uniq;
}

// A sample's clip weight (clip_per_sample's semantics): 0 if an entry is NaN/inf, 1 if kept, clip1 / ||g_j|| if
// clipped (in double: a clipped value is formed in double and rounded once). Squares are summed in double:
// float32 squares cannot overflow or underflow there, so float32 needs one pass (a NaN/inf entry makes the sum
// non-finite); float64 is summed in units of 2^e, e = ilogb(max |entry|) (a first pass), so that 1e300 entries
// neither overflow nor underflow when squared.
template <typename T>
double sample_weight(const T* p, int64_t n, double clip1, bool* clipped, bool* nonfinite) {
  int bad = 0, e = 0;  // norm = 2^e sqrt(s)
  double s = 0;
  if constexpr (std::is_same_v<T, float>) {
    s = sumsq_hot(p, n, 1.0);
    bad = !std::isfinite(s);
  } else {
    const T top = scan_hot(p, n, &bad);
    if (!bad && top > 0) {
      e = std::ilogb(top);
      if (e > -1000) {  // 2^-e is a finite double
        s = sumsq_hot(p, n, std::ldexp(1.0, -e));
      } else {  // below 2^-1000: divide by 2^e (exact) instead
        const double scale = std::ldexp(1.0, e);
        for (int64_t i = 0; i < n; ++i) s += (double(p[i]) / scale) * (double(p[i]) / scale);
      }
    }
  }
  *nonfinite = bad;
  // The reference decides in T: norm > clip1, a norm that overflows T (inf) counting as clipped.
  *clipped = !bad && T(std::ldexp(std::sqrt(s), e)) > T(clip1);
  return bad ? 0.0 : *clipped ? std::ldexp(clip1 / std::sqrt(s), -e) : 1.0;
}

// ghat[slot[i]] += a * w_j * x_i for every pair i in pair order, as the reference's index_add_ (so the sums agree
// bit for bit where nothing is clipped). One thread: sample by sample, norm then sums, while the sample's values
// are in cache (values are read from memory once). More threads: the norms in parallel over samples, then the sums
// in parallel over column blocks (each thread walks every pair in order over its columns): the same bits.
template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor> clip_aggregate_impl(const Tensor& values, const Tensor& rows,
                                                               const Tensor& offsets, int64_t num_rows,
                                                               double clip1, double alpha) {
  const int64_t B = offsets.numel() - 1, nnz = values.size(0), D = values.size(1);
  const T* x = values.const_data_ptr<T>();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  thread_local Scratch scratch;
  const std::vector<int64_t>& uniq = rank_rows(rows.const_data_ptr<int64_t>(), nnz, num_rows, scratch);
  const int64_t U = uniq.size();
  const int64_t* slot = scratch.slot.data();
  auto touched = at::empty({U}, rows.options());
  std::copy(uniq.begin(), uniq.end(), touched.mutable_data_ptr<int64_t>());
  auto ghat = at::zeros({U, D}, values.options());
  auto clipped_t = at::empty({B}, offsets.options().dtype(at::kBool));
  auto nonfinite_t = at::empty({B}, offsets.options().dtype(at::kBool));
  bool* clipped = clipped_t.mutable_data_ptr<bool>();
  bool* nonfinite = nonfinite_t.mutable_data_ptr<bool>();
  T* out = ghat.mutable_data_ptr<T>();
  const T a = T(alpha);  // the reference's index_add_(alpha=1/b) rounds alpha to T as well
  auto add = [&](int64_t j, double w, int64_t d0, int64_t d1) {
    if (w == 0.0) return;  // a zeroed (non-finite) sample would add +0: nothing
    for (int64_t i = off[j]; i < off[j + 1]; ++i) axpy_hot(out + slot[i] * D + d0, x + i * D + d0, a, w, d1 - d0);
  };
  if (at::get_num_threads() == 1 || at::in_parallel_region() || nnz * D < (1 << 15)) {
    for (int64_t j = 0; j < B; ++j) {
      const int64_t n = (off[j + 1] - off[j]) * D;
      add(j, sample_weight(x + off[j] * D, n, clip1, &clipped[j], &nonfinite[j]), 0, D);
    }
  } else {
    std::vector<double>& weight = scratch.weight;
    weight.resize(B);
    at::parallel_for(0, B, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j)
        weight[j] = sample_weight(x + off[j] * D, (off[j + 1] - off[j]) * D, clip1, &clipped[j], &nonfinite[j]);
    });
    const int64_t blocks = std::min<int64_t>(at::get_num_threads(), (D + 15) / 16), width = (D + blocks - 1) / blocks;
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c)
        for (int64_t j = 0; j < B; ++j) add(j, weight[j], c * width, std::min(D, (c + 1) * width));
    });
  }
  return {touched, ghat, clipped_t, nonfinite_t};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> clip_aggregate(const Tensor& values_, const Tensor& rows_,
                                                          const Tensor& offsets_, int64_t num_rows, double clip1,
                                                          double alpha) {
  TORCH_CHECK(values_.dim() == 2 && rows_.dim() == 1 && offsets_.dim() == 1 && offsets_.numel() >= 1,
              "clip_aggregate: expected values [nnz, D], rows [nnz], offsets [B + 1]");
  TORCH_CHECK(rows_.scalar_type() == at::kLong && offsets_.scalar_type() == at::kLong,
              "clip_aggregate: rows and offsets must be int64");
  TORCH_CHECK(values_.size(0) == rows_.numel(), "clip_aggregate: values and rows disagree on nnz");
  const Tensor values = values_.contiguous(), rows = rows_.contiguous(), offsets = offsets_.contiguous();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t B = offsets.numel() - 1, nnz = rows.numel();
  bool ok = off[0] == 0 && off[B] == nnz;
  for (int64_t j = 0; j < B; ++j) ok = ok && off[j] <= off[j + 1];
  TORCH_CHECK(ok, "clip_aggregate: offsets must be non-decreasing from 0 to nnz");
  const int64_t* r = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < nnz; ++i) ok = ok && r[i] >= 0 && r[i] < num_rows;
  TORCH_CHECK(ok, "clip_aggregate: row ids must lie in [0, num_rows)");
  return AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "clip_aggregate", [&] {
    return clip_aggregate_impl<scalar_t>(values, rows, offsets, num_rows, clip1, alpha);
  });
}

// LazyAdam.step on every table at once: global row ids are routed to table t by bounds[t] <= id < bounds[t + 1]
// (ids outside every table are ignored, as the reference). Same rounding sequence as the reference's op chain:
// lerp for m, v * b2 + (1 - b2) * g * g, w += -lr * (m * c1) / (sqrt(v) * c2 + eps). Rows must be distinct
// (a SparseRows contract): rows are updated in parallel.
template <typename T>
void lazy_adam_impl(at::TensorList weights, at::TensorList moments, at::TensorList steps, at::IntArrayRef bounds,
                    const Tensor& rows, const Tensor& grad, const Tensor& coef, double lr, double b1, double b2,
                    double eps) {
  const int64_t k = rows.numel(), D = grad.size(1), L = coef.defined() ? coef.size(0) : 0;
  const int64_t* r = rows.const_data_ptr<int64_t>();
  const T* g = grad.const_data_ptr<T>();
  const T* c = L ? coef.const_data_ptr<T>() : nullptr;
  const T w1 = T(1 - b1), tb2 = T(b2), vb2 = T(1 - b2), teps = T(eps), nlr = T(-lr);
  at::parallel_for(0, k, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t tab = std::upper_bound(bounds.begin(), bounds.end(), r[i]) - bounds.begin() - 1;
      if (tab < 0 || tab + 1 >= int64_t(bounds.size())) continue;
      const int64_t row = r[i] - bounds[tab];
      int64_t* cnt = steps[tab].mutable_data_ptr<int64_t>() + row;
      const int64_t step = ++*cnt;
      T c1, c2;
      if (c) {
        const int64_t at = std::min(step, L - 1);
        c1 = c[2 * at];
        c2 = c[2 * at + 1];
      } else {
        c1 = T(1 / (1 - std::pow(b1, double(step))));
        c2 = T(1 / std::sqrt(1 - std::pow(b2, double(step))));
      }
      T* w = weights[tab].mutable_data_ptr<T>() + row * D;
      T* m = moments[tab].mutable_data_ptr<T>() + row * 2 * D;
      T* v = m + D;
      adam_row_hot(w, m, m + D, g + i * D, D, w1, tb2, vb2, c1, c2, teps, nlr);
    }
  });
}

void lazy_adam_(at::TensorList weights, at::TensorList moments, at::TensorList steps, at::IntArrayRef bounds,
                const Tensor& rows_, const Tensor& grad_, const std::optional<Tensor>& coef_, double lr, double b1,
                double b2, double eps) {
  const int64_t T_ = weights.size();
  TORCH_CHECK(T_ >= 1 && int64_t(moments.size()) == T_ && int64_t(steps.size()) == T_ &&
                  int64_t(bounds.size()) == T_ + 1,
              "lazy_adam_: expected T weights, moments, steps and T + 1 bounds");
  TORCH_CHECK(grad_.dim() == 2 && rows_.dim() == 1 && grad_.size(0) == rows_.numel() &&
                  rows_.scalar_type() == at::kLong,
              "lazy_adam_: expected rows [k] int64 and grad [k, D]");
  const auto dtype = grad_.scalar_type();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(weights[t].is_contiguous() && moments[t].is_contiguous() && steps[t].is_contiguous() &&
                    weights[t].scalar_type() == dtype && moments[t].scalar_type() == dtype &&
                    steps[t].scalar_type() == at::kLong && weights[t].dim() == 2 &&
                    weights[t].size(1) == grad_.size(1) && moments[t].numel() == 2 * weights[t].numel() &&
                    steps[t].numel() == weights[t].size(0) && bounds[t + 1] - bounds[t] == weights[t].size(0),
                "lazy_adam_: table ", t, " does not match the gradient (contiguous, dtype, shapes, bounds)");
  }
  const Tensor rows = rows_.contiguous(), grad = grad_.contiguous();
  Tensor coef;
  if (coef_.has_value() && coef_->defined()) {
    coef = coef_->contiguous();
    TORCH_CHECK(coef.scalar_type() == dtype && coef.dim() == 2 && coef.size(1) == 2 && coef.size(0) >= 1,
                "lazy_adam_: coef must be [L, 2] of the gradient's dtype");
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "lazy_adam_", [&] {
    lazy_adam_impl<scalar_t>(weights, moments, steps, bounds, rows, grad, coef, lr, b1, b2, eps);
  });
}

// CBOW.per_sample_row_grads (widedp/models/cbow.py is the reference): per-sample loss and row gradients of CBOW
// with negative sampling, each sample's duplicate rows summed (in entry order: context entries, then target and
// negatives), rows ascending within a sample. Pass 1 (parallel over samples): h, the scores, s, dloss/dh and the
// sample's distinct rows; pass 2: offsets; pass 3 (parallel): each distinct row's summed gradient. Dot products
// and sums over rows accumulate in double.
template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor> cbow_row_grads_impl(const Tensor& w_in, const Tensor& w_out,
                                                               const Tensor& context, const Tensor& out_ids,
                                                               int64_t num_rows, int64_t out_shift) {
  const int64_t B = context.size(0), C = context.size(1), L = out_ids.size(1), D = w_in.size(1), E = C + L;
  const T* win = w_in.const_data_ptr<T>();
  const T* wout = w_out.const_data_ptr<T>();
  const int64_t* ctx = context.const_data_ptr<int64_t>();
  const int64_t* out = out_ids.const_data_ptr<int64_t>();
  std::vector<T> h(B * D), gh(B * D), s(B * L), wts(B);
  std::vector<int64_t> ids(B * E), order(B * E), count(B);
  auto loss_t = at::empty({B}, w_in.options());
  T* loss = loss_t.mutable_data_ptr<T>();
  at::parallel_for(0, B, 16, [&](int64_t lo, int64_t hi) {
    std::vector<double> acc(D);
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t* cj = ctx + j * C;
      int64_t m = 0;
      for (int64_t c = 0; c < C; ++c) m += cj[c] >= 0;
      const T w = T(1) / T(std::max<int64_t>(m, 1));  // the reference: mask / count.clamp_min(1), in T
      wts[j] = w;
      T* hj = h.data() + j * D;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t c = 0; c < C; ++c)
        if (cj[c] >= 0)
          for (int64_t d = 0; d < D; ++d) acc[d] += double(w) * double(win[cj[c] * D + d]);
      for (int64_t d = 0; d < D; ++d) hj[d] = T(acc[d]);
      const int64_t* oj = out + j * L;
      double lsum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t l = 0; l < L; ++l) {
        const T* e = wout + oj[l] * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(hj[d]) * double(e[d]);
        const double x = l == 0 ? -dot : dot;  // softplus(sign * score), torch's threshold 20
        lsum += x > 20 ? x : std::log1p(std::exp(x));
        const T sl = T(1.0 / (1.0 + std::exp(-dot)) - (l == 0 ? 1.0 : 0.0));
        s[j * L + l] = sl;
        for (int64_t d = 0; d < D; ++d) acc[d] += double(sl) * double(e[d]);
      }
      loss[j] = T(lsum);
      for (int64_t d = 0; d < D; ++d) gh[j * D + d] = T(acc[d]);
      // entries: context rows (a padded one: the target's output row, zero gradient), then the output rows
      int64_t* id = ids.data() + j * E;
      for (int64_t c = 0; c < C; ++c) id[c] = cj[c] >= 0 ? cj[c] : oj[0] + out_shift;
      for (int64_t l = 0; l < L; ++l) id[C + l] = oj[l] + out_shift;
      int64_t* ord = order.data() + j * E;
      for (int64_t i = 0; i < E; ++i) ord[i] = i;
      std::stable_sort(ord, ord + E, [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      int64_t n = 0;
      for (int64_t i = 0; i < E; ++i) n += i == 0 || id[ord[i]] != id[ord[i - 1]];
      count[j] = n;
    }
  });
  auto offsets_t = at::empty({B + 1}, context.options());
  int64_t* off = offsets_t.mutable_data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t j = 0; j < B; ++j) off[j + 1] = off[j] + count[j];
  const int64_t nnz = off[B];
  auto values_t = at::empty({nnz, D}, w_in.options());
  auto rows_t = at::empty({nnz}, context.options());
  T* val = values_t.mutable_data_ptr<T>();
  int64_t* rows = rows_t.mutable_data_ptr<int64_t>();
  at::parallel_for(0, B, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t* id = ids.data() + j * E;
      const int64_t* ord = order.data() + j * E;
      const int64_t* cj = ctx + j * C;
      int64_t at = off[j] - 1;
      for (int64_t i = 0; i < E; ++i) {
        const int64_t e = ord[i];
        T* o = val + (at + 1) * D;
        if (i == 0 || id[e] != id[ord[i - 1]]) {
          ++at;
          rows[at] = id[e];
          std::fill(o, o + D, T(0));
        } else {
          o = val + at * D;
        }
        if (e < C) {  // context entry: wts * dloss/dh (0 when padded)
          if (cj[e] < 0) continue;
          const T w = wts[j];
          for (int64_t d = 0; d < D; ++d) o[d] += w * gh[j * D + d];
        } else {  // output entry l: s_l * h
          const T sl = s[j * L + (e - C)];
          for (int64_t d = 0; d < D; ++d) o[d] += sl * h[j * D + d];
        }
      }
    }
  });
  (void)num_rows;
  return {loss_t, values_t, rows_t, offsets_t};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> cbow_row_grads(const Tensor& w_in_, const Tensor& w_out_,
                                                          const Tensor& context_, const Tensor& out_ids_,
                                                          int64_t num_rows, int64_t out_shift) {
  TORCH_CHECK(w_in_.dim() == 2 && w_out_.dim() == 2 && w_in_.size(1) == w_out_.size(1) &&
                  w_in_.scalar_type() == w_out_.scalar_type(),
              "cbow_row_grads: expected tables [V, D] of one dtype");
  TORCH_CHECK(context_.dim() == 2 && out_ids_.dim() == 2 && context_.size(0) == out_ids_.size(0) &&
                  out_ids_.size(1) >= 1 && context_.scalar_type() == at::kLong &&
                  out_ids_.scalar_type() == at::kLong,
              "cbow_row_grads: expected context [B, C] and output ids [B, L] int64");
  const Tensor w_in = w_in_.contiguous(), w_out = w_out_.contiguous(), context = context_.contiguous(),
               out_ids = out_ids_.contiguous();
  const int64_t* c = context.const_data_ptr<int64_t>();
  const int64_t* o = out_ids.const_data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0; i < context.numel(); ++i) ok = ok && c[i] < w_in.size(0);
  for (int64_t i = 0; i < out_ids.numel(); ++i) ok = ok && o[i] >= 0 && o[i] < w_out.size(0);
  TORCH_CHECK(ok, "cbow_row_grads: ids out of range");
  return AT_DISPATCH_FLOATING_TYPES(w_in.scalar_type(), "cbow_row_grads", [&] {
    return cbow_row_grads_impl<scalar_t>(w_in, w_out, context, out_ids, num_rows, out_shift);
  });
}

}  // namespace

TORCH_LIBRARY(widedp, m) {
  m.def("clip_aggregate(Tensor values, Tensor rows, Tensor offsets, int num_rows, float clip1, float alpha)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("cbow_row_grads(Tensor w_in, Tensor w_out, Tensor context, Tensor out_ids, int num_rows, int out_shift)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("lazy_adam_(Tensor(a!)[] weights, Tensor(b!)[] moments, Tensor(c!)[] steps, int[] bounds, Tensor rows,"
        " Tensor grad, Tensor? coef, float lr, float beta1, float beta2, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(widedp, CPU, m) {
  m.impl("clip_aggregate", &clip_aggregate);
  m.impl("lazy_adam_", &lazy_adam_);
  m.impl("cbow_row_grads", &cbow_row_grads);
}
