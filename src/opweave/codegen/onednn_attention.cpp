// Attention head by head: the "per-head" form of codegen/attention.py, compiled into the
// direct oneDNN module (appended to onednn_direct.cpp's text).
//
// softmax(scale * q k^T + mask) v for one (batch, head) pair is two small products with
// a softmax between, and its [lq, lk] scores fit in a core's L2 (ViT-B/16: 197 x 197,
// 152 KiB). The pairs are split over the thread team; each thread runs oneDNN's sgemm on
// its pair (single-threaded inside the team), the softmax on the scores while they are in
// cache, and writes its head of the result straight into [batch, lq, heads, dv]. The
// unfused form (two batched products through torch) made the scores and probabilities as
// two new tensors per call, ran the softmax as a pass of its own, and copied the result
// once more.
//
// In bf16 (flag 4: the form "per-head-bf16"), q, k, v and the result are bf16 (the mask
// stays float32: rounded, float32's lowest would become -inf and hide a row):
// each thread runs two oneDNN matmul primitives made once for one thread (sgemm has no
// bf16 sibling in oneDNN's C API), the scores accumulate and the softmax computes in
// float32, and the exps are rounded to bf16 for the second product (as torch's bf16
// kernel rounds its probabilities); each row of that product is divided by its sum of
// exps afterwards, dv values where the scores' row has lk.
//
// The softmax matches torch's: the row's maximum subtracted before exp; a row holding a
// NaN, or a +inf score, is NaN; a row whose scores are all -inf is NaN, or 0 where the
// caller asks (where a mask hides the row, as the unfused form does). exp is Cephes'
// polynomial, within 1 ulp of expf over softmax's arguments (0 below -87.3, where expf's
// result is subnormal).
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// (a namespace of its own: the module's other files share its anonymous one)
namespace per_head {

struct Attention {
  int64_t batch, heads, lq, lk, d, dv;
  int64_t q[3], k[3], v[3], mask[3];  // strides of batch, head and row; columns are dense
  float scale;
  bool masked, zero_hidden_rows;
  // bf16: one pair's two products, made for one thread (each thread runs its own pair)
  bool low = false;
  dnnl::matmul scores_product, output_product;
  dnnl::memory::desc q_md, k_md, scores_md, p_md, v_md, out_md;
  size_t scratch_bytes = 0;
  std::string impl;  // the products' oneDNN implementations
};

// A vector register of floats, in GCC's vector extensions: g++ 12 leaves the same loop
// over floats scalar (its ternaries become branches, and a float's conversion to int
// stops the vectorizer): 4.5x slower.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Floats __attribute__((vector_size(4 * kLanes)));
typedef int32_t Ints __attribute__((vector_size(4 * kLanes)));
typedef uint32_t Uints __attribute__((vector_size(4 * kLanes)));
typedef uint16_t Halves __attribute__((vector_size(2 * kLanes)));

// A lane-wise conversion (to int truncating, as static_cast does); a loop over lanes
// where the compiler lacks __builtin_convertvector (before GCC 9)
template <typename To, typename From>
inline To converted(From v) {
#if defined(__clang__) || __GNUC__ >= 9
  return __builtin_convertvector(v, To);
#else
  To out;
  for (int lane = 0; lane < kLanes; ++lane) out[lane] = v[lane];
  return out;
#endif
}

constexpr float kExpLow = -87.33654f;  // exp of less is subnormal: 0 here

// exp(x) for x <= 0 or NaN, lane by lane (softmax's arguments, less the row's maximum):
// Cephes' expf, within 1 ulp
inline Floats exp_nonpositive(Floats x) {
  const Floats low = kExpLow - Floats{}, zero = Floats{};
  Floats c = x > low ? x : low;  // (a NaN becomes `low` here: it is kept below)
  c = c < zero ? c : zero;
  // n = round(c / ln 2), in [-126, 0], and exp(c) = 2^n exp(c - n ln 2)
  const Ints n = converted<Ints>(c * 1.44269504088896341f - 0.5f);
  const Floats nf = converted<Floats>(n);
  Floats r = c - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  Floats p = 1.9875691500e-4f + zero;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Floats two_n = (Floats)((n + 127) << 23);
  const Floats y = x < low ? zero : p * two_n;
  return x != x ? x : y;
}

inline Floats load(const float* from) {
  Floats v;
  std::memcpy(&v, from, sizeof v);
  return v;
}

inline void store(float* to, Floats v) { std::memcpy(to, &v, sizeof v); }

// The `count` (<= kLanes) values at `from`, the rest of the vector `fill`
inline Floats load_part(const float* from, int64_t count, float fill) {
  Floats v = fill + Floats{};
  std::memcpy(&v, from, count * sizeof(float));
  return v;
}

// float32 -> bf16, lane by lane (onednn_direct.cpp's `rounded`)
inline Halves to_bf16(Floats v) {
  Uints bits;
  std::memcpy(&bits, &v, sizeof bits);
  return converted<Halves>(rounded(bits) >> 16);
}

// Adds the mask's row (if any) to `n` scores and returns their maximum: NaN where one is
// NaN. Whole vectors are read where they are; the last, partial one is padded with -inf.
float masked_maximum(float* __restrict x, const float* __restrict mask, int64_t n) {
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  if (mask) {
    for (int64_t j = 0; j < n; ++j) x[j] += mask[j];
  }
  Floats top = -__builtin_inff() + Floats{};
  Ints nan = Ints{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Floats value = load(x + j);
    top = value > top ? value : top;
    nan |= value != value;
  }
  if (tail) {
    const Floats value = load_part(x + whole, tail, -__builtin_inff());
    top = value > top ? value : top;
    nan |= value != value;
  }
  float most = -__builtin_inff();
  bool any_nan = false;
  for (int lane = 0; lane < kLanes; ++lane) {
    most = top[lane] > most ? top[lane] : most;
    any_nan |= nan[lane] != 0;
  }
  return any_nan ? __builtin_nanf("") : most;  // (a NaN row: every value NaN, as torch's)
}

// exp(x - most) of `n` scores, written back in place, or rounded to bf16 into `low` where
// it is given (the padding of the last vector gives 0); returns their sum
float exponentials(float* __restrict x, int64_t n, float most, uint16_t* __restrict low) {
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  Floats sums = Floats{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Floats e = exp_nonpositive(load(x + j) - most);
    if (low) {
      const Halves h = to_bf16(e);
      std::memcpy(low + j, &h, sizeof h);
    } else {
      store(x + j, e);
    }
    sums += e;
  }
  if (tail) {
    const Floats e = exp_nonpositive(load_part(x + whole, tail, -__builtin_inff()) - most);
    if (low) {
      const Halves h = to_bf16(e);
      std::memcpy(low + whole, &h, tail * sizeof(uint16_t));
    } else {
      std::memcpy(x + whole, &e, tail * sizeof(float));
    }
    sums += e;
  }
  float sum = 0.f;
  for (int lane = 0; lane < kLanes; ++lane) sum += sums[lane];
  return sum;
}

// One row of scores: softmax over `n` values plus the mask's row (or none), in place. A
// row the mask hides entirely is 0 where `zero_hidden`, else NaN (as torch's softmax).
void softmax_row(float* __restrict x, const float* __restrict mask, int64_t n,
                 bool zero_hidden) {
  const float most = masked_maximum(x, mask, n);
  if (zero_hidden && most == -__builtin_inff()) {
    std::memset(x, 0, n * sizeof(float));
    return;
  }
  const Floats inverse = 1.f / exponentials(x, n, most, nullptr) + Floats{};
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) store(x + j, load(x + j) * inverse);
  for (int64_t j = whole; j < n; ++j) x[j] *= inverse[0];
}

