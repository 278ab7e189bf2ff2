// Winograd convolutions F(m x m, 3 x 3) (Lavin and Gray, CVPR 2016), compiled with
// onednn_direct.cpp (appended to its text: one module, one oneDNN).
//
// A 3x3 convolution of stride 1 computes each m x m tile of its output from an a x a tile
// of its input (a = m + 2). In the transformed domain the convolution is a pointwise
// product, and over channels a product of matrices: for each of the a * a positions xi,
// M[xi] = V[xi] x U[xi], with V[xi] the [tiles, C] transformed inputs and U[xi] the
// [C, O] transformed weights (U = G g G^T, made once in double). The a * a products are
// one batched oneDNN matmul on weights packed at creation. Float32 throughout.
//
// Only m = 2 is built: 16 multiplications for 4 output pixels where the direct
// convolution does 36 (2.25x fewer), at float32's own error (1.1-1.5x the direct
// convolution's against float64). m = 4 ran 1.5-2x faster again on ResNet-50's shapes, but
// with 20-30x the direct convolution's error (8-9x with its best points): more than a
// float32 result may differ.
//
// input transform: V[xi][t][c] = (B^T d B)[xi] for the tile d of input channel c;
// output transform: Y = A^T M A for each tile, plus the bias, then the residual (added
// into the destination, or from an operand), then the activation, as oneDNN's post-ops
// order them. Channels are the vector lanes: NHWC holds each pixel's channels side by side.
//
// Non-finite inputs: the transforms add and subtract inputs, so an infinite input can
// come out NaN where the direct convolution gives an infinity. The input transform notes
// any non-finite input, and such a call runs a direct convolution instead, made at the
// first such call from the weights as given (kept: 9/16 of U's size). Non-finite weights
// would spread NaN through U (G has zeros): the caller does not offer the form for them.
// relu maps NaN to 0, as oneDNN's relu post-op does, so both forms agree on it.

#include <algorithm>
#include <atomic>

namespace {

template <int M>
struct Transforms;

// points 0, 1, -1, infinity
template <>
struct Transforms<2> {
  static constexpr int kA = 4;
  static constexpr double kG[4][3] = {{1, 0, 0}, {.5, .5, .5}, {.5, -.5, .5}, {0, 0, 1}};
  static constexpr float kBT[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
  static constexpr float kAT[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
};

constexpr int kLanes = 16;  // channels transformed together: one AVX-512 vector

// out[i] = sum_k T[i][k] * in[k] over `kLanes` lanes each, for a constant matrix T[R][K]
// whose zero entries are skipped (the loops unroll, so each test is resolved at compile
// time; 0 * x is not folded without -ffast-math, and would turn an infinity into NaN)
template <int R, int K>
inline void apply(const float (&t)[R][K], const float (*in)[kLanes], int in_stride,
                  float (*out)[kLanes], int out_stride) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    float acc[kLanes] = {};
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      if (t[i][k] == 0.f) continue;
      const float coefficient = t[i][k];
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[l] += coefficient * in[k * in_stride][l];
    }
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) out[i * out_stride][l] = acc[l];
  }
}

// U [a * a, C, O] of a weight g [O, C, 3, 3]: U[xi = (i, j)] = (G g G^T)[i][j], in double
template <int M>
std::vector<float> transformed_weights(const float* g, int64_t c, int64_t o) {
  using T = Transforms<M>;
  constexpr int A = T::kA;
  std::vector<float> u(A * A * c * o);
  for (int64_t oc = 0; oc < o * c; ++oc) {
    const int64_t out = oc / c, in = oc % c;
    const float* k = g + oc * 9;
    double rows[A][3];  // G g
    for (int i = 0; i < A; ++i) {
      for (int l = 0; l < 3; ++l) {
        rows[i][l] = T::kG[i][0] * k[l] + T::kG[i][1] * k[3 + l] + T::kG[i][2] * k[6 + l];
      }
    }
    for (int i = 0; i < A; ++i) {
      for (int j = 0; j < A; ++j) {
        const double value =
            rows[i][0] * T::kG[j][0] + rows[i][1] * T::kG[j][1] + rows[i][2] * T::kG[j][2];
        u[((i * A + j) * c + in) * o + out] = static_cast<float>(value);
      }
    }
  }
  return u;
}

struct Winograd : Primitive {
  int64_t n = 0, c = 0, h = 0, w = 0, o = 0, pad_h = 0, pad_w = 0, out_h = 0, out_w = 0;
  int64_t tiles_h = 0, tiles_w = 0, tiles = 0;
  int m = 0, unary = 0, winograd_binary = kNone;
  std::vector<float> bias_values;  // [O], zeros without a bias
  std::vector<float> weights;      // [O, C, 3, 3] as given, for the direct convolution
  std::mutex fallback_lock;
  std::unique_ptr<Primitive> fallback;  // the direct convolution, for non-finite inputs
  std::atomic<int64_t> fallbacks{0};    // calls it ran (for the tests)

