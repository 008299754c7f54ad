// C++ CPU kernels of the decode step: the ops of `kernels/triton_ops.py` with the same contracts (read the docstrings
// of `kernels/torch_backend.py` for the shapes), one call each, registered as `flexicache_cpu::<name>`.
// `kernels/native_ops.py` builds this file on first use, checks the arguments and registers the fakes.
//
// Numerics follow the Triton kernels: fp32 accumulation, a token's logit summed over the channels in one order
// whatever its company, choices among equal values taking the lower place, writes equal to the backend's bit for bit.

// Per-operator headers, not <ATen/ATen.h>: the first build, which a user waits for, takes ~15 s instead of ~19.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// A float tensor's elements as fp32 whatever its dtype (for the small inputs: queries, biases), its data pointer and
// dtype looked up once (a tensor's own accessors check more than an inner loop can afford).
struct Floats {
  const void* data;
  at::ScalarType type;
  explicit Floats(const at::Tensor& t) : data(t.const_data_ptr()), type(t.scalar_type()) {
    TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
                "flexicache_cpu: fp32, fp16 or bf16 expected, got ", type);
  }
  float operator[](int64_t offset) const {
    switch (type) {
      case at::kFloat: return static_cast<const float*>(data)[offset];
      case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(data)[offset]);
      default: return static_cast<float>(static_cast<const at::BFloat16*>(data)[offset]);
    }
  }
};

// max that propagates NaN, as torch.amax / torch.maximum.
inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
inline float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }

// exp in fp32 without a library call, so the loops around it vectorise: 2^n times a degree-6 polynomial of the rest
// (Cephes' expf coefficients, within about 2 ulp of std::exp); exp(-inf) = 0, exp(+inf) = inf, NaN stays NaN. Below
// -87.3 (where fp32 turns subnormal) it gives 0: a softmax term that small is below fp32's rounding of its sum.
inline float fast_exp(float x) {
  const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float y = p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x != x ? x : (x < -87.3f ? 0.0f : (x > 88.7f ? kPosInf : y));
}

// A float as an int32 in the floats' order (NaN, of either sign, above +inf, as torch.topk takes it), as the Triton
// kernels' `_top_places`.
inline int32_t order_key(float x) {
  if (x != x) return std::numeric_limits<int32_t>::max();
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// `taken[i]`: the `count` largest of `keys` (of equal ones the first), as `_top_places`.
void top_places(const std::vector<int32_t>& keys, int64_t count, std::vector<char>& taken) {
  const int64_t n = static_cast<int64_t>(keys.size());
  taken.assign(n, 0);
  if (count <= 0) return;
  std::vector<int32_t> sorted(keys);
  std::nth_element(sorted.begin(), sorted.begin() + (count - 1), sorted.end(), std::greater<int32_t>());
  const int32_t cut = sorted[count - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += keys[i] > cut;
  int64_t equal_left = count - above;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] > cut) {
      taken[i] = 1;
    } else if (keys[i] == cut && equal_left > 0) {
      taken[i] = 1;
      --equal_left;
    }
  }
}

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// `len` elements from `src` to `dst`, each at its own stride (a token's channels from one tier into another).
template <typename T>
inline void copy_row(const T* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t len) {
  for (int64_t c = 0; c < len; ++c) dst[c * dst_stride] = src[c * src_stride];
}

// `q . k` over d channels in 16 partial sums (channel e into sum e % 16, in channel order), added in one fixed tree:
// the same number whatever the stride or the token's company, and vectorisable where the channels are contiguous.
template <typename T>
inline float dot16(const float* q, const T* k, int64_t stride, int64_t d) {
  float part[16] = {0.0f};
  int64_t e = 0;
  if (stride == 1) {
    for (; e + 16 <= d; e += 16)
      for (int l = 0; l < 16; ++l) part[l] += q[e + l] * as_float(k[e + l]);
  }
  for (; e < d; ++e) part[e % 16] += q[e] * as_float(k[e * stride]);
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0];
}

