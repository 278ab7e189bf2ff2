extern "C" void ow_k_bf1ba8e5ac342390(void** args) {
  float* __restrict a0 = (float*)args[0];
  const float* __restrict a1 = (const float*)args[1];
  const float* __restrict a2 = (const float*)args[2];
  const float* __restrict a3 = (const float*)args[3];
  const float* __restrict a4 = (const float*)args[4];
  const float* __restrict a5 = (const float*)args[5];
  #pragma omp parallel for num_threads(ow_team()) if(98304 >= 32768 && 128 > 1)
  for (int64_t r = 0; r < 128; ++r) {
    float buf[768];
    #pragma omp simd
    for (int64_t j = 0; j < 768; ++j) {
      const float t0 = (a1[r * 768 + j] + a2[r * 768 + j]);
      const float t1 = (t0 + a3[r * 768 + j]);
      buf[j] = t1;
    }
    double sum = 0.0;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < 768; ++j) sum += (double)buf[j];
    const double mean_d = sum / 768.0;
    double sq = 0.0;
    #pragma omp simd reduction(+:sq)
    for (int64_t j = 0; j < 768; ++j) { double d = (double)buf[j] - mean_d; sq += d * d; }
    const float mean = (float)mean_d;
    const float mean_lo = (float)(mean_d - (double)mean);
    const float rstd = (float)(1.0 / std::sqrt(sq / 768.0 + (double)1e-12f));
    #pragma omp simd
    for (int64_t j = 0; j < 768; ++j) {
      const float t0 = (a1[r * 768 + j] + a2[r * 768 + j]);
      const float t1 = (t0 + a3[r * 768 + j]);
      const float t2 = ((buf[j] - mean) - mean_lo) * rstd * a4[j] + a5[j];
      a0[r * 768 + j] = t2;
    }
  }
}

extern "C" void ow_k_e81fe35a7636eede(void** args) {
  float* __restrict a0 = (float*)args[0];
  const float* __restrict a1 = (const float*)args[1];
  const float* __restrict a2 = (const float*)args[2];
  const float* __restrict a3 = (const float*)args[3];
  const float* __restrict a4 = (const float*)args[4];
  #pragma omp parallel for num_threads(ow_team()) if(98304 >= 32768 && 128 > 1)
  for (int64_t r = 0; r < 128; ++r) {
    float buf[768];
    #pragma omp simd
    for (int64_t j = 0; j < 768; ++j) {
      const float t0 = (a1[r * 768 + j] + a2[r * 768 + j]);
      buf[j] = t0;
    }
    double sum = 0.0;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < 768; ++j) sum += (double)buf[j];
    const double mean_d = sum / 768.0;
    double sq = 0.0;
    #pragma omp simd reduction(+:sq)
    for (int64_t j = 0; j < 768; ++j) { double d = (double)buf[j] - mean_d; sq += d * d; }
    const float mean = (float)mean_d;
    const float mean_lo = (float)(mean_d - (double)mean);
    const float rstd = (float)(1.0 / std::sqrt(sq / 768.0 + (double)1e-12f));
    #pragma omp simd
    for (int64_t j = 0; j < 768; ++j) {
      const float t0 = (a1[r * 768 + j] + a2[r * 768 + j]);
      const float t1 = ((buf[j] - mean) - mean_lo) * rstd * a3[j] + a4[j];
      a0[r * 768 + j] = t1;
    }
  }
}
