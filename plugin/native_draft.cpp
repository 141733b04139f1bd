// The Llama-style draft's forward in one native call, for float32 on CPU: the same arithmetic as
// plugin/draft_model.py's DraftModel.forward (its docstring holds the contract), with the matrix
// products left to ATen and everything between them (norms, rotary positions, the cache writes,
// attention over each row's cached prefix, SwiGLU) as plain loops. A small draft decoding a few tokens
// is bound by per-operation overhead, not arithmetic: about 60 PyTorch calls a forward from Python cost
// more than its products; here a forward makes nine. The last layer's outputs feed only the logits, so
// it runs for each row's last fed token alone, and not at all (past its cache writes) in a forward that
// returns none: a rebuilt prefix skips half its attention and products (350 tokens: 4.8 -> 2.8 ms).
//
// A narrow feed (a few rows of one token: decoding at a small batch) is bound by reading the weights,
// and an engine step reads them cold (the target's forward before it streams its own, several times
// the cache). For those the products read a bfloat16 copy of the weights, half the bytes, and compute
// in float32: given only where the weights are exactly bfloat16 values (a bfloat16 checkpoint), so
// that the arithmetic is the same as float32's.
//
// A wide batch (16 rows over a few hundred cached positions each) is bound by reading the KV cache, which
// its attention reads whole every forward: the cache may hold bfloat16 (keys and values rounded to
// nearest as they are stored, as torch rounds, and widened as they are read), and the loops over cached
// positions are written in AVX2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPerLayer = 7;  // in_norm, post_norm, qkv, qkv bias (empty: none), o, up, down
constexpr int64_t kLoopWidth = 4;  // feeds of up to this many tokens per row attend query by query
constexpr int64_t kNarrowRows = 8;  // feeds of up to this many tokens in all take the bfloat16 copies
constexpr int64_t kWideRows = 128;  // products of at least this many rows multiply in bfloat16 (oneDNN)
constexpr int64_t kWideHeadRows = 16;  // the LM head's rows from which it does
constexpr int64_t kBlock = 64;  // outputs per accumulator block: the bfloat16 copies pad their columns to it

