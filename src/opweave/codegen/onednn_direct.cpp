// Convolutions and linear layers on oneDNN's own library, called directly
// (codegen/onednn_direct.py).
//
// torch's `mkldnn._convolution_pointwise` builds oneDNN's primitive descriptor again at
// every call. Here a primitive is made once, with its weights reordered into the layout it
// asked for, and a call only wraps the caller's pointers.
//
// Convolutions read and write channels-last (NHWC) float32 (bf16 in mode 2), as everywhere
// in opweave's convolutions; linear layers row-major [M, K] x [K, N]. The C interface is for ctypes;
// `ow_onednn_run` has the generated kernels' signature (`void(void**)`), so the native plan
// calls it like one of them.
//
// A oneDNN primitive is made for the thread count of its creation (its work split and
// scratchpad follow it). A call under another count (torch.set_num_threads after
// compiling) gets a primitive made for that count, once, its weights reordered from the
// first one's where it asks for another layout.
//
// bf16x3 (Henry, Tang and Heinecke, ARITH'19): a float32 operand x is split into three
// bfloat16 parts, x0 = bf16(x), x1 = bf16(x - x0), x2 = bf16(x - x0 - x1), which hold its
// 24 significant bits; of the nine cross products of two split operands, the six largest
// (i + j <= 2) carry float32's accuracy. They are one bf16 product with a float32 result
// over a six times longer reduction: the source's parts laid side by side as
// [x2 x1 x0 x1 x0 x0] (per group, for a grouped convolution) against the weight's
// [w0 w1 w2 w0 w1 w0] (made by the caller). The smallest products come first: oneDNN sums
// the reduction in order, so they are added while the sum is still small, and rounding it
// costs what float32's own sum does (with the largest first, 1.5-3x float32's error). A
// call splits its float32 source into a per-thread buffer, then runs the bf16 primitive.
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using dnnl::memory;
using tag = memory::format_tag;