// The same row in bf16, its normalization left to the row's result: exp(x - max) rounded
// to bf16 into `low`, and the factor the row of `low`'s product with v is to be multiplied
// by (1 / their sum; 1 for a row hidden entirely, whose `low` is 0). Normalizing the
// result's dv values instead of the row's lk saves a pass over the scores.
float unnormalized_row(float* __restrict x, const float* __restrict mask, int64_t n,
                       bool zero_hidden, uint16_t* __restrict low) {
  const float most = masked_maximum(x, mask, n);
  if (zero_hidden && most == -__builtin_inff()) {
    std::memset(low, 0, n * sizeof(uint16_t));
    return 1.f;
  }
  return 1.f / exponentials(x, n, most, low);
}

// `n` float32 values times `factor`, rounded to bf16 into `out`
void scaled_to_bf16(const float* __restrict in, float factor, int64_t n,
                    uint16_t* __restrict out) {
  const int64_t whole = n / kLanes * kLanes, tail = n - whole;
  const Floats f = factor + Floats{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Halves h = to_bf16(load(in + j) * f);
    std::memcpy(out + j, &h, sizeof h);
  }
  if (tail) {
    const Halves h = to_bf16(load_part(in + whole, tail, 0.f) * f);
    std::memcpy(out + whole, &h, tail * sizeof(uint16_t));
  }
}

