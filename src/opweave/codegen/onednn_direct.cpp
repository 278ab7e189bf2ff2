// Convolutions on oneDNN's own library, called directly (codegen/onednn_direct.py).
//
// torch's `mkldnn._convolution_pointwise` builds oneDNN's primitive descriptor again at
// every call and runs whatever kernels torch's bundled oneDNN has. Here a convolution's
// primitive is made once, at compile time, with its weights reordered into the layout the
// primitive asked for, and a call only wraps the caller's pointers: measured on a Zen 4
// with ResNet-50's 20 convolution shapes, 14.1 ms against torch's 15.6 ms.
//
// Activations are channels-last (NHWC) float32, as everywhere in opweave's convolutions.
// The C interface is for ctypes; `ow_onednn_conv_run` has the generated kernels' signature
// (`void(void**)`), so the native plan calls it like one of them.
#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
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

struct Conv {
  dnnl::convolution_forward primitive;
  memory::desc src, dst, residual, scratch;
  memory weights, bias;
  int binary = kNone;
  std::string impl;
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
  }
  throw std::invalid_argument("unknown unary epilogue " + std::to_string(unary));
}

std::vector<char>& scratchpad(size_t bytes) {
  // per thread, so steps that run concurrently (inter-operator schedules) never share one
  thread_local std::vector<char> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer;
}

}  // namespace

extern "C" {

const char* ow_key() { return OPWEAVE_ONEDNN_KEY; }

const char* ow_onednn_version() {
  static std::string text;
  if (text.empty()) {
    const dnnl_version_t* v = dnnl_version();
    text = std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
           std::to_string(v->patch);
  }
  return text.c_str();
}

// geometry: N, C, H, W (the input), O, KH, KW, groups, stride h/w, padding h/w (both
// sides), dilation h/w (torch's convention: 1 = dense). weight: [O, C/groups, KH, KW]
// contiguous; bias: [O] or null. unary: 0 none, 1 relu, 2 tanh, 3 sigmoid, 4 gelu (erf),
// 5 gelu (tanh); it applies after the binary epilogue, as torch's post-ops do.
void* ow_onednn_conv_create(const int64_t* geometry, const float* weight, const float* bias,
                            int unary, int binary, char* error, int error_size) {
  try {
    const int64_t n = geometry[0], c = geometry[1], h = geometry[2], w = geometry[3];
    const int64_t o = geometry[4], kh = geometry[5], kw = geometry[6], groups = geometry[7];
    const memory::dims strides = {geometry[8], geometry[9]};
    const memory::dims padding = {geometry[10], geometry[11]};
    const memory::dims dilation = {geometry[12] - 1, geometry[13] - 1};
    const int64_t oh = (h + 2 * padding[0] - (dilation[0] + 1) * (kh - 1) - 1) / strides[0] + 1;
    const int64_t ow = (w + 2 * padding[1] - (dilation[1] + 1) * (kw - 1) - 1) / strides[1] + 1;
    if (groups < 1 || c % groups || o % groups || oh < 1 || ow < 1) {
      throw std::invalid_argument("inconsistent convolution geometry");
    }
    auto f32 = memory::data_type::f32;
    memory::desc src({n, c, h, w}, f32, tag::nhwc), dst({n, o, oh, ow}, f32, tag::nhwc);
    memory::dims weight_dims = groups == 1 ? memory::dims{o, c, kh, kw}
                                           : memory::dims{groups, o / groups, c / groups, kh, kw};
    memory::desc user_weights(weight_dims, f32, groups == 1 ? tag::oihw : tag::goihw);
    memory::desc any_weights(weight_dims, f32, tag::any);
    memory::desc bias_md({o}, f32, tag::a);

    dnnl::post_ops ops;
    if (binary == kSumInPlace) {
      ops.append_sum(1.f);
    } else if (binary == kAdd) {
      ops.append_binary(dnnl::algorithm::binary_add, dst);
    } else if (binary != kNone) {
      throw std::invalid_argument("unknown binary epilogue " + std::to_string(binary));
    }
    if (unary != 0) ops.append_eltwise(eltwise(unary), 0.f, 0.f);
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);

    auto pd = bias ? dnnl::convolution_forward::primitive_desc(
                         cpu(), dnnl::prop_kind::forward_inference,
                         dnnl::algorithm::convolution_direct, src, any_weights, bias_md, dst,
                         strides, dilation, padding, padding, attr)
                   : dnnl::convolution_forward::primitive_desc(
                         cpu(), dnnl::prop_kind::forward_inference,
                         dnnl::algorithm::convolution_direct, src, any_weights, dst, strides,
                         dilation, padding, padding, attr);
    auto* conv = new Conv;
    conv->primitive = dnnl::convolution_forward(pd);
    conv->src = src;
    conv->dst = dst;
    conv->residual = dst;
    conv->binary = binary;
    conv->scratch = pd.scratchpad_desc();
    conv->impl = pd.impl_info_str();
    conv->weights = memory(pd.weights_desc(), cpu());
    memory given(user_weights, cpu(), const_cast<float*>(weight));
    dnnl::stream stream(cpu());
    dnnl::reorder(given, conv->weights).execute(stream, given, conv->weights);
    if (bias) {
      conv->bias = memory(bias_md, cpu());
      std::memcpy(conv->bias.get_data_handle(), bias, o * sizeof(float));
    }
    stream.wait();
    return conv;
  } catch (const std::exception& err) {
    message(error, error_size, err.what());
    return nullptr;
  }
}

const char* ow_onednn_conv_impl(void* handle) {
  return static_cast<Conv*>(handle)->impl.c_str();
}

void ow_onednn_conv_destroy(void* handle) { delete static_cast<Conv*>(handle); }

// args: destination, source, the handle (an int64 holding the Conv's address: a constant
// tensor of the plan), then the residual operand for the binary add. With the in-place
// sum the destination holds the residual on entry.
void ow_onednn_conv_run(void** args) {
  const Conv* conv = reinterpret_cast<const Conv*>(*static_cast<int64_t*>(args[2]));
  try {
    dnnl::stream stream(cpu());
    auto& pad = scratchpad(conv->scratch.get_size());
    std::unordered_map<int, memory> io = {
        {DNNL_ARG_SRC, memory(conv->src, cpu(), args[1])},
        {DNNL_ARG_WEIGHTS, conv->weights},
        {DNNL_ARG_DST, memory(conv->dst, cpu(), args[0])},
        {DNNL_ARG_SCRATCHPAD, memory(conv->scratch, cpu(), pad.data())}};
    if (conv->bias) io[DNNL_ARG_BIAS] = conv->bias;
    if (conv->binary == kAdd) {
      io[DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1] =
          memory(conv->residual, cpu(), args[3]);
    }
    conv->primitive.execute(stream, io);
    stream.wait();
  } catch (const std::exception& err) {
    // a primitive made and checked at compile time does not fail on valid pointers; if it
    // does, stopping is better than returning a tensor that was never written
    std::fprintf(stderr, "opweave: a direct oneDNN convolution failed: %s\n", err.what());
    std::abort();
  }
}

}  // extern "C"
