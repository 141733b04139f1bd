// The Llama-style draft's forward in one native call, for float32 on CPU: the same arithmetic as
// plugin/draft_model.py's DraftModel.forward (its docstring holds the contract), with the matrix
// products left to ATen and everything between them (norms, rotary positions, the cache writes,
// attention over each row's cached prefix, SwiGLU) as plain loops. A small draft decoding a few tokens
// is bound by per-operation overhead, not arithmetic: about 60 PyTorch calls a forward from Python cost
// more than its products; here a forward makes nine.
//
// A narrow feed (a few rows of one token: decoding at a small batch) is bound by reading the weights,
// and an engine step reads them cold (the target's forward before it streams its own, several times
// the cache). For those the products read a bfloat16 copy of the weights, half the bytes, and compute
// in float32: given only where the weights are exactly bfloat16 values (a bfloat16 checkpoint), so
// that the arithmetic is the same as float32's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPerLayer = 7;  // in_norm, post_norm, qkv, qkv bias (empty: none), o, up, down
constexpr int64_t kLoopWidth = 4;  // feeds of up to this many tokens per row attend query by query
constexpr int64_t kNarrowRows = 16;  // feeds of up to this many tokens in all take the bfloat16 products
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

// input [n, k] . weight [m, k] transposed (+ bias, when not empty), as a new [n, m]: through the bfloat16
// copy when one is given, else ATen's float32 product.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor* copy) {
  if (!copy) return bias.numel() ? at::addmm(bias, input, weight.t()) : at::mm(input, weight.t());
  at::Tensor out = at::empty({input.size(0), weight.size(0)}, input.options());
  linear_bf16(input.data_ptr<float>(), *copy, bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(),
              input.size(0), input.size(1), weight.size(0), false);
  return out;
}

// x [n, m] += input [n, k] . weight [m, k] transposed, the same two ways.
void add_linear(at::Tensor& x, const at::Tensor& input, const at::Tensor& weight, const at::Tensor* copy) {
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

// The attention of each of n queries (head by head) over its row's cached positions 0..its own: a dot
// product per position, for feeds of a token or two per row, where blocked products cost more in setup.
void attend_one_by_one(const float* qkv, const float* keys, const float* values, float* attn,
                       const std::vector<int64_t>& position, const int64_t* row_of, int64_t width, int64_t n,
                       int64_t num_heads, int64_t head_dim, int64_t groups, int64_t qkv_dim, int64_t row_stride,
                       int64_t head_stride, int64_t longest) {
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const int64_t q_dim = num_heads * head_dim;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / ((longest + 1) * head_dim));  // threads only for chunks worth one
  at::parallel_for(0, n * num_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> score;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / num_heads, head = job % num_heads, pos = position[i];
      const float* q = qkv + i * qkv_dim + head * head_dim;
      const int64_t base = row_of[i / width] * row_stride + (head / groups) * head_stride;
      score.resize(pos + 1);
      float top = -INFINITY;
      for (int64_t p = 0; p <= pos; ++p) {
        const float* key = keys + base + p * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < head_dim; ++j) dot += q[j] * key[j];
        score[p] = dot * scale;
        top = std::max(top, score[p]);
      }
      float total = 0.f;
      for (int64_t p = 0; p <= pos; ++p) total += (score[p] = std::exp(score[p] - top));
      float* out = attn + i * q_dim + head * head_dim;
      std::fill_n(out, head_dim, 0.f);
      for (int64_t p = 0; p <= pos; ++p) {
        const float weight = score[p] / total;
        const float* value = values + base + p * head_dim;
#pragma omp simd
        for (int64_t j = 0; j < head_dim; ++j) out[j] += weight * value[j];
      }
    }
  });
}

}  // namespace