inline float from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Rows r < R of out[:, :count] (row stride m) = (accumulate ? out : bias or 0) + x[r, :k] . w[:, :count], for
// w a block of B columns of the transposed bfloat16 weights (row stride padded). Each weight row is read
// and widened once for the R rows; the accumulators stay in registers.
template <int R, int B>
void block_bf16(const float* x, int64_t k, const uint16_t* w, int64_t padded, const float* bias, float* out,
                int64_t m, int64_t count, bool accumulate) {
  float acc[R][B] = {};
  for (int64_t i = 0; i < k; ++i) {
    const uint16_t* wi = w + i * padded;
    if constexpr (R == 1) {
      const float xi = x[i];
#pragma omp simd
      for (int j = 0; j < B; ++j) acc[0][j] += xi * from_bf16(wi[j]);
    } else {
      float wide[B];
#pragma omp simd
      for (int j = 0; j < B; ++j) wide[j] = from_bf16(wi[j]);
      for (int r = 0; r < R; ++r) {
        const float xi = x[r * k + i];
#pragma omp simd
        for (int j = 0; j < B; ++j) acc[r][j] += xi * wide[j];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * m;
    for (int64_t j = 0; j < count; ++j) o[j] = (accumulate ? o[j] : (bias ? bias[j] : 0.f)) + acc[r][j];
  }
}

// out[r, :m] = (accumulate ? out[r, :m] : bias or 0) + x[r, :k] . w for r < n, with w the product's
// weights transposed, [k, m rounded up to kBlock], as bfloat16 bits: rows four at a time over blocks of
// 16 columns (each block, k x 16, read from memory once and then from L1 for every group), the last
// n % 4 rows one at a time over blocks of kBlock.
void linear_bf16(const float* x, const at::Tensor& transposed, const float* bias, float* out, int64_t n,
                 int64_t k, int64_t m, bool accumulate) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(transposed.data_ptr<at::BFloat16>());
  const int64_t padded = transposed.size(1), grouped = n - n % 4;
  // The blocks read whole kBlock-wide column blocks: a copy padded otherwise (plugin/native_draft.py's
  // BLOCK out of step with kBlock) would be read past its end.
  TORCH_CHECK(transposed.size(0) == k && padded % kBlock == 0 && padded >= m,
              "specserve native draft: a bfloat16 copy must be [k, m rounded up to ", kBlock, "]");
  for (int64_t block = 0; grouped && block < m; block += 16)
    for (int64_t r = 0; r < grouped; r += 4)
      block_bf16<4, 16>(x + r * k, k, w + block, padded, bias ? bias + block : nullptr, out + r * m + block, m,
                        std::min<int64_t>(16, m - block), accumulate);
  for (int64_t block = 0; block < m; block += kBlock)
    for (int64_t r = grouped; r < n; ++r)
      block_bf16<1, kBlock>(x + r * k, k, w + block, padded, bias ? bias + block : nullptr, out + r * m + block, m,
                            std::min(kBlock, m - block), accumulate);
}

// How a product multiplies: by its bfloat16 copy (transposed, padded; `linear_bf16`), in bfloat16 by
// ATen (the weights as bfloat16 [m, k], the input rounded to bfloat16: oneDNN, on AMX where the CPU has
// it, with a float32 result), or in float32 by ATen (both null).
struct Weights16 {
  const at::Tensor* copy = nullptr;
  const at::Tensor* gemm = nullptr;
};

// The input [n, k] . weight [m, k] transposed in bfloat16, as float32 [n, m].
at::Tensor gemm_bf16(const at::Tensor& input, const at::Tensor& weight16) {
  return at::mm(input.to(at::kBFloat16), weight16.t()).to(at::kFloat);
}

// input [n, k] . weight [m, k] transposed (+ bias, when not empty), as a new [n, m], as `by` says.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, Weights16 by) {
  if (by.gemm) return bias.numel() ? gemm_bf16(input, *by.gemm).add_(bias) : gemm_bf16(input, *by.gemm);
  const at::Tensor* copy = by.copy;
  if (!copy) return bias.numel() ? at::addmm(bias, input, weight.t()) : at::mm(input, weight.t());
  at::Tensor out = at::empty({input.size(0), weight.size(0)}, input.options());
  linear_bf16(input.data_ptr<float>(), *copy, bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(),
              input.size(0), input.size(1), weight.size(0), false);
  return out;
}

// x [n, m] += input [n, k] . weight [m, k] transposed, the same three ways.
void add_linear(at::Tensor& x, const at::Tensor& input, const at::Tensor& weight, Weights16 by) {
  if (by.gemm) {
    x.add_(gemm_bf16(input, *by.gemm));
    return;
  }
  const at::Tensor* copy = by.copy;
  if (!copy) {
    x.addmm_(input, weight.t());
    return;
  }
  linear_bf16(input.data_ptr<float>(), *copy, nullptr, x.data_ptr<float>(), input.size(0), input.size(1),
              weight.size(0), true);
}

// out[n, :] = x[n, :] / rms(x[n, :]) * weight, for the n rows of x [n, d].
void rms_norm(const float* x, const float* weight, float* out, int64_t n, int64_t d, double eps) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * d;
    float sum = 0.f;
    for (int64_t j = 0; j < d; ++j) sum += row[j] * row[j];
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = row[j] * scale * weight[j];
  }
}

