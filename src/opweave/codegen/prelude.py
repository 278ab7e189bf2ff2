"""C++ shared by every generated translation unit: vectorizable float math and threads.

libm's expf/erff/tanhf are scalar calls the compiler will not vectorize without
-ffast-math, which we refuse (it changes NaN and rounding behaviour). These branch-free
versions vectorize; their error is within a few float ulps (exp: Cephes polynomial;
erf: Abramowitz-Stegun 7.1.26, the formula ATen's own vectorized erf uses, |error| <
1.5e-7), well inside the tolerance every kernel is tested to.
Parallel regions size their team with `ow_team()`, so a kernel run on a thread given a
share of the cores keeps to it.
"""

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

static int ow_threads = 1;
extern "C" void ow_set_threads(int n) { ow_threads = n > 0 ? n : 1; }
// A parallel region's team: the threads set at load, or fewer where the calling thread
// was given fewer (a concurrent stage's share of the cores, runtime/native_plan.cpp).
static inline int ow_team() {
  int here = omp_get_max_threads();
  return here < ow_threads ? here : ow_threads;
}

static inline float ow_exp(float x) {
  float c = x < -87.5f ? -87.5f : (x > 88.5f ? 88.5f : x);
  float k = std::floor(c * 1.44269504088896341f + 0.5f);
  float r = c - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  y = x < -87.5f ? 0.0f : y;
  y = x > 88.5f ? INFINITY : y;
  return x != x ? x : y;
}

static inline float ow_erf(float x) {
  float a = std::fabs(x);
  float t = 1.0f / (0.3275911f * a + 1.0f);
  float r = 1.061405429f;
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  float y = 1.0f - r * t * ow_exp(-a * a);
  return x < 0.0f ? -y : y;
}

static inline float ow_tanh(float x) {
  float a = std::fabs(x);
  float e = ow_exp(-2.0f * a);
  float big = (1.0f - e) / (1.0f + e);
  float x2 = x * x;
  float small = a * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f - x2 * 0.0539682540f)));
  float y = a < 0.0625f ? small : big;
  return x < 0.0f ? -y : y;
}

static inline float ow_sigmoid(float x) { return 1.0f / (1.0f + ow_exp(-x)); }

// x ** y; a square or a cube as products, which vectorize where libm's powf does not
// (the exponent is a literal in every kernel that writes one, so the comparisons fold away;
// within two float roundings of powf, and equal to it at zeros, infinities and NaN)
static inline float ow_pow(float x, float y) {
  if (y == 2.0f) return x * x;
  if (y == 3.0f) return x * x * x;
  return std::pow(x, y);
}

// A bfloat16 (its bits) widened to float32: exact.
static inline float ow_bf16_widen(uint16_t bits) {
  const uint32_t u = (uint32_t)bits << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// A float32 rounded to bfloat16 (its bits) as torch rounds it: to nearest, ties to even;
// a NaN becomes the quiet NaN 0x7FC0.
static inline uint16_t ow_bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}

// A bfloat16's bits as a 16-bit integer in the order of the values (NaN aside): a negative
// value's magnitude bits flipped. Applied to a key it gives the bits back.
static inline int16_t ow_bf16_key(uint16_t bits) {
  const int16_t s = (int16_t)bits;
  return (int16_t)(s ^ ((s >> 15) & 0x7FFF));
}
"""