// tokens [B, T] fed to cache rows rows [B] at positions start[b] + t (clamped to max_len - 1); returns
// the logits [B, V] after position last[b] of each row, or an empty tensor when last is empty. narrow:
// empty, or the bfloat16 copies of the products' weights, transposed (qkv, o, up, down per layer, then
// the LM head), for feeds of at most kNarrowRows tokens.
at::Tensor draft_forward(const at::Tensor& tokens, const at::Tensor& start, const at::Tensor& last,
                         const at::Tensor& rows, std::vector<at::Tensor> layers, const at::Tensor& embed,
                         const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads,
                         int64_t num_kv_heads, double eps, std::vector<at::Tensor> narrow) {
  TORCH_CHECK(embed.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "specserve native draft: float32 weights and contiguous caches only");
  at::InferenceMode guard;
  // Index tensors of any integer type (vLLM's token ids are int32).
  const auto tok = tokens.to(at::kLong).contiguous(), first = start.to(at::kLong).contiguous();
  const auto row_of = rows.to(at::kLong).contiguous();
  const int64_t batch = tok.size(0), width = tok.size(1), n = batch * width;
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
  TORCH_CHECK(narrow.empty() || static_cast<int64_t>(narrow.size()) == 4 * num_layers + 1,
              "specserve native draft: 4 bfloat16 products a layer and the LM head, or none");
  const bool use_narrow = !narrow.empty() && n <= kNarrowRows;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layers.data() + layer * kPerLayer;
    rms_norm(x_p, w[0].data_ptr<float>(), h.data_ptr<float>(), n, d, eps);
    const at::Tensor* w16 = use_narrow ? narrow.data() + layer * 4 : nullptr;  // qkv, o, up, down
    at::Tensor qkv = linear(h, w[2], w[3], w16);  // [n, qkv_dim]
    float* qkv_p = qkv.data_ptr<float>();
    float* keys = k_cache.data_ptr<float>() + layer * layer_stride;
    float* values = v_cache.data_ptr<float>() + layer * layer_stride;
    // Rotate q and k, and write every fed token's keys and values before any query reads the cache.
    for (int64_t i = 0; i < n; ++i) {
      float* token = qkv_p + i * qkv_dim;
      const int64_t pos = position[i], cache_row = row_p[i / width];
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head)
        rotate(token + head * head_dim, cos_p + pos * head_dim, sin_p + pos * head_dim, head_dim);
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        const int64_t offset = cache_row * row_stride + kv * head_stride + pos * head_dim;
        std::copy_n(token + q_dim + kv * head_dim, head_dim, keys + offset);
        std::copy_n(token + q_dim + kv_dim + kv * head_dim, head_dim, values + offset);
      }
    }
    // Each query attends to its row's cached positions 0..its own.
    if (width <= kLoopWidth) {
      attend_one_by_one(qkv_p, keys, values, attn.data_ptr<float>(), position, row_p, width, n, num_heads,
                        head_dim, groups, qkv_dim, row_stride, head_stride, longest);
    } else {  // a rebuilt prefix: blocked products beat a dot product per query and position
      const int64_t key_len = longest + 1;
      at::Tensor q = qkv.narrow(1, 0, q_dim).view({batch, width, num_heads, head_dim}).transpose(1, 2);
      at::Tensor cached_k = k_cache.select(0, layer).narrow(2, 0, key_len).index_select(0, row_of);
      at::Tensor cached_v = v_cache.select(0, layer).narrow(2, 0, key_len).index_select(0, row_of);
      if (groups > 1) {
        cached_k = cached_k.repeat_interleave(groups, 1);
        cached_v = cached_v.repeat_interleave(groups, 1);
      }
      at::Tensor out = at::scaled_dot_product_attention(q, cached_k, cached_v, visible);  // [B, H, T, hd]
      attn.copy_(out.transpose(1, 2).reshape({n, q_dim}));
    }
    add_linear(x, attn, w[4], w16 ? w16 + 1 : nullptr);
    rms_norm(x_p, w[1].data_ptr<float>(), h.data_ptr<float>(), n, d, eps);
    at::Tensor up = linear(h, w[5], no_bias, w16 ? w16 + 2 : nullptr);  // [n, 2 * intermediate]: gate, then up
    const int64_t inner = up.size(1) / 2;
    at::Tensor act = at::empty({n, inner}, options);
    const float* up_p = up.data_ptr<float>();
    float* act_p = act.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < inner; ++j) {
        const float gate = up_p[i * 2 * inner + j];
        act_p[i * inner + j] = gate / (1.f + std::exp(-gate)) * up_p[i * 2 * inner + inner + j];
      }
    add_linear(x, act, w[6], w16 ? w16 + 3 : nullptr);
  }
  if (last.numel() == 0) return at::empty({0}, options);
  const auto last_c = last.to(at::kLong).contiguous();
  const int64_t* last_p = last_c.data_ptr<int64_t>();
  at::Tensor final_h = at::empty({batch, d}, options);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(last_p[b] >= 0 && last_p[b] < width, "specserve native draft: last out of range");
    rms_norm(x_p + (b * width + last_p[b]) * d, final_norm.data_ptr<float>(),
             final_h.data_ptr<float>() + b * d, 1, d, eps);
  }
  const bool narrow_head = !narrow.empty() && batch <= kNarrowRows;
  return linear(final_h, lm_head, no_bias, narrow_head ? &narrow.back() : nullptr);
}

TORCH_LIBRARY(specserve_native, m) {
  m.def("draft_forward", &draft_forward);
}