dnnl::engine& cpu() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A binary epilogue: none, the residual added into the destination in place (oneDNN's
// sum post-op), or a residual operand added into a new destination (binary add).
enum Binary { kNone = 0, kSumInPlace = 1, kAdd = 2 };

// One primitive for one thread count, with the weights in the layout it reads.
struct Variant {
  dnnl::primitive primitive;
  memory weights;
  memory::desc scratch;
};

struct Primitive {
  virtual ~Primitive() = default;  // a Winograd convolution (onednn_winograd.cpp) is one too
  // makes a Variant for the calling thread's thread count from weights laid out as
  // `packed` (copied: `packed` may be the caller's memory)
  std::function<Variant(const memory& packed)> build;
  Variant first;
  int threads = 0;  // the thread count `first` was made for
  std::mutex lock;
  std::unordered_map<int, Variant> others;  // by thread count; references stay valid
  memory::desc src, dst, residual;
  memory bias;
  int binary = kNone;
  std::string impl;
  // bf16x3: the float32 source is [rows, groups * width] and the primitive reads its
  // parts as bf16 [rows, groups * 6 * width]; rows == 0 for a float32 primitive
  int64_t rows = 0, groups = 1, width = 0;
  // int8: the weights as the caller gave them (a primitive for another thread count is
  // made from them: oneDNN's int8 layouts carry compensation terms that are not
  // reordered between layouts), and the scales and zero points handed to every call
  memory plain;
  std::vector<std::pair<int, memory>> quantization;
  bool dynamic = false;  // int8: the source's scale and zero point come with each call

  void set_split(int64_t source_rows, int64_t source_groups, int64_t group_width) {
    rows = source_rows, groups = source_groups, width = group_width;
  }

  const Variant& for_threads(int n) {
    if (n == threads) return first;
    std::lock_guard<std::mutex> guard(lock);
    auto found = others.find(n);
    if (found == others.end()) found = others.emplace(n, build(plain ? plain : first.weights)).first;
    return found->second;
  }
};

// What a primitive reads and writes (the create functions' `mode`)
enum Mode { kFloat32 = 1, kBf16 = 2, kBf16x3 = 3, kInt8 = 4 };

int checked_mode(int mode) {
  if (mode < kFloat32 || mode > kInt8) {
    throw std::invalid_argument("mode must be 1 (float32), 2 (bf16), 3 (bf16x3) or 4 (int8)");
  }
  return mode;
}

// An int8 primitive's quantization, from the create functions' `quant`: {source scale,
// source zero point, destination scale, destination zero point, flags (1: the destination
// is uint8 codes, else float32; 2: the source's scale and zero point come with each call,
// dynamic quantization), the accumulator's scale and zero point (the in-place sum's: the
// residual's codes, or 1 and 0 for float32), then one weight scale per output channel}.
struct Quantization {
  float src_scale, dst_scale, sum_scale;
  int32_t src_zero, dst_zero, sum_zero;
  bool codes, dynamic;
  std::vector<float> weight_scales;

  Quantization(const float* quant, int64_t outputs)
      : src_scale(quant[0]), dst_scale(quant[2]), sum_scale(quant[5]),
        src_zero(static_cast<int32_t>(quant[1])), dst_zero(static_cast<int32_t>(quant[3])),
        sum_zero(static_cast<int32_t>(quant[6])), codes(static_cast<int>(quant[4]) & 1),
        dynamic(static_cast<int>(quant[4]) & 2), weight_scales(quant + 7, quant + 7 + outputs) {
    if (!((src_scale > 0.f || dynamic) && dst_scale > 0.f && sum_scale > 0.f)) {
      throw std::invalid_argument("int8 scales must be positive");
    }
    if (dynamic && codes) {
      throw std::invalid_argument("a dynamically quantized source makes a float32 result");
    }
  }

  // the attributes' scales and zero points; `weight_mask`: the weight's output-channel axes
  void describe(dnnl::primitive_attr& attr, int weight_mask) const {
    attr.set_scales_mask(DNNL_ARG_SRC, 0);
    attr.set_scales_mask(DNNL_ARG_WEIGHTS, weight_mask);
    attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
    if (codes) {
      attr.set_scales_mask(DNNL_ARG_DST, 0);
      attr.set_zero_points_mask(DNNL_ARG_DST, 0);
    }
  }

  // the runtime arguments matching `describe`
  std::vector<std::pair<int, memory>> arguments() const {
    std::vector<std::pair<int, memory>> found;
    auto scalar = [&](int arg, const void* value, memory::data_type type) {
      memory m({{1}, type, tag::a}, cpu());
      std::memcpy(m.get_data_handle(), value, 4);
      found.emplace_back(arg, m);
    };
    if (!dynamic) {  // (else given at each call: `execute`)
      scalar(DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, &src_scale, memory::data_type::f32);
      scalar(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, &src_zero, memory::data_type::s32);
    }
    memory scales({{static_cast<int64_t>(weight_scales.size())}, memory::data_type::f32, tag::a},
                  cpu());
    std::memcpy(scales.get_data_handle(), weight_scales.data(), weight_scales.size() * 4);
    found.emplace_back(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, scales);
    if (codes) {
      scalar(DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, &dst_scale, memory::data_type::f32);
      scalar(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, &dst_zero, memory::data_type::s32);
    }
    return found;
  }
};

void message(char* out, int size, const std::string& text) {
  if (out && size > 0) {
    std::snprintf(out, size, "%s", text.c_str());
  }
}

dnnl::algorithm eltwise(int unary) {
  switch (unary) {
    case 1: return dnnl::algorithm::eltwise_relu;
    case 2: return dnnl::algorithm::eltwise_tanh;
    case 3: return dnnl::algorithm::eltwise_logistic;
    case 4: return dnnl::algorithm::eltwise_gelu_erf;
    case 5: return dnnl::algorithm::eltwise_gelu_tanh;
    case 6: return dnnl::algorithm::eltwise_clip;  // ReLU6: clip to [0, 6]
  }
  throw std::invalid_argument("unknown unary epilogue " + std::to_string(unary));
}

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// A float's bits rounded to bf16 (to nearest, ties to even, as oneDNN and torch convert;
// a NaN stays a quiet NaN), in the top half; of one float, or lane by lane of a vector of
// them (GCC's vector extensions: onednn_attention.cpp)
template <typename Bits>
inline Bits rounded(Bits bits) {
  const Bits nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const Bits quiet = (bits | 0x00400000u) & 0xffff0000u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet : nearest;
}

// What is left of `x` after its bf16 part `part`; 0 after an infinite or NaN part (such a
// value is all in its first part: its rest would be NaN)
inline float rest_after(float x, uint32_t part) {
  return (part & 0x7f800000u) != 0x7f800000u ? x - float_of(part) : 0.f;
}

// `width` values' parts in six slots [x2 x1 x0 x1 x0 x0] of `width` each. An infinite or
// NaN value (all in its first part) stays only in the slot that meets the weight's first
// part: against w1 or w2 (0 or of either sign) it would make NaN where float32 gives inf.
void split_block(const float* __restrict in, uint16_t* __restrict out, int64_t width) {
  uint16_t* __restrict s0 = out;
  uint16_t* __restrict s1 = out + width;
  uint16_t* __restrict s2 = out + 2 * width;
  uint16_t* __restrict s3 = out + 3 * width;
  uint16_t* __restrict s4 = out + 4 * width;
  uint16_t* __restrict s5 = out + 5 * width;
  // (without the pragma g++ 12 leaves this loop scalar: 5x slower)
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float x = in[i];
    const uint32_t p0 = rounded(bits_of(x));
    const float r0 = rest_after(x, p0);
    const uint32_t p1 = rounded(bits_of(r0));
    const uint32_t p2 = rounded(bits_of(rest_after(r0, p1)));
    const uint16_t x0 = p0 >> 16, x1 = p1 >> 16, x2 = p2 >> 16;
    const uint16_t x0_crossed = (p0 & 0x7f800000u) != 0x7f800000u ? x0 : 0;
    s0[i] = x2, s1[i] = x1, s2[i] = x0_crossed, s3[i] = x1, s4[i] = x0_crossed, s5[i] = x0;
  }
}