// Rotate each head of v [head_dim] by the angles of one position: v * cos + rotate_half(v) * sin.
void rotate(float* v, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// A cache entry as float32: the cache holds float32 or bfloat16 (half the bytes that attention reads).
inline float widen(float value) { return value; }
inline float widen(at::BFloat16 value) { return from_bf16(value.x); }

// exp(x) for x <= 0 (a score minus the row's largest): 2^n e^r with n = round(x / ln 2) and e^r by its
// degree-6 Taylor polynomial on |r| <= ln(2) / 2 (about 1e-7 relative, float32's own rounding); below
// -87 it gives about 1e-38, not 0, which no softmax weight notices.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f;  // ln 2 in two parts
constexpr float kExpPoly[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * kLog2e);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * r + kExpPoly[i];
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Attention's three loops over a row's cached positions, for one query and one head: scores, their
// softmax, the weighted sum of values. Written out in AVX2 where the build has it and head_dim is a
// multiple of 8 (every checkpoint here): the compiler leaves these loops scalar, and at a batch of 16
// with a few hundred cached positions they were most of a draft forward (70 cycles a position).
#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// score[p] = scale * q . keys[p] for positions p < count (keys [count, head_dim]); four positions at a
// time, each with its own accumulator, so that the products run at the processor's rate rather than at
// the latency of one dot product's additions.
template <typename T>
void score_keys(const float* q, const T* keys, int64_t count, int64_t head_dim, float scale, float* score) {
  int64_t p = 0;
#ifdef __AVX2__
  if (head_dim % 8 == 0)
    for (; p + 4 <= count; p += 4) {
      const T* key = keys + p * head_dim;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t j = 0; j < head_dim; j += 8) {
        const __m256 qj = _mm256_loadu_ps(q + j);
        a0 = _mm256_fmadd_ps(qj, load8(key + j), a0);
        a1 = _mm256_fmadd_ps(qj, load8(key + head_dim + j), a1);
        a2 = _mm256_fmadd_ps(qj, load8(key + 2 * head_dim + j), a2);
        a3 = _mm256_fmadd_ps(qj, load8(key + 3 * head_dim + j), a3);
      }
      score[p] = sum8(a0) * scale;
      score[p + 1] = sum8(a1) * scale;
      score[p + 2] = sum8(a2) * scale;
      score[p + 3] = sum8(a3) * scale;
    }
#endif
  for (; p < count; ++p) {
    const T* key = keys + p * head_dim;
    float dot = 0.f;
    for (int64_t j = 0; j < head_dim; ++j) dot += q[j] * widen(key[j]);
    score[p] = dot * scale;
  }
}

// score[p < count] = softmax(score)[p].
inline void softmax_in_place(float* score, int64_t count) {
  const float top = *std::max_element(score, score + count);
  float total = 0.f;
  int64_t p = 0;
#ifdef __AVX2__
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (; p + 8 <= count; p += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(score + p), top8));
    _mm256_storeu_ps(score + p, e);
    total8 = _mm256_add_ps(total8, e);
  }
  total = sum8(total8);
#endif
  for (; p < count; ++p) total += (score[p] = exp_nonpositive(score[p] - top));
  const float inverse = 1.f / total;
  for (p = 0; p < count; ++p) score[p] *= inverse;
}

// out[:head_dim] = sum over p < count of weight[p] * values[p] (values [count, head_dim]); in AVX2, 32
// columns at a time in registers, two positions in alternate accumulators.
template <typename T>
void weigh_values(const float* weight, const T* values, int64_t count, int64_t head_dim, float* out) {
  int64_t j = 0;
#ifdef __AVX2__
  for (; head_dim % 8 == 0 && j + 32 <= head_dim; j += 32) {
    __m256 a[8];
    for (auto& v : a) v = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= count; p += 2) {
      const T* v0 = values + p * head_dim + j;
      const T* v1 = v0 + head_dim;
      const __m256 w0 = _mm256_set1_ps(weight[p]), w1 = _mm256_set1_ps(weight[p + 1]);
      for (int c = 0; c < 4; ++c) {
        a[c] = _mm256_fmadd_ps(w0, load8(v0 + 8 * c), a[c]);
        a[4 + c] = _mm256_fmadd_ps(w1, load8(v1 + 8 * c), a[4 + c]);
      }
    }
    for (; p < count; ++p) {
      const __m256 w0 = _mm256_set1_ps(weight[p]);
      for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(w0, load8(values + p * head_dim + j + 8 * c), a[c]);
    }
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + j + 8 * c, _mm256_add_ps(a[c], a[4 + c]));
  }