// ------------------------------------------------------------------------------------------------------------------
// Page scores: the Quest bound `relu(q) . kmax + min(q, 0) . kmin + bias` in fp32, max over the group, then over each
// page's S entries.
// ------------------------------------------------------------------------------------------------------------------
at::Tensor page_scores(const at::Tensor& query, at::TensorList meta, const at::Tensor& bias, int64_t subpages) {
  // `meta`: row blocks (views of the MinMax cache, read in place) whose rows stack to the query's.
  const int64_t n = query.size(0), g = query.size(1), d = query.size(2), e = meta[0].size(2);
  const int64_t pages = e / subpages;
  auto out = at::empty({n, pages}, query.options().dtype(at::kFloat));
  if (n == 0 || pages == 0) return out;
  std::vector<std::pair<int64_t, int64_t>> where;  // each row's block and its row in it
  for (int64_t b = 0; b < static_cast<int64_t>(meta.size()); ++b) {
    TORCH_CHECK(meta[b].scalar_type() == meta[0].scalar_type(), "page_scores: the MinMax blocks in one dtype");
    for (int64_t i = 0; i < meta[b].size(0); ++i) where.emplace_back(b, i);
  }
  TORCH_CHECK(static_cast<int64_t>(where.size()) == n, "page_scores: the MinMax blocks' rows must stack to the queries'");
  float* o = out.data_ptr<float>();
  const auto qs = query.strides();
  const auto bs = bias.strides();
  const Floats qf(query), bf(bias);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, meta[0].scalar_type(), "page_scores", [&] {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q2(2 * d), acc(e), best(e), brow(e);
      for (int64_t r = begin; r < end; ++r) {
        const at::Tensor& block = meta[where[r].first];
        const auto ms = block.strides();
        const scalar_t* m = block.const_data_ptr<scalar_t>() + where[r].second * ms[0];
        for (int64_t j = 0; j < e; ++j) brow[j] = bf[r * bs[0] + j * bs[1]];
        for (int64_t h = 0; h < g; ++h) {
          for (int64_t c = 0; c < d; ++c) {
            const float x = qf[r * qs[0] + h * qs[1] + c * qs[2]];
            q2[c] = x > 0.0f ? x : 0.0f;  // against the channel max
            q2[d + c] = x < 0.0f ? x : 0.0f;  // against the channel min
          }
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t c = 0; c < 2 * d; ++c) {
            const float w = q2[c];
            const scalar_t* line = m + c * ms[1];
            if (ms[2] == 1) {
              for (int64_t j = 0; j < e; ++j) acc[j] += w * as_float(line[j]);
            } else {
              for (int64_t j = 0; j < e; ++j) acc[j] += w * as_float(line[j * ms[2]]);
            }
          }
          for (int64_t j = 0; j < e; ++j) {
            const float s = acc[j] + brow[j];
            best[j] = h == 0 ? s : nan_max(best[j], s);
          }
        }
        for (int64_t p = 0; p < pages; ++p) {
          float s = best[p * subpages];
          for (int64_t k = 1; k < subpages; ++k) s = nan_max(s, best[p * subpages + k]);
          o[r * pages + p] = s;
        }
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------------------------
// Softmax-weighted sum of values: the logits of one row's query heads `s [G, M]` (fp32, -inf masked) and where token
// t's values lie in the flat tier (`token[t]`, rows `value_stride_t` apart); the probabilities rounded to the values'
// dtype for `p @ v`, the sum in fp32, as the Triton kernels.
// A head with no finite logit gives NaN (0 / 0), as torch.softmax over an all -inf row.
// ------------------------------------------------------------------------------------------------------------------
template <typename V>
void softmax_values(std::vector<float>& s, int64_t g, int64_t mtok, int64_t dv, const V* values,
                    const std::vector<int64_t>& token, int64_t value_stride_t, int64_t value_stride_d, V* out,
                    int64_t out_stride_g, int64_t out_stride_d, std::vector<float>& acc) {
  // `s` becomes the probabilities (unnormalised): one exp pass per head, then `p @ v` over the tokens.
  acc.assign(g * dv, 0.0f);
  std::vector<float> total(g, 0.0f);
  for (int64_t h = 0; h < g; ++h) {
    float* sh = s.data() + h * mtok;
    float m = kNegInf;
    for (int64_t t = 0; t < mtok; ++t) m = nan_max(m, sh[t]);
    const float shift = m == kNegInf ? 0.0f : m;  // every token masked: exp gives 0 (then 0 / 0), not NaN
    for (int64_t t = 0; t < mtok; ++t) sh[t] = fast_exp(sh[t] - shift);
    float z = 0.0f;
    for (int64_t t = 0; t < mtok; ++t) z += sh[t];
    total[h] = z;
    if (!std::is_same<V, float>::value)  // the probabilities in the values' dtype for the product
      for (int64_t t = 0; t < mtok; ++t) sh[t] = static_cast<float>(static_cast<V>(sh[t]));
  }
  std::vector<float> v(dv);
  for (int64_t t = 0; t < mtok; ++t) {
    const V* row = values + token[t] * value_stride_t;
    for (int64_t c = 0; c < dv; ++c) v[c] = as_float(row[c * value_stride_d]);
    for (int64_t h = 0; h < g; ++h) {
      const float p = s[h * mtok + t];
      float* a = acc.data() + h * dv;
      for (int64_t c = 0; c < dv; ++c) a[c] += p * v[c];
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t c = 0; c < dv; ++c) out[h * out_stride_g + c * out_stride_d] = static_cast<V>(acc[h * dv + c] / total[h]);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Decode attention: the PyTorch backend's arithmetic (`torch_backend.attention`: the logits as one batched product in
// the keys' dtype, softmax in fp32, the product with the values) with ATen's CPU kernels, called from here so that the
// step makes one call: a hand loop over the tokens was 2x slower than the BLAS products on this CPU.
// ------------------------------------------------------------------------------------------------------------------
at::Tensor attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& bias,
                     double scaling, std::optional<double> softcap) {
  const int64_t n = query.size(0), g = query.size(1), dv = values.size(2);
  if (n == 0 || g == 0 || keys.size(1) == 0)  // no token: zeros, as the backend's empty matmul
    return at::zeros({n, g, dv}, values.options());
  const at::Tensor b = bias.dim() == 3 ? bias : bias.unsqueeze(1);
  at::Tensor logits;
  if (!softcap) {
    logits = at::baddbmm(b.to(keys.scalar_type()), query.to(keys.scalar_type()), keys.transpose(1, 2), 1.0, scaling);
  } else {
    logits = at::matmul(query.to(keys.scalar_type()), keys.transpose(1, 2)).to(at::kFloat).mul(scaling);
    logits = at::tanh(logits.div(*softcap)).mul(*softcap).add(b);
  }
  const at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
  return at::matmul(probs.to(values.scalar_type()), values);
}

// ------------------------------------------------------------------------------------------------------------------
// Attention over a ranking's own logits of the pages it chose, the values read in place from the flat tier.
// ------------------------------------------------------------------------------------------------------------------
at::Tensor chosen_attention(const at::Tensor& logits, const at::Tensor& top, const at::Tensor& pages,
                            const at::Tensor& starts, const at::Tensor& values) {
  const int64_t m = top.size(0), kk = top.size(1), g = logits.size(1), p = logits.size(3), dv = values.size(1);
  auto out = at::empty({m, g, dv}, values.options());
  if (m == 0) return out;
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "chosen_attention: fp32 logits expected");
  const float* lp = logits.const_data_ptr<float>();
  const int64_t* tp = top.const_data_ptr<int64_t>();
  const int64_t* pp = pages.const_data_ptr<int64_t>();
  const int64_t* sp = starts.const_data_ptr<int64_t>();
  const auto ls = logits.strides();
  const auto ts = top.strides();
  const auto ps = pages.strides();
  const auto vs = values.strides();
  const auto os = out.strides();
  const int64_t ss = starts.stride(0);
  const auto vtype = values.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, vtype, "chosen_attention", [&] {
    using V = scalar_t;
    const V* vp = values.const_data_ptr<V>();
    V* op = out.data_ptr<V>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      const int64_t mtok = kk * p;
      std::vector<float> s(g * mtok), acc;
      std::vector<int64_t> token(mtok);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t start = sp[r * ss];
        for (int64_t j = 0; j < kk; ++j) {
          const int64_t place = tp[r * ts[0] + j * ts[1]];
          const int64_t page = pp[r * ps[0] + j * ps[1]];
          for (int64_t t = 0; t < p; ++t) {
            token[j * p + t] = (start + page) * p + t;
            for (int64_t h = 0; h < g; ++h)
              s[h * mtok + j * p + t] = lp[r * ls[0] + h * ls[1] + place * ls[2] + t * ls[3]];
          }
        }
        softmax_values<V>(s, g, mtok, dv, vp, token, vs[0], vs[1], op + r * os[0], os[1], os[2], acc);
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------------------------
// Refinement's candidates: the scores raised to the carried ones, the `count` largest (of equal ones the lower pages),
// in page order.
// ------------------------------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> candidates(const at::Tensor& scores, const at::Tensor& carried_pages,
                                              const at::Tensor& carried_scores, int64_t count) {
  const int64_t n = scores.size(0), pages = scores.size(1), w = carried_pages.size(1);
  auto out_scores = at::empty({n, count}, scores.options().dtype(at::kFloat));
  auto out_pages = at::empty({n, count}, scores.options().dtype(at::kLong));
  if (n == 0) return {out_scores, out_pages};
  TORCH_CHECK(scores.scalar_type() == at::kFloat && carried_scores.scalar_type() == at::kFloat,
              "candidates: fp32 scores expected");
  const float* sp = scores.const_data_ptr<float>();
  const int64_t* cp = carried_pages.const_data_ptr<int64_t>();
  const float* cs = carried_scores.const_data_ptr<float>();
  const auto st = scores.strides();
  const auto cpt = carried_pages.strides();
  const auto cst = carried_scores.strides();
  float* os = out_scores.data_ptr<float>();
  int64_t* op = out_pages.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> raised(pages);
    std::vector<int32_t> keys(pages);
    std::vector<char> taken;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < pages; ++i) raised[i] = sp[r * st[0] + i * st[1]];
      for (int64_t j = 0; j < w; ++j) {
        const int64_t page = cp[r * cpt[0] + j * cpt[1]];
        if (page >= 0 && page < pages) raised[page] = nan_max(raised[page], cs[r * cst[0] + j * cst[1]]);
      }
      for (int64_t i = 0; i < pages; ++i) keys[i] = order_key(raised[i]);
      top_places(keys, count, taken);
      int64_t place = 0;
      for (int64_t i = 0; i < pages; ++i) {
        if (!taken[i]) continue;
        os[r * count + place] = raised[i];
        op[r * count + place] = i;
        ++place;
      }
    }
  });
  return {out_scores, out_pages};
}