  Primitive& direct() {
    std::lock_guard<std::mutex> guard(fallback_lock);
    ++fallbacks;
    if (fallback) return *fallback;
    const int64_t geometry[16] = {n, c, h, w, o, 3, 3, 1, 1, 1, pad_h, pad_w, 1, 1, pad_h, pad_w};
    char error[512] = "";
    void* made = ow_onednn_conv_create(geometry, weights.data(), bias_values.data(), unary,
                                       winograd_binary, 1, nullptr, error, sizeof error);
    if (!made) throw std::runtime_error(std::string("no direct convolution: ") + error);
    fallback.reset(static_cast<Primitive*>(made));
    return *fallback;
  }
};

// Writes V; returns false where some input is infinite or NaN (V is then of no use).
template <int M>
bool input_transform(const Winograd& g, const float* x, float* v) {
  constexpr int A = Transforms<M>::kA;
  const int64_t blocks = (g.c + kLanes - 1) / kLanes, plane = g.tiles * g.c;
  float probe = 0.f;  // sums x * 0: NaN once any x is infinite or NaN
#pragma omp parallel for collapse(2) schedule(static) reduction(+ : probe)
  for (int64_t t = 0; t < g.tiles; ++t) {
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t c0 = block * kLanes, lanes = std::min<int64_t>(kLanes, g.c - c0);
      const int64_t image = t / (g.tiles_h * g.tiles_w);
      const int64_t y0 = (t / g.tiles_w) % g.tiles_h * M - g.pad_h;
      const int64_t x0 = t % g.tiles_w * M - g.pad_w;
      float d[A * A][kLanes], rows[A * A][kLanes], s[A * A][kLanes];
      for (int i = 0; i < A; ++i) {
        for (int j = 0; j < A; ++j) {
          float* lane = d[i * A + j];
          const int64_t y = y0 + i, xx = x0 + j;
          if (y < 0 || y >= g.h || xx < 0 || xx >= g.w) {
            std::fill(lane, lane + kLanes, 0.f);
            continue;
          }
          const float* p = x + ((image * g.h + y) * g.w + xx) * g.c + c0;
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) lane[l] = l < lanes ? p[l] : 0.f;
        }
      }
      // rows = B^T d (column by column), s = rows B (row by row)
      for (int j = 0; j < A; ++j) apply(Transforms<M>::kBT, d + j, A, rows + j, A);
      for (int i = 0; i < A; ++i) apply(Transforms<M>::kBT, rows + i * A, 1, s + i * A, 1);
      // an infinite or NaN input leaves some transformed value infinite or NaN
      float lanes_probe[kLanes] = {};
      for (int xi = 0; xi < A * A; ++xi) {
        float* out = v + xi * plane + t * g.c + c0;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) lanes_probe[l] += s[xi][l] * 0.f;
        for (int l = 0; l < lanes; ++l) out[l] = s[xi][l];
      }
      for (int l = 0; l < kLanes; ++l) probe += lanes_probe[l];
    }
  }
  return probe == 0.f;
}

template <int M>
void output_transform(const Winograd& g, const float* products, float* y,
                      const float* residual) {
  constexpr int A = Transforms<M>::kA;
  const int64_t blocks = (g.o + kLanes - 1) / kLanes, plane = g.tiles * g.o;
  const bool relu = g.unary == 1;
  const bool summed = g.winograd_binary == kSumInPlace;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < g.tiles; ++t) {
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t o0 = block * kLanes, lanes = std::min<int64_t>(kLanes, g.o - o0);
      const int64_t image = t / (g.tiles_h * g.tiles_w);
      const int64_t y0 = (t / g.tiles_w) % g.tiles_h * M, x0 = t % g.tiles_w * M;
      float p[A * A][kLanes], rows[M * A][kLanes], s[M * M][kLanes];
      for (int xi = 0; xi < A * A; ++xi) {
        const float* in = products + xi * plane + t * g.o + o0;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) p[xi][l] = l < lanes ? in[l] : 0.f;
      }
      // rows = A^T p (column by column), s = rows A (row by row)
      for (int j = 0; j < A; ++j) apply(Transforms<M>::kAT, p + j, A, rows + j, A);
      for (int i = 0; i < M; ++i) apply(Transforms<M>::kAT, rows + i * A, 1, s + i * M, 1);
      const float* bias = g.bias_values.data() + o0;
      for (int i = 0; i < M && y0 + i < g.out_h; ++i) {
        for (int j = 0; j < M && x0 + j < g.out_w; ++j) {
          const int64_t at = ((image * g.out_h + y0 + i) * g.out_w + x0 + j) * g.o + o0;
          float* out = y + at;
          const float* other = summed ? out : residual ? residual + at : nullptr;
          const float* value = s[i * M + j];
          for (int l = 0; l < lanes; ++l) {
            float sum = value[l] + bias[l];
            if (other) sum += other[l];
            out[l] = relu ? (sum > 0.f ? sum : 0.f) : sum;  // NaN -> 0, as oneDNN's relu
          }
        }
      }
    }
  }
}