// One pair's scores, per thread, kept for the next call (no larger than the 16 MiB the
// Python side lets a whole attention's scores take: attention.UNFUSED_BYTES)
std::vector<float>& scores_buffer(size_t elements) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < elements) buffer.resize(elements);
  return buffer;
}

// ... its exps in bf16, and its q, k and v rows gathered where they are strided
std::vector<uint16_t>& bf16_buffer(size_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (buffer.size() < elements) buffer.resize(elements);
  return buffer;
}

// `rows` rows of `length` values `stride` apart, dense at `to`; `from` itself if dense
const uint16_t* gathered(const uint16_t* from, int64_t rows, int64_t length, int64_t stride,
                         uint16_t* to) {
  if (stride == length || rows == 1) return from;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(to + r * length, from + r * stride, length * sizeof(uint16_t));
  }
  return to;
}

// One (batch, head) pair in bf16: scores = scale * q k^T in float32, exp(scores - max)
// rounded to bf16, times v in float32, each row divided by its sum of exps and rounded
// to bf16 into the pair's head of `out`. Runs on the calling thread alone.
void attend_pair_bf16(const Attention& a, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v, const float* mask_rows, uint16_t* out) {
  using dnnl::memory;
  thread_local dnnl::stream stream(cpu());
  // the scores, then (once the exps are taken) the rows of the product with v
  float* scores = scores_buffer(a.lq * std::max(a.lk, a.dv) + a.lq).data();
  float* factors = scores + a.lq * std::max(a.lk, a.dv);
  // oneDNN runs its brgemm kernels (AVX-512 BF16 or AMX) only on dense operands, and a
  // slower gemm on a head's strided rows (2x slower for the scores on a Zen 4): the
  // pair's rows are gathered first (ViT-B/16: 75 KiB)
  uint16_t* exps = bf16_buffer(a.lq * a.lk + (a.lq + a.lk) * a.d + a.lk * a.dv).data();
  uint16_t* rows = exps + a.lq * a.lk;
  q = gathered(q, a.lq, a.d, a.q[2], rows);
  k = gathered(k, a.lk, a.d, a.k[2], rows + a.lq * a.d);
  v = gathered(v, a.lk, a.dv, a.v[2], rows + (a.lq + a.lk) * a.d);
  auto& pad = scratchpad(a.scratch_bytes);
  const memory scratch({{static_cast<int64_t>(a.scratch_bytes)}, memory::data_type::u8,
                        memory::format_tag::a}, cpu(), pad.data());
  auto at = [](const memory::desc& md, const void* data) {
    return memory(md, cpu(), const_cast<void*>(data));
  };
  a.scores_product.execute(stream, {{DNNL_ARG_SRC, at(a.q_md, q)},
                                    {DNNL_ARG_WEIGHTS, at(a.k_md, k)},
                                    {DNNL_ARG_DST, at(a.scores_md, scores)},
                                    {DNNL_ARG_SCRATCHPAD, scratch}});
  stream.wait();  // (a no-op with OpenMP, where execution is synchronous)
  for (int64_t r = 0; r < a.lq; ++r) {
    factors[r] = unnormalized_row(scores + r * a.lk,
                                  mask_rows ? mask_rows + r * a.mask[2] : nullptr, a.lk,
                                  a.zero_hidden_rows, exps + r * a.lk);
  }
  a.output_product.execute(stream, {{DNNL_ARG_SRC, at(a.p_md, exps)},
                                    {DNNL_ARG_WEIGHTS, at(a.v_md, v)},
                                    {DNNL_ARG_DST, at(a.out_md, scores)},
                                    {DNNL_ARG_SCRATCHPAD, scratch}});
  stream.wait();
  for (int64_t r = 0; r < a.lq; ++r) {
    scaled_to_bf16(scores + r * a.dv, factors[r], a.dv, out + r * a.heads * a.dv);
  }
}