// A source [rows, groups * width] split for bf16x3, each group's block on its own
void split(const float* in, uint16_t* out, int64_t rows, int64_t groups, int64_t width) {
  const int64_t blocks = rows * groups;
  // one thread for small sources: the team's wake-up costs more than it saves there
#pragma omp parallel for schedule(static) if (blocks * width >= (1 << 15))
  for (int64_t b = 0; b < blocks; ++b) split_block(in + b * width, out + 6 * b * width, width);
}

std::vector<uint16_t>& split_buffer(size_t elements) {
  thread_local std::vector<uint16_t> buffer;  // per thread, as the scratchpad
  if (buffer.size() < elements) buffer.resize(elements);
  return buffer;
}

std::vector<char>& scratchpad(size_t bytes) {
  // per thread, so steps that run concurrently (inter-operator schedules) never share one
  thread_local std::vector<char> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer;
}

dnnl::primitive_attr attributes(int unary, int binary, const memory::desc& dst,
                                const Quantization* quant = nullptr, int weight_mask = 0) {
  dnnl::post_ops ops;
  if (binary == kSumInPlace) {
    if (quant) {
      ops.append_sum(quant->sum_scale, quant->sum_zero);
    } else {
      ops.append_sum(1.f);
    }
  } else if (binary == kAdd) {
    ops.append_binary(dnnl::algorithm::binary_add, dst);
  } else if (binary != kNone) {
    throw std::invalid_argument("unknown binary epilogue " + std::to_string(binary));
  }
  if (unary != 0) ops.append_eltwise(eltwise(unary), 0.f, unary == 6 ? 6.f : 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (quant) quant->describe(attr, weight_mask);
  return attr;
}

// The primitive `describe()` describes, for this thread's thread count, with the caller's
// weights (laid out as `given`) reordered into the layout it asked for, and its bias.
template <typename Kind, typename Made = Primitive, typename Describe>
Made* finish(Describe describe, const memory::desc& given, const void* weight,
             const float* bias, int64_t outputs, int binary,
             const Quantization* quant = nullptr) {
  auto made = std::make_unique<Made>();
  made->build = [describe](const memory& packed) {
    auto pd = describe();
    Variant variant{Kind(pd), memory(pd.weights_desc(), cpu()), pd.scratchpad_desc()};
    dnnl::stream stream(cpu());
    memory from = packed;  // a handle: the same memory
    dnnl::reorder(from, variant.weights).execute(stream, from, variant.weights);
    stream.wait();
    return variant;
  };
  auto pd = describe();
  made->threads = omp_get_max_threads();
  made->first = made->build(memory(given, cpu(), const_cast<void*>(weight)));
  made->src = pd.src_desc();
  made->dst = pd.dst_desc();
  made->residual = pd.dst_desc();
  made->binary = binary;
  made->impl = pd.impl_info_str();
  if (bias) {
    made->bias = memory(pd.bias_desc(), cpu());
    std::memcpy(made->bias.get_data_handle(), bias, outputs * sizeof(float));
  }
  if (quant) {
    made->plain = memory(given, cpu());
    std::memcpy(made->plain.get_data_handle(), weight, given.get_size());
    made->quantization = quant->arguments();
    made->dynamic = quant->dynamic;
  }
  return made.release();
}

// Runs `call`'s primitive for this thread count from `source` into `destination`, with
// `residual` as the binary add's operand (null without one), and, for a dynamically
// quantized int8 source, its scale and zero point.
void execute(Primitive& call, void* source, void* destination, void* residual,
             float source_scale = 1.f, int32_t source_zero = 0) {
  const Variant& variant = call.for_threads(omp_get_max_threads());
  dnnl::stream stream(cpu());
  auto& pad = scratchpad(variant.scratch.get_size());
  std::unordered_map<int, memory> io = {
      {DNNL_ARG_SRC, memory(call.src, cpu(), source)},
      {DNNL_ARG_WEIGHTS, variant.weights},
      {DNNL_ARG_DST, memory(call.dst, cpu(), destination)},
      {DNNL_ARG_SCRATCHPAD, memory(variant.scratch, cpu(), pad.data())}};
  if (call.bias) io[DNNL_ARG_BIAS] = call.bias;
  if (residual) io[DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1] =
      memory(call.residual, cpu(), residual);
  for (const auto& [arg, value] : call.quantization) io[arg] = value;
  if (call.dynamic) {
    io[DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC] =
        memory({{1}, memory::data_type::f32, tag::a}, cpu(), &source_scale);
    io[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC] =
        memory({{1}, memory::data_type::s32, tag::a}, cpu(), &source_zero);
  }
  variant.primitive.execute(stream, io);
  stream.wait();
}

// The data types of a mode's source, weight and result, and its quantization (int8).
struct Types {
  memory::data_type source, weight, result;
  std::unique_ptr<Quantization> quant;
};

Types data_types(int mode, const float* quant, int64_t outputs) {
  using dt = memory::data_type;
  switch (mode) {
    case kFloat32: return {dt::f32, dt::f32, dt::f32, nullptr};
    case kBf16: return {dt::bf16, dt::bf16, dt::bf16, nullptr};
    case kBf16x3: return {dt::bf16, dt::bf16, dt::f32, nullptr};
  }
  if (!quant) throw std::invalid_argument("an int8 primitive needs its quantization");
  auto q = std::make_unique<Quantization>(quant, outputs);
  const dt result = q->codes ? dt::u8 : dt::f32;
  return {dt::u8, dt::s8, result, std::move(q)};
}

// A primitive made and checked at compile time does not fail on valid pointers; if it
// does, stopping is better than returning a tensor that was never written.
[[noreturn]] void failed(const Primitive& call, const std::exception& err) {
  std::fprintf(stderr, "opweave: a direct oneDNN call (%s) failed: %s\n", call.impl.c_str(),
               err.what());
  std::abort();
}

}  // namespace