// ------------------------------------------------------------------------------------------------------------------
// Refinement's logits: `scaling * q . k + bias` per candidate token in fp32, the keys read in place from the near
// (rows before `near`) or the full tier. Each logit is summed over the channels in one order.
// ------------------------------------------------------------------------------------------------------------------
at::Tensor page_logits(const at::Tensor& query, const at::Tensor& pages, const at::Tensor& rows, int64_t near,
                       const at::Tensor& near_k, const at::Tensor& near_index, const at::Tensor& full_k,
                       const at::Tensor& tokens, const std::optional<at::Tensor>& seq, double scaling) {
  const int64_t n = pages.size(0), c = pages.size(1), g = query.size(1), d = query.size(2), p = tokens.size(2);
  auto out = at::empty({n, g, c, p}, query.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  TORCH_CHECK(near_k.scalar_type() == full_k.scalar_type(), "page_logits: both tiers in one dtype");
  const int64_t* pg = pages.const_data_ptr<int64_t>();
  const int64_t* rw = rows.const_data_ptr<int64_t>();
  const int64_t* ni = near_index.const_data_ptr<int64_t>();
  const int64_t* sq = seq ? seq->const_data_ptr<int64_t>() : nullptr;
  const auto qs = query.strides();
  const auto pgs = pages.strides();
  const auto nks = near_k.strides();
  const auto fks = full_k.strides();
  const auto tks = tokens.strides();
  const int64_t rs = rows.stride(0), nis = near_index.stride(0), sqs = seq ? seq->stride(0) : 0;
  float* o = out.data_ptr<float>();  // contiguous [n, G, C, P]
  const float scale = static_cast<float>(scaling);
  const Floats qf(query), tf(tokens);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, full_k.scalar_type(), "page_logits", [&] {
    const scalar_t* nk = near_k.const_data_ptr<scalar_t>();
    const scalar_t* fk = full_k.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(g * d);
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t h = 0; h < g; ++h)
          for (int64_t e = 0; e < d; ++e) q[h * d + e] = qf[i * qs[0] + h * qs[1] + e * qs[2]];
        const int64_t r = rw[i * rs];
        const bool from_near = i < near;
        const scalar_t* tier = from_near ? nk + ni[r * nis] * nks[0] : fk + r * fks[0];
        const int64_t stride_t = from_near ? nks[1] : fks[1], stride_d = from_near ? nks[2] : fks[2];
        const int64_t s = sq ? sq[i * sqs] : 0;
        for (int64_t j = 0; j < c; ++j) {
          const int64_t page = pg[i * pgs[0] + j * pgs[1]];
          for (int64_t t = 0; t < p; ++t) {
            const scalar_t* k = tier + (page * p + t) * stride_t;
            const float b = tf[s * tks[0] + page * tks[1] + t * tks[2]];
            for (int64_t h = 0; h < g; ++h)
              o[((i * g + h) * c + j) * p + t] = dot16(q.data() + h * d, k, stride_d, d) * scale + b;
          }
        }
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------------------------
// Refinement's choice: the candidates' mass (per head the softmax over every candidate token, summed per page, over
// the group; an infinite score kept), the K of most mass (places and pages, in candidate order) and the carried
// candidates.
// ------------------------------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> choose(const at::Tensor& logits, const at::Tensor& scores,
                                                      const at::Tensor& cand, const at::Tensor& page, int64_t k,
                                                      int64_t carry, double score, at::Tensor pages_out,
                                                      at::Tensor scores_out) {
  const int64_t n = logits.size(0), g = logits.size(1), c = logits.size(2), p = logits.size(3);
  const int64_t w = pages_out.size(1);
  auto mass = at::empty({n, c}, scores.options().dtype(at::kFloat));
  auto top = at::empty({n, k}, scores.options().dtype(at::kLong));
  auto chosen = at::empty({n, k}, cand.options());
  if (n == 0) return {mass, top, chosen};
  TORCH_CHECK(logits.scalar_type() == at::kFloat && scores.scalar_type() == at::kFloat &&
                  scores_out.scalar_type() == at::kFloat, "choose: fp32 logits and scores expected");
  TORCH_CHECK(cand.scalar_type() == at::kLong && page.scalar_type() == at::kLong &&
                  pages_out.scalar_type() == at::kLong, "choose: int64 pages expected");
  const float* lp = logits.const_data_ptr<float>();
  const float* sp = scores.const_data_ptr<float>();
  const int64_t* cp = cand.const_data_ptr<int64_t>();
  const int64_t* pgp = page.const_data_ptr<int64_t>();
  const int64_t page_stride = page.numel() > 1 ? page.stride(0) : 0;
  const auto ls = logits.strides();
  const auto ss = scores.strides();
  const auto cs = cand.strides();
  const auto pos = pages_out.strides();
  const auto sos = scores_out.strides();
  float* mp = mass.data_ptr<float>();
  int64_t* tp = top.data_ptr<int64_t>();
  int64_t* hp = chosen.data_ptr<int64_t>();
  int64_t* po = pages_out.data_ptr<int64_t>();
  float* so = scores_out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(c), ex(c * p), key(c);
    std::vector<int32_t> keys(c);
    std::vector<char> taken;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * ls[0];
      // Per head: its max over every candidate token, the exps (one pass), their sum; then each page's share.
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t h = 0; h < g; ++h) {
        for (int64_t j = 0; j < c; ++j)
          for (int64_t t = 0; t < p; ++t) ex[j * p + t] = row[h * ls[1] + j * ls[2] + t * ls[3]];
        float m = kNegInf;
        for (int64_t i = 0; i < c * p; ++i) m = nan_max(m, ex[i]);
        for (int64_t i = 0; i < c * p; ++i) ex[i] = fast_exp(ex[i] - m);  // m = -inf: NaN, as torch.softmax
        float z = 0.0f;
        for (int64_t i = 0; i < c * p; ++i) z += ex[i];
        for (int64_t j = 0; j < c; ++j) {
          float part = 0.0f;
          for (int64_t t = 0; t < p; ++t) part += ex[j * p + t];
          sums[j] += part / z;
        }
      }
      for (int64_t j = 0; j < c; ++j) {
        const float s = sp[r * ss[0] + j * ss[1]];
        const float m = sums[j] / static_cast<float>(g);
        // NaN (a head with no finite logit) written as the positive quiet NaN, whatever sign the arithmetic gave it
        mp[r * c + j] = std::isinf(s) ? s : (m == m ? m : std::numeric_limits<float>::quiet_NaN());
      }
      for (int64_t j = 0; j < c; ++j) keys[j] = order_key(mp[r * c + j]);
      top_places(keys, k, taken);
      int64_t place = 0;
      for (int64_t j = 0; j < c; ++j) {
        if (!taken[j]) continue;
        tp[r * k + place] = j;
        hp[r * k + place] = cp[r * cs[0] + j * cs[1]];
        ++place;
      }
      if (carry) {
        for (int64_t j = 0; j < c; ++j) {
          const float x = mp[r * c + j];
          key[j] = (x == x && !std::isinf(x)) ? x : 0.0f;  // NaN, +-inf: 0
        }
        const int64_t limit = pgp[r * page_stride];
        for (int64_t i = 0; i < w; ++i) {
          po[r * pos[0] + i * pos[1]] = 0;
          so[r * sos[0] + i * sos[1]] = kNegInf;
        }
        for (int64_t i = 0; i < carry; ++i) {
          int64_t at = 0;
          for (int64_t j = 1; j < c; ++j) if (key[j] > key[at]) at = j;  // the first place of the most mass
          const float best = key[at];
          const int64_t pg = cp[r * cs[0] + at * cs[1]];
          const float carried = best > 0.0f ? static_cast<float>(score) : kNegInf;
          po[r * pos[0] + (2 * i) * pos[1]] = std::min(pg, limit);
          po[r * pos[0] + (2 * i + 1) * pos[1]] = std::min(pg + 1, limit);
          so[r * sos[0] + (2 * i) * sos[1]] = carried;
          so[r * sos[0] + (2 * i + 1) * sos[1]] = carried;
          key[at] = -1.0f;
        }
      }
    }
  });
  return {mass, top, chosen};
}