// V and M, per thread (as the scratchpad), kept between calls up to kKeptBuffer bytes
// each: a larger call's (a large batch) are released after it, not held for good
constexpr size_t kKeptBuffer = size_t(64) << 20;
thread_local std::vector<float> transform_buffers[2];

float* transform_buffer(int which, size_t elements) {
  auto& buffer = transform_buffers[which];
  if (buffer.size() < elements) buffer.resize(elements);
  return buffer.data();
}

void release_oversized_buffers() {
  for (auto& buffer : transform_buffers) {
    if (buffer.capacity() * sizeof(float) > kKeptBuffer) std::vector<float>().swap(buffer);
  }
}

}  // namespace

extern "C" {

// How many calls of a Winograd convolution ran its direct fallback (for the tests).
int64_t ow_winograd_fallbacks(void* handle) {
  return static_cast<Winograd*>(static_cast<Primitive*>(handle))->fallbacks.load();
}

// geometry: N, C, H, W (the input), O, padding h/w (both sides) of a 3x3 convolution of
// stride 1, dilation 1, one group. weight: [O, C, 3, 3] contiguous and finite; bias: [O]
// or null. unary: 0 none or 1 relu; binary as for `ow_onednn_conv_create`; m: the output
// tile, 2.
void* ow_winograd_create(const int64_t* geometry, const void* weight, const float* bias,
                         int unary, int binary, int m, char* error, int error_size) {
  try {
    if (m != 2) throw std::invalid_argument("a Winograd tile is 2 wide");
    if (unary != 0 && unary != 1) throw std::invalid_argument("Winograd fuses relu only");
    if (binary != kNone && binary != kSumInPlace && binary != kAdd) {
      throw std::invalid_argument("unknown binary epilogue " + std::to_string(binary));
    }
    const int64_t n = geometry[0], c = geometry[1], h = geometry[2], w = geometry[3];
    const int64_t o = geometry[4], pad_h = geometry[5], pad_w = geometry[6];
    const int64_t out_h = h + 2 * pad_h - 2, out_w = w + 2 * pad_w - 2;
    if (n < 1 || c < 1 || o < 1 || out_h < 1 || out_w < 1 || pad_h < 0 || pad_w < 0) {
      throw std::invalid_argument("inconsistent convolution geometry");
    }
    const int64_t tiles_h = (out_h + m - 1) / m, tiles_w = (out_w + m - 1) / m;
    const int64_t tiles = n * tiles_h * tiles_w, positions = (m + 2) * (m + 2);
    auto f32 = memory::data_type::f32;
    memory::desc src({positions, tiles, c}, f32, tag::abc);
    memory::desc dst({positions, tiles, o}, f32, tag::abc);
    memory::desc user_weights({positions, c, o}, f32, tag::abc);
    const auto u = transformed_weights<2>(static_cast<const float*>(weight), c, o);
    memory::desc any_weights({positions, c, o}, f32, tag::any);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto describe = [=]() {
      return dnnl::matmul::primitive_desc(cpu(), src, any_weights, dst, attr);
    };
    auto* made = finish<dnnl::matmul, Winograd>(describe, user_weights, u.data(), nullptr, o,
                                                kNone);
    made->n = n, made->c = c, made->h = h, made->w = w, made->o = o;
    made->pad_h = pad_h, made->pad_w = pad_w, made->out_h = out_h, made->out_w = out_w;
    made->tiles_h = tiles_h, made->tiles_w = tiles_w, made->tiles = tiles;
    made->m = m, made->unary = unary, made->winograd_binary = binary;
    made->weights.assign(static_cast<const float*>(weight),
                         static_cast<const float*>(weight) + o * c * 9);
    made->bias_values.assign(o, 0.f);
    if (bias) std::memcpy(made->bias_values.data(), bias, o * sizeof(float));
    return static_cast<Primitive*>(made);
  } catch (const std::exception& err) {
    message(error, error_size, err.what());
    return nullptr;
  }
}

// args as for `ow_onednn_run`: destination (NHWC), source (NHWC), the handle, then the
// residual operand for the binary add; with the in-place sum the destination holds the
// residual on entry.
void ow_winograd_run(void** args) {
  auto* call = static_cast<Winograd*>(reinterpret_cast<Primitive*>(
      *static_cast<int64_t*>(args[2])));
  try {
    const size_t positions = (call->m + 2) * (call->m + 2);
    float* v = transform_buffer(0, positions * call->tiles * call->c);
    float* products = transform_buffer(1, positions * call->tiles * call->o);
    const auto* x = static_cast<const float*>(args[1]);
    auto* y = static_cast<float*>(args[0]);
    const float* residual =
        call->winograd_binary == kAdd ? static_cast<const float*>(args[3]) : nullptr;
    if (input_transform<2>(*call, x, v)) {
      execute(*call, v, products, nullptr);
      output_transform<2>(*call, products, y, residual);
    } else {
      execute(call->direct(), const_cast<float*>(x), y, const_cast<float*>(residual));
    }
    release_oversized_buffers();
  } catch (const std::exception& err) {
    failed(*call, err);
  }
}

}  // extern "C"