#endif
  for (; j < head_dim; ++j) {
    float sum = 0.f;
    for (int64_t p = 0; p < count; ++p) sum += weight[p] * widen(values[p * head_dim + j]);
    out[j] = sum;
  }
}

// The attention of each of n queries (head by head) over its row's cached positions 0..its own, query by
// query, for feeds of a token or two per row, where blocked products cost more in setup.
template <typename T>
void attend_one_by_one(const float* qkv, const T* keys, const T* values, float* attn,
                       const std::vector<int64_t>& position, const int64_t* row_of, int64_t width, int64_t n,
                       int64_t num_heads, int64_t head_dim, int64_t groups, int64_t qkv_dim, int64_t row_stride,
                       int64_t head_stride, int64_t longest) {
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const int64_t q_dim = num_heads * head_dim;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / ((longest + 1) * head_dim));  // threads only for chunks worth one
  at::parallel_for(0, n * num_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(longest + 1);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / num_heads, head = job % num_heads, count = position[i] + 1;
      const int64_t base = row_of[i / width] * row_stride + (head / groups) * head_stride;
      float* s = score.data();
      score_keys(qkv + i * qkv_dim + head * head_dim, keys + base, count, head_dim, scale, s);
      softmax_in_place(s, count);
      weigh_values(s, values + base, count, head_dim, attn + i * q_dim + head * head_dim);
    }
  });
}