extern "C" {

const char* ow_key() { return OPWEAVE_ONEDNN_KEY; }

// geometry: N, C, H, W (the input), O, KH, KW, groups, stride h/w, padding h/w (before),
// dilation h/w (torch's convention: 1 = dense), padding h/w after (zero padding written
// out before the convolution, TensorFlow's "SAME", may be larger after than before).
// weight: [O, C/groups, KH, KW]
// contiguous; bias: [O] or null. unary: 0 none, 1 relu, 2 tanh, 3 sigmoid, 4 gelu (erf),
// 5 gelu (tanh), 6 clip to [0, 6] (ReLU6); it applies after the binary epilogue, as
// torch's post-ops do. mode: 1 float32; 2 bf16 (source, weight, destination and
// residual in bf16; the float32 bias, the sum and the activation computed in float32 and
// rounded once, on the store); 3 bf16x3,
// where the weight is bf16 [O, 6 * C/groups, KH, KW] (its parts in the slots
// [w0 w1 w2 w0 w1 w0] of each input channel block), the source and destination float32;
// 4 int8, where the weight is int8, the source uint8 codes, and `quant` (`Quantization`;
// null in the other modes) says the scales and whether the destination is codes; a
// residual of codes is summed in place (the binary add reads float32 only).
void* ow_onednn_conv_create(const int64_t* geometry, const void* weight, const float* bias,
                            int unary, int binary, int mode, const float* quant, char* error,
                            int error_size) {
  try {
    const int64_t n = geometry[0], c = geometry[1], h = geometry[2], w = geometry[3];
    const int64_t o = geometry[4], kh = geometry[5], kw = geometry[6], groups = geometry[7];
    const memory::dims strides = {geometry[8], geometry[9]};
    const memory::dims padding = {geometry[10], geometry[11]};
    const memory::dims dilation = {geometry[12] - 1, geometry[13] - 1};
    const memory::dims padding_after = {geometry[14], geometry[15]};
    const int64_t oh = (h + padding[0] + padding_after[0] - (dilation[0] + 1) * (kh - 1) - 1) /
                           strides[0] + 1;
    const int64_t ow = (w + padding[1] + padding_after[1] - (dilation[1] + 1) * (kw - 1) - 1) /
                           strides[1] + 1;
    if (n < 1 || c < 1 || o < 1 || groups < 1 || c % groups || o % groups || oh < 1 || ow < 1 ||
        padding[0] < 0 || padding[1] < 0 || padding_after[0] < 0 || padding_after[1] < 0) {
      throw std::invalid_argument("inconsistent convolution geometry");
    }
    const int64_t slots = checked_mode(mode) == kBf16x3 ? 6 : 1;
    const auto types = data_types(mode, quant, o);
    if (types.quant && binary == kAdd && types.quant->codes) {
      throw std::invalid_argument("an int8 convolution writing codes sums in place");
    }
    memory::desc src({n, slots * c, h, w}, types.source, tag::nhwc);
    memory::desc dst({n, o, oh, ow}, types.result, tag::nhwc);
    const int64_t per_group = slots * c / groups;
    memory::dims weight_dims = groups == 1 ? memory::dims{o, per_group, kh, kw}
                                           : memory::dims{groups, o / groups, per_group, kh, kw};
    memory::desc user_weights(weight_dims, types.weight, groups == 1 ? tag::oihw : tag::goihw);
    memory::desc any_weights(weight_dims, types.weight, tag::any);
    memory::desc bias_md({o}, memory::data_type::f32, tag::a);
    // per output channel: the weight's first axis, and its second where grouped
    auto attr = attributes(unary, binary, dst, types.quant.get(), groups == 1 ? 1 : 3);
    const bool biased = bias != nullptr;
    auto describe = [=]() {
      return biased ? dnnl::convolution_forward::primitive_desc(
                          cpu(), dnnl::prop_kind::forward_inference,
                          dnnl::algorithm::convolution_direct, src, any_weights, bias_md, dst,
                          strides, dilation, padding, padding_after, attr)
                    : dnnl::convolution_forward::primitive_desc(
                          cpu(), dnnl::prop_kind::forward_inference,
                          dnnl::algorithm::convolution_direct, src, any_weights, dst, strides,
                          dilation, padding, padding_after, attr);
    };
    auto* made = finish<dnnl::convolution_forward>(describe, user_weights, weight, bias, o,
                                                   binary, types.quant.get());
    if (slots == 6) made->set_split(n * h * w, groups, c / groups);
    return made;
  } catch (const std::exception& err) {
    message(error, error_size, err.what());
    return nullptr;
  }
}

// geometry: M, K, N. weight: [K, N] row-major; bias: [N] or null; unary, binary and mode
// as for convolutions (no in-place sum); for bf16x3 the weight is bf16 [6K, N]; for int8
// (`quant` as for convolutions) a residual is float32, and so is the destination then.
void* ow_onednn_linear_create(const int64_t* geometry, const void* weight, const float* bias,
                              int unary, int binary, int mode, const float* quant, char* error,
                              int error_size) {
  try {
    const int64_t m = geometry[0], k = geometry[1], n = geometry[2];
    if (m < 1 || k < 1 || n < 1) throw std::invalid_argument("empty product");
    if (binary == kSumInPlace) throw std::invalid_argument("no in-place sum for a product");
    const int64_t slots = checked_mode(mode) == kBf16x3 ? 6 : 1;
    const auto types = data_types(mode, quant, n);
    if (types.quant && binary == kAdd && types.quant->codes) {
      throw std::invalid_argument("an int8 product adding a residual writes float32");
    }
    memory::desc src({m, slots * k}, types.source, tag::ab), dst({m, n}, types.result, tag::ab);
    memory::desc user_weights({slots * k, n}, types.weight, tag::ab);
    memory::desc any_weights({slots * k, n}, types.weight, tag::any);
    memory::desc bias_md({1, n}, memory::data_type::f32, tag::ab);
    auto attr = attributes(unary, binary, dst, types.quant.get(), 1 << 1);  // [K, N]: N
    const bool biased = bias != nullptr;
    auto describe = [=]() {
      return biased ? dnnl::matmul::primitive_desc(cpu(), src, any_weights, bias_md, dst, attr)
                    : dnnl::matmul::primitive_desc(cpu(), src, any_weights, dst, attr);
    };
    auto* made = finish<dnnl::matmul>(describe, user_weights, weight, bias, n, binary,
                                      types.quant.get());
    if (slots == 6) made->set_split(m, 1, k);
    return made;
  } catch (const std::exception& err) {
    message(error, error_size, err.what());
    return nullptr;
  }
}

const char* ow_onednn_impl(void* handle) {
  return static_cast<Primitive*>(handle)->impl.c_str();
}

void ow_onednn_destroy(void* handle) { delete static_cast<Primitive*>(handle); }

// The number of primitives made for other thread counts than the first (for the tests).
int ow_onednn_variants(void* handle) {
  auto* made = static_cast<Primitive*>(handle);
  std::lock_guard<std::mutex> guard(made->lock);
  return static_cast<int>(made->others.size());
}

// args: destination, source, the handle (an int64 holding the Primitive's address: a
// constant tensor of the plan), for a dynamically quantized int8 source its scale (a
// float32) and zero point (an int64), then the residual operand for the binary add. With
// the in-place sum the destination holds the residual on entry.
void ow_onednn_run(void** args) {
  auto* call = reinterpret_cast<Primitive*>(*static_cast<int64_t*>(args[2]));
  try {
    void* source = args[1];
    if (call->rows) {
      auto& parts = split_buffer(call->src.get_size() / sizeof(uint16_t));
      split(static_cast<const float*>(source), parts.data(), call->rows, call->groups,
            call->width);
      source = parts.data();
    }
    if (call->dynamic) {
      execute(*call, source, args[0], call->binary == kAdd ? args[5] : nullptr,
              *static_cast<const float*>(args[3]),
              static_cast<int32_t>(*static_cast<const int64_t*>(args[4])));
      return;
    }
    execute(*call, source, args[0], call->binary == kAdd ? args[3] : nullptr);
  } catch (const std::exception& err) {
    failed(*call, err);
  }
}

}  // extern "C"