void attend_bf16(const Attention& a, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                 const float* mask, uint16_t* out) {
  const int64_t pairs = a.batch * a.heads;
  int failures = 0;
  // (always within the team, even for one pair: the products were made for one thread,
  // which is what oneDNN gives a primitive called inside a parallel region)
#pragma omp parallel for schedule(static) reduction(+ : failures)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / a.heads, h = pair % a.heads;
    try {
      attend_pair_bf16(a, q + b * a.q[0] + h * a.q[1], k + b * a.k[0] + h * a.k[1],
                       v + b * a.v[0] + h * a.v[1],
                       a.masked ? mask + b * a.mask[0] + h * a.mask[1] : nullptr,
                       out + b * a.lq * a.heads * a.dv + h * a.dv);
    } catch (const std::exception&) {
      ++failures;
    }
  }
  if (failures) {  // (as `attend`)
    std::fprintf(stderr, "opweave: a per-head bf16 attention's product failed\n");
    std::abort();
  }
}

// The bf16 products of one pair, made for one thread, on dense operands (`gathered`):
// q [lq, d] times k^T [d, lk] (k's rows read as columns) into float32 scores, scaled;
// bf16 exps [lq, lk] times v [lk, dv] into float32 [lq, dv], normalized and rounded
// afterwards.
void make_bf16_products(Attention& a) {
  using dnnl::memory;
  using dt = memory::data_type;
  a.q_md = memory::desc({a.lq, a.d}, dt::bf16, memory::dims{a.d, 1});
  a.k_md = memory::desc({a.d, a.lk}, dt::bf16, memory::dims{1, a.d});
  a.scores_md = memory::desc({a.lq, a.lk}, dt::f32, memory::dims{a.lk, 1});
  a.p_md = memory::desc({a.lq, a.lk}, dt::bf16, memory::dims{a.lk, 1});
  a.v_md = memory::desc({a.lk, a.dv}, dt::bf16, memory::dims{a.dv, 1});
  a.out_md = memory::desc({a.lq, a.dv}, dt::f32, memory::dims{a.dv, 1});
  dnnl::post_ops scaled;
  scaled.append_eltwise(dnnl::algorithm::eltwise_linear, a.scale, 0.f);
  dnnl::primitive_attr scores_attr, output_attr;
  scores_attr.set_post_ops(scaled);
  for (auto* attr : {&scores_attr, &output_attr}) {
    attr->set_scratchpad_mode(dnnl::scratchpad_mode::user);
  }
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);  // each pair runs on one thread of the team
  try {
    dnnl::matmul::primitive_desc scores_pd(cpu(), a.q_md, a.k_md, a.scores_md, scores_attr);
    dnnl::matmul::primitive_desc output_pd(cpu(), a.p_md, a.v_md, a.out_md, output_attr);
    a.impl = std::string(scores_pd.impl_info_str()) + ", " + output_pd.impl_info_str();
    a.scratch_bytes = std::max(scores_pd.scratchpad_desc().get_size(),
                               output_pd.scratchpad_desc().get_size());
    a.scores_product = dnnl::matmul(scores_pd);
    a.output_product = dnnl::matmul(output_pd);
  } catch (...) {
    omp_set_num_threads(threads);
    throw;
  }
  omp_set_num_threads(threads);
  if (a.impl.rfind("ref", 0) == 0 || a.impl.find(", ref") != std::string::npos) {
    throw std::invalid_argument("oneDNN has only its reference bf16 matmul here (" + a.impl +
                                ")");
  }
}