// draft_forward's body for a cache of T (float or at::BFloat16).
template <typename T>
at::Tensor forward_with_cache(const at::Tensor& tokens, const at::Tensor& start, const at::Tensor& last,
                              const at::Tensor& rows, const std::vector<at::Tensor>& layers, const at::Tensor& embed,
                              const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t num_heads,
                              int64_t num_kv_heads, double eps, const std::vector<at::Tensor>& narrow,
                              const std::vector<at::Tensor>& wide) {
  at::InferenceMode guard;
  // Index tensors of any integer type (vLLM's token ids are int32).
  const auto tok = tokens.to(at::kLong).contiguous(), first = start.to(at::kLong).contiguous();
  const auto row_of = rows.to(at::kLong).contiguous();
  const int64_t batch = tok.size(0);
  int64_t width = tok.size(1), n = batch * width;  // the last layer may narrow both (below)
  const int64_t d = embed.size(1), head_dim = cos.size(1), groups = num_heads / num_kv_heads;
  const int64_t max_rows = k_cache.size(1), max_len = k_cache.size(3), q_dim = num_heads * head_dim;
  const int64_t kv_dim = num_kv_heads * head_dim, qkv_dim = q_dim + 2 * kv_dim;
  const int64_t* first_p = first.data_ptr<int64_t>();
  const int64_t* row_p = row_of.data_ptr<int64_t>();
  std::vector<int64_t> position(n);
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(row_p[b] >= 0 && row_p[b] < max_rows, "specserve native draft: cache row out of range");
    TORCH_CHECK(first_p[b] >= 0, "specserve native draft: negative position");
    for (int64_t t = 0; t < width; ++t) position[b * width + t] = std::min(first_p[b] + t, max_len - 1);
    longest = std::max(longest, position[b * width + width - 1]);
  }
  const bool wants_logits = last.numel() > 0;
  const auto last_c = last.to(at::kLong).contiguous();
  const int64_t* last_p = last_c.data_ptr<int64_t>();
  for (int64_t b = 0; wants_logits && b < batch; ++b)
    TORCH_CHECK(last_p[b] >= 0 && last_p[b] < width, "specserve native draft: last out of range");
  // Which cached positions each fed token sees, [B, 1, T, key_len] (wide feeds only).
  at::Tensor visible;
  if (width > kLoopWidth) {
    at::Tensor pos = at::empty({batch, width, 1}, tok.options());
    std::copy(position.begin(), position.end(), pos.data_ptr<int64_t>());
    visible = (at::arange(longest + 1, tok.options()).view({1, 1, -1}) <= pos).unsqueeze(1);
  }
  const auto options = embed.options();
  const at::Tensor no_bias = at::empty({0}, options);
  at::Tensor x = embed.index_select(0, tok.view({-1}));  // [n, d] the residual stream
  at::Tensor h = at::empty({n, d}, options);
  at::Tensor attn = at::empty({n, q_dim}, options);
  float* x_p = x.data_ptr<float>();
  const auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const float* cos_p = cos_c.data_ptr<float>();
  const float* sin_p = sin_c.data_ptr<float>();
  const int64_t layer_stride = k_cache.stride(0), row_stride = k_cache.stride(1), head_stride = k_cache.stride(2);

  const int64_t num_layers = static_cast<int64_t>(layers.size()) / kPerLayer;
  const auto all_or_none = [&](const std::vector<at::Tensor>& v) {
    return v.empty() || static_cast<int64_t>(v.size()) == 4 * num_layers + 1;
  };
  TORCH_CHECK(all_or_none(narrow) && all_or_none(wide),
              "specserve native draft: 4 bfloat16 products a layer and the LM head, each way, or none");
  bool selected = false;  // whether the stream holds only each row's last fed token (the last layer's)
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layers.data() + layer * kPerLayer;
    rms_norm(x_p, w[0].data_ptr<float>(), h.data_ptr<float>(), n, d, eps);
    // narrow and wide are each given or empty: given where the weights are exactly bfloat16 values (wide only
    // where bfloat16 products pay on this processor, `plugin/native_draft.py`).
    const auto by = [&](int product) {  // 0..3: qkv, o, up, down, for the n rows the stream holds now
      return Weights16{!narrow.empty() && n <= kNarrowRows ? &narrow[layer * 4 + product] : nullptr,
                       !wide.empty() && n >= kWideRows ? &wide[layer * 4 + product] : nullptr};
    };
    at::Tensor qkv = linear(h.narrow(0, 0, n), w[2], w[3], by(0));  // [n, qkv_dim]
    float* qkv_p = qkv.data_ptr<float>();
    T* keys = k_cache.data_ptr<T>() + layer * layer_stride;
    T* values = v_cache.data_ptr<T>() + layer * layer_stride;
    // Rotate q and k, and write every fed token's keys and values before any query reads the cache.
    for (int64_t i = 0; i < n; ++i) {
      float* token = qkv_p + i * qkv_dim;
      const int64_t pos = position[i], cache_row = row_p[i / width];
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head)
        rotate(token + head * head_dim, cos_p + pos * head_dim, sin_p + pos * head_dim, head_dim);
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        const int64_t offset = cache_row * row_stride + kv * head_stride + pos * head_dim;
        std::copy_n(token + q_dim + kv * head_dim, head_dim, keys + offset);  // rounded to T as torch rounds
        std::copy_n(token + q_dim + kv_dim + kv * head_dim, head_dim, values + offset);
      }
    }
    // The last layer's outputs feed only the logits: a forward that returns none (a rebuilt prefix) is
    // done once its keys and values are written, and one that does goes on with each row's last fed token.
    if (layer + 1 == num_layers && !wants_logits) return at::empty({0}, options);
    if (layer + 1 == num_layers && width > 1) {
      at::Tensor pick = at::empty({batch}, tok.options());
      for (int64_t b = 0; b < batch; ++b) pick.data_ptr<int64_t>()[b] = b * width + last_p[b];
      qkv = qkv.index_select(0, pick);
      qkv_p = qkv.data_ptr<float>();
      x = x.index_select(0, pick);
      x_p = x.data_ptr<float>();
      std::vector<int64_t> kept(batch);
      for (int64_t b = 0; b < batch; ++b) kept[b] = position[b * width + last_p[b]];
      position = kept;
      longest = *std::max_element(kept.begin(), kept.end());
      width = 1, n = batch, selected = true;
    }
    // Each query attends to its row's cached positions 0..its own.
    if (width <= kLoopWidth) {
      attend_one_by_one(qkv_p, keys, values, attn.data_ptr<float>(), position, row_p, width, n, num_heads,
                        head_dim, groups, qkv_dim, row_stride, head_stride, longest);
    } else {  // a rebuilt prefix: blocked products beat a dot product per query and position
      const int64_t key_len = longest + 1;
      at::Tensor q = qkv.narrow(1, 0, q_dim).view({batch, width, num_heads, head_dim}).transpose(1, 2);
      at::Tensor cached_k = k_cache.select(0, layer).narrow(2, 0, key_len).index_select(0, row_of).to(at::kFloat);
      at::Tensor cached_v = v_cache.select(0, layer).narrow(2, 0, key_len).index_select(0, row_of).to(at::kFloat);
      if (groups > 1) {
        cached_k = cached_k.repeat_interleave(groups, 1);
        cached_v = cached_v.repeat_interleave(groups, 1);
      }
      at::Tensor out = at::scaled_dot_product_attention(q, cached_k, cached_v, visible);  // [B, H, T, hd]
      attn.copy_(out.transpose(1, 2).reshape({n, q_dim}));
    }
    add_linear(x, attn.narrow(0, 0, n), w[4], by(1));
    rms_norm(x_p, w[1].data_ptr<float>(), h.data_ptr<float>(), n, d, eps);
    at::Tensor up = linear(h.narrow(0, 0, n), w[5], no_bias, by(2));  // [n, 2 * intermediate]: gate, then up
    const int64_t inner = up.size(1) / 2;
    at::Tensor act = at::empty({n, inner}, options);
    const float* up_p = up.data_ptr<float>();
    float* act_p = act.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < inner; ++j) {
        const float gate = up_p[i * 2 * inner + j];
        act_p[i * inner + j] = gate / (1.f + std::exp(-gate)) * up_p[i * 2 * inner + inner + j];
      }
    add_linear(x, act, w[6], by(3));
  }
  at::Tensor final_h = at::empty({batch, d}, options);
  for (int64_t b = 0; b < batch; ++b)
    rms_norm(x_p + (selected ? b : b * width + last_p[b]) * d, final_norm.data_ptr<float>(),
             final_h.data_ptr<float>() + b * d, 1, d, eps);
  // The LM head is the widest product (4096 columns here): oneDNN's bfloat16 pays from 16 rows.
  return linear(final_h, lm_head, no_bias, Weights16{!narrow.empty() && batch <= kNarrowRows ? &narrow.back() : nullptr,
                                                     !wide.empty() && batch >= kWideHeadRows ? &wide.back() : nullptr});
}

}  // namespace