// ------------------------------------------------------------------------------------------------------------------
// A decode token's writes: the full tier, the window (a stable row) or the near tier (the others, where apart), and
// the MinMax entry of its sub-page; the count `+= 1`.
// ------------------------------------------------------------------------------------------------------------------
void append_token(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& position, at::Tensor length,
                  at::Tensor full_k, at::Tensor full_v, at::Tensor meta, const at::Tensor& meta_row, at::Tensor win_k,
                  at::Tensor win_v, const at::Tensor& win_shift, const at::Tensor& stable_local, at::Tensor near_k,
                  at::Tensor near_v, const at::Tensor& near_place, int64_t subpage_len) {
  const int64_t n = keys.size(0), d = keys.size(1), dv = values.size(1);
  if (n == 0) return;
  TORCH_CHECK(keys.scalar_type() == full_k.scalar_type() && values.scalar_type() == full_v.scalar_type() &&
                  win_k.scalar_type() == full_k.scalar_type() && win_v.scalar_type() == full_v.scalar_type() &&
                  meta.scalar_type() == full_k.scalar_type(),
              "append_token: the token, its tiers and the MinMax cache in one dtype");
  TORCH_CHECK(position.scalar_type() == at::kLong && length.scalar_type() == at::kLong, "append_token: int64 counts");
  const int64_t pos = position.const_data_ptr<int64_t>()[0];
  // The caller grows a full cache before an eager step and asserts room in a compiled one; a write past it would
  // corrupt memory, so it is refused here too (a read of a host number this op makes anyway).
  TORCH_CHECK(pos >= 0 && pos < full_k.size(1), "append_token: position ", pos, " is outside the full tier's ",
              full_k.size(1), " tokens per row");
  const int64_t n_s = win_shift.size(0) - 1;
  const bool near = near_k.numel() > 0;
  const int64_t* mr = meta_row.const_data_ptr<int64_t>();
  const int64_t* ws = win_shift.const_data_ptr<int64_t>();
  const int64_t* sl = stable_local.const_data_ptr<int64_t>();
  const int64_t* np = near ? near_place.const_data_ptr<int64_t>() : nullptr;
  const int64_t sub = pos / subpage_len;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "append_token", [&] {
    using T = scalar_t;
    const T* kp = keys.const_data_ptr<T>();
    const T* vp = values.const_data_ptr<T>();
    T* fk = full_k.data_ptr<T>();
    T* fv = full_v.data_ptr<T>();
    T* wk = win_k.data_ptr<T>();
    T* wv = win_v.data_ptr<T>();
    T* mt = meta.data_ptr<T>();
    T* nk = near ? near_k.data_ptr<T>() : nullptr;
    T* nv = near ? near_v.data_ptr<T>() : nullptr;
    const auto ks = keys.strides(), vs = values.strides(), fks = full_k.strides(), fvs = full_v.strides();
    const auto ms = meta.strides();
    const int64_t wkt = win_k.stride(1), wkd = win_k.stride(2), wvt = win_v.stride(1), wvd = win_v.stride(2);
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* key = kp + r * ks[0];
        const T* value = vp + r * vs[0];
        copy_row(key, ks[1], fk + r * fks[0] + pos * fks[1], fks[2], d);
        copy_row(value, vs[1], fv + r * fvs[0] + pos * fvs[1], fvs[2], dv);
        const int64_t local = sl[r];
        if (local < n_s) {
          const int64_t slot = ws[local] + pos;  // flat over the window's first two dims
          copy_row(key, ks[1], wk + slot * wkt, wkd, d);
          copy_row(value, vs[1], wv + slot * wvt, wvd, dv);
        } else if (near) {
          const int64_t place = np[r];
          copy_row(key, ks[1], nk + place * near_k.stride(0) + pos * near_k.stride(1), near_k.stride(2), d);
          copy_row(value, vs[1], nv + place * near_v.stride(0) + pos * near_v.stride(1), near_v.stride(2), dv);
        }
        T* entry = mt + mr[r] * ms[0] + sub * ms[2];
        for (int64_t c = 0; c < d; ++c) {
          float high = kNegInf, low = kPosInf;
          for (int64_t t = sub * subpage_len; t < (sub + 1) * subpage_len; ++t) {
            const float x = as_float(fk[r * fks[0] + t * fks[1] + c * fks[2]]);
            high = nan_max(high, x);  // a NaN key makes its channel's bounds NaN, as amax / amin do
            low = nan_min(low, x);
          }
          entry[c * ms[1]] = static_cast<T>(high);
          entry[(d + c) * ms[1]] = static_cast<T>(low);
        }
      }
    });
  });
  length.data_ptr<int64_t>()[0] += 1;
}