void attend(const Attention& a, const float* q, const float* k, const float* v,
            const float* mask, float* out) {
  const int64_t pairs = a.batch * a.heads;
  int failures = 0;
#pragma omp parallel for schedule(static) reduction(+ : failures) if (pairs > 1)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / a.heads, h = pair % a.heads;
    float* scores = scores_buffer(a.lq * a.lk).data();
    // scores = scale * q k^T, row-major (k's rows are its keys)
    failures += dnnl_sgemm('N', 'T', a.lq, a.lk, a.d, a.scale, q + b * a.q[0] + h * a.q[1],
                           a.q[2], k + b * a.k[0] + h * a.k[1], a.k[2], 0.f, scores,
                           a.lk) != dnnl_success;
    const float* mask_rows = a.masked ? mask + b * a.mask[0] + h * a.mask[1] : nullptr;
    for (int64_t r = 0; r < a.lq; ++r) {
      softmax_row(scores + r * a.lk, mask_rows ? mask_rows + r * a.mask[2] : nullptr, a.lk,
                  a.zero_hidden_rows);
    }
    // out[b, :, h, :] = probabilities v, rows of heads * dv
    failures += dnnl_sgemm('N', 'N', a.lq, a.dv, a.lk, 1.f, scores, a.lk,
                           v + b * a.v[0] + h * a.v[1], a.v[2], 0.f,
                           out + b * a.lq * a.heads * a.dv + h * a.dv,
                           a.heads * a.dv) != dnnl_success;
  }
  // arguments checked at creation do not fail; if they do, stopping is better than
  // returning a result that was never written (as the module's other calls do)
  if (failures) {
    std::fprintf(stderr, "opweave: a per-head attention's sgemm failed\n");
    std::abort();
  }
}

}  // namespace per_head

extern "C" {

// geometry: batch, heads, lq, lk, d, dv, then the strides (elements) of batch, head and
// row of q, k, v and the mask (0 for a broadcast dimension; ignored without a mask); the
// last dimension of each is dense. flags: 1 a mask is given, 2 a row it hides entirely is
// 0 (not NaN), 4 bf16 operands and result (else float32; the mask is float32 in both).
void* ow_attention_create(const int64_t* geometry, float scale, int flags, char* error,
                          int error_size) {
  try {
    auto a = std::make_unique<per_head::Attention>();
    a->batch = geometry[0], a->heads = geometry[1], a->lq = geometry[2], a->lk = geometry[3];
    a->d = geometry[4], a->dv = geometry[5];
    for (int i = 0; i < 3; ++i) {
      a->q[i] = geometry[6 + i], a->k[i] = geometry[9 + i], a->v[i] = geometry[12 + i];
      a->mask[i] = geometry[15 + i];
    }
    a->scale = scale, a->masked = flags & 1, a->zero_hidden_rows = flags & 2;
    if (a->batch < 1 || a->heads < 1 || a->lq < 1 || a->lk < 1 || a->d < 1 || a->dv < 1) {
      throw std::invalid_argument("empty attention");
    }
    if (a->q[2] < a->d || a->k[2] < a->d || a->v[2] < a->dv) {  // what sgemm reads
      throw std::invalid_argument("rows of q, k or v closer than their length");
    }
    a->low = flags & 4;
    if (a->low) per_head::make_bf16_products(*a);
    return a.release();
  } catch (const std::exception& err) {
    message(error, error_size, err.what());
    return nullptr;
  }
}

void ow_attention_destroy(void* handle) { delete static_cast<per_head::Attention*>(handle); }

// args: destination [batch, lq, heads, dv], q, k, v, the handle (an int64 holding the
// Attention's address), then the mask if one is given.
void ow_attention_run(void** args) {
  const auto& a = *reinterpret_cast<per_head::Attention*>(*static_cast<int64_t*>(args[4]));
  if (a.low) {
    const auto* mask = a.masked ? static_cast<const float*>(args[5]) : nullptr;
    per_head::attend_bf16(a, static_cast<const uint16_t*>(args[1]),
                          static_cast<const uint16_t*>(args[2]),
                          static_cast<const uint16_t*>(args[3]), mask,
                          static_cast<uint16_t*>(args[0]));
    return;
  }
  const auto* mask = a.masked ? static_cast<const float*>(args[5]) : nullptr;
  per_head::attend(a, static_cast<const float*>(args[1]), static_cast<const float*>(args[2]),
                   static_cast<const float*>(args[3]), mask, static_cast<float*>(args[0]));
}

// The oneDNN implementations a bf16 attention's products run on ("" in float32)
const char* ow_attention_impl(void* handle) {
  return static_cast<per_head::Attention*>(handle)->impl.c_str();
}

}  // extern "C"