// tokens [B, T] fed to cache rows rows [B] at positions start[b] + t (clamped to max_len - 1); returns
// the logits [B, V] after position last[b] of each row, or an empty tensor when last is empty. narrow:
// empty, or the bfloat16 copies of the products' weights, transposed (qkv, o, up, down per layer, then
// the LM head), for feeds of at most kNarrowRows tokens; wide: empty, or the same weights as bfloat16
// [m, k], for products of at least kWideRows rows (kWideHeadRows for the LM head).
at::Tensor draft_forward(const at::Tensor& tokens, const at::Tensor& start, const at::Tensor& last,
                         const at::Tensor& rows, std::vector<at::Tensor> layers, const at::Tensor& embed,
                         const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads,
                         int64_t num_kv_heads, double eps, std::vector<at::Tensor> narrow,
                         std::vector<at::Tensor> wide) {
  TORCH_CHECK(embed.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "specserve native draft: float32 weights and contiguous caches of one type only");
  if (k_cache.scalar_type() == at::kBFloat16)
    return forward_with_cache<at::BFloat16>(tokens, start, last, rows, layers, embed, final_norm, lm_head, cos, sin,
                                            k_cache, v_cache, num_heads, num_kv_heads, eps, narrow, wide);
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "specserve native draft: a float32 or bfloat16 cache only");
  return forward_with_cache<float>(tokens, start, last, rows, layers, embed, final_norm, lm_head, cos, sin, k_cache,
                                   v_cache, num_heads, num_kv_heads, eps, narrow, wide);
}

TORCH_LIBRARY(specserve_native, m) {
  m.def("draft_forward", &draft_forward);
}