// ------------------------------------------------------------------------------------------------------------------
// A re-rank's window moves (`fc_hf/tiers.py`): per ranked row its new window (pages in page order, the page being
// filled at K - 1, a page not there yet -1, then the pages it will open), its first K pages' tokens from the full tier,
// its shift and its token-bias rows; the pages it did not hold counted into `promoted`.
// ------------------------------------------------------------------------------------------------------------------
void move_windows(const at::Tensor& pages, const at::Tensor& page, const at::Tensor& local, const at::Tensor& rows,
                  const at::Tensor& full_k, const at::Tensor& full_v, at::Tensor win_k, at::Tensor win_v,
                  at::Tensor win_pages, at::Tensor win_shift, const at::Tensor& win_base, at::Tensor win_bias_rows,
                  const at::Tensor& stable_batch, at::Tensor promoted, int64_t num_pages, int64_t k, bool count) {
  const int64_t n = pages.size(0), kr = pages.size(1), w = win_pages.size(1);
  if (n == 0) return;
  const int64_t p = w ? win_k.size(1) / w : 1;
  const int64_t n_s = win_pages.size(0) - 1;
  TORCH_CHECK(win_k.scalar_type() == full_k.scalar_type() && win_v.scalar_type() == full_v.scalar_type(),
              "move_windows: the windows in their tiers' dtypes");
  const int64_t* pp = pages.const_data_ptr<int64_t>();
  const int64_t* pg = page.const_data_ptr<int64_t>();
  const int64_t page_stride = page.numel() > 1 ? page.stride(0) : 0;
  const int64_t* lc = local.const_data_ptr<int64_t>();
  const int64_t* rw = rows.const_data_ptr<int64_t>();
  int64_t* wp = win_pages.data_ptr<int64_t>();
  int64_t* wsh = win_shift.data_ptr<int64_t>();
  const int64_t* wb = win_base.const_data_ptr<int64_t>();
  int64_t* wbr = win_bias_rows.data_ptr<int64_t>();
  const int64_t* sb = stable_batch.const_data_ptr<int64_t>();
  const auto pps = pages.strides(), wps = win_pages.strides(), wbs = win_bias_rows.strides();
  int64_t fresh_total = 0;
  std::vector<int64_t> sorted(k), first(k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, full_k.scalar_type(), "move_windows_k", [&] {
    using TK = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, full_v.scalar_type(), "move_windows_v", [&] {
      using TV = scalar_t;
      const TK* fk = full_k.const_data_ptr<TK>();
      const TV* fv = full_v.const_data_ptr<TV>();
      TK* wk = win_k.data_ptr<TK>();
      TV* wv = win_v.data_ptr<TV>();
      const auto fks = full_k.strides(), fvs = full_v.strides(), wks = win_k.strides(), wvs = win_v.strides();
      const int64_t d = full_k.size(2), dv = full_v.size(2);
      // One row after another: padded places share the stable tensors' extra row.
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = pg[i * page_stride];
        const int64_t loc = lc[i];
        const int64_t row = rw[i];
        for (int64_t j = 0; j < k; ++j) sorted[j] = j < kr ? pp[i * pps[0] + j * pps[1]] : num_pages + j - kr;
        std::sort(sorted.begin(), sorted.end());
        const int64_t last = sorted[k - 1];
        for (int64_t j = 0; j < k; ++j) if (sorted[j] == at) sorted[j] = last;
        sorted[k - 1] = at;
        int64_t fresh = 0;
        for (int64_t j = 0; j < k; ++j) {
          const bool present = sorted[j] <= at;
          first[j] = present ? sorted[j] : -1;
          if (count && present) {
            bool held = false;
            for (int64_t v = 0; v < w && !held; ++v) held = wp[loc * wps[0] + v * wps[1]] == first[j];
            fresh += !held;
          }
        }
        if (count && loc < n_s) fresh_total += fresh;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t src = first[j] >= 0 ? first[j] : 0;  // a position without a page reads page 0 (masked)
          for (int64_t t = 0; t < p; ++t) {
            copy_row(fk + row * fks[0] + (src * p + t) * fks[1], fks[2], wk + loc * wks[0] + (j * p + t) * wks[1],
                     wks[2], d);
            copy_row(fv + row * fvs[0] + (src * p + t) * fvs[1], fvs[2], wv + loc * wvs[0] + (j * p + t) * wvs[1],
                     wvs[2], dv);
          }
        }
        const int64_t seq = sb[loc];
        for (int64_t j = 0; j < w; ++j) {
          const int64_t pg_j = j < k ? first[j] : at + j - k + 1;
          wp[loc * wps[0] + j * wps[1]] = pg_j;
          const int64_t bias_page = (pg_j < 0 || pg_j >= num_pages) ? num_pages : pg_j;
          wbr[loc * wbs[0] + j * wbs[1]] = seq * (num_pages + 1) + bias_page;
        }
        wsh[loc * win_shift.stride(0)] = wb[loc * win_base.stride(0)] + (k - 1 - at) * p;
      }
    });
  });
  if (count) {
    TORCH_CHECK(promoted.scalar_type() == at::kLong, "move_windows: an int64 count");
    promoted.data_ptr<int64_t>()[0] += fresh_total;
  }
}

}  // namespace

TORCH_LIBRARY(flexicache_cpu, m) {
  m.def("page_scores(Tensor query, Tensor[] meta, Tensor bias, int subpages) -> Tensor");
  m.def("attention(Tensor query, Tensor keys, Tensor values, Tensor bias, float scaling, float? softcap=None) -> Tensor");
  m.def("chosen_attention(Tensor logits, Tensor top, Tensor pages, Tensor starts, Tensor values) -> Tensor");
  m.def("candidates(Tensor scores, Tensor carried_pages, Tensor carried_scores, int count) -> (Tensor, Tensor)");
  m.def("page_logits(Tensor query, Tensor pages, Tensor rows, int near, Tensor near_k, Tensor near_index, "
        "Tensor full_k, Tensor tokens, Tensor? seq, float scaling) -> Tensor");
  m.def("choose(Tensor logits, Tensor scores, Tensor cand, Tensor page, int k, int carry, float score, "
        "Tensor(a!) pages_out, Tensor(b!) scores_out) -> (Tensor, Tensor, Tensor)");
  m.def("append_token(Tensor keys, Tensor values, Tensor position, Tensor(a!) length, Tensor(b!) full_k, "
        "Tensor(c!) full_v, Tensor(d!) meta, Tensor meta_row, Tensor(e!) win_k, Tensor(f!) win_v, Tensor win_shift, "
        "Tensor stable_local, Tensor(g!) near_k, Tensor(h!) near_v, Tensor near_place, int subpage_len) -> ()");
  m.def("move_windows(Tensor pages, Tensor page, Tensor local, Tensor rows, Tensor full_k, Tensor full_v, "
        "Tensor(a!) win_k, Tensor(b!) win_v, Tensor(c!) win_pages, Tensor(d!) win_shift, Tensor win_base, "
        "Tensor(e!) win_bias_rows, Tensor stable_batch, Tensor(f!) promoted, SymInt num_pages, int k, bool count) -> ()");
}

TORCH_LIBRARY_IMPL(flexicache_cpu, CPU, m) {
  m.impl("page_scores", &page_scores);
  m.impl("attention", &attention);
  m.impl("chosen_attention", &chosen_attention);
  m.impl("candidates", &candidates);
  m.impl("page_logits", &page_logits);
  m.impl("choose", &choose);
  m.impl("append_token", &append_token);
  m.impl("move_windows", &move_windows);
}
