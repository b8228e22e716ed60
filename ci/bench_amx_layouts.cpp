// Standalone timing of AMX weight-access layouts for a whole SmolLM2-135M step's linears (30
// layers x 7 + the tied lm_head, distinct bf16 weights, so they stream from DRAM), the
// experiment behind the choices in backends/cpu/rowinv.cpp's amx path:
//   strided: A tiles (16 weight rows x 32 k) loaded straight from w [N, K], K apart;
//   packed:  weights re-laid out once so that each group's tiles are contiguous, in the order
//            the kernel reads them;
// each with no prefetch, or software prefetch into L2 of the next 64-row group (strided) or of
// 8/16/32 KB ahead in the packed stream (plus 2 KB ahead into L1 for "pf=4"), or of each row a
// few k-steps ahead (strided). Four C tiles (64 output columns) share each B tile (the x rows),
// as in rowinv.cpp; two more strided variants use 1 or 2 C tiles per group (fewer concurrent
// weight-row streams for the hardware prefetchers, more B tile loads).
//
//   g++ -O3 -march=native -fopenmp ci/bench_amx_layouts.cpp -o /tmp/amx_layouts
//   OMP_NUM_THREADS=2 /tmp/amx_layouts        # needs AMX-BF16 and Linux 5.16+
//
// Prints the median and minimum of 12 interleaved runs per variant, M = 1 and 6 rows.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

struct alignas(64) TileCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void configure(int mt) {
  TileCfg c{};
  c.palette = 1;
  for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = mt * 4;
  for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[6] = 16, c.colsb[6] = mt * 4;
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12: ldtilecfg's operand covers 8 bytes only
  _tile_loadconfig(&c);
}

// y [M, N] (fp32) = x w^T; xp: x packed [K/32][16][mt][2]; w: [N, K] (strided) or packed.
template <bool Packed>
static void linear(const uint16_t* xp, int M, int K, const uint16_t* w, int N, float* y, int pf) {
  const int KB = K / 32;
#pragma omp parallel
  {
    configure(M);
    alignas(64) float buf[4][16][16];
#pragma omp for schedule(static)
    for (int g = 0; g < N / 64; g++) {
      const int n0 = g * 64;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const uint16_t* wg = w + static_cast<int64_t>(n0) * K;
      const char* next = reinterpret_cast<const char*>(wg + 64 * K);
      for (int kb = 0; kb < KB; kb++) {
        if (!Packed && pf == 1)
          for (int j = 0; j < 64; j++) _mm_prefetch(next + (kb * 64 + j) * 64, _MM_HINT_T1);
        if (!Packed && (pf == 2 || pf == 3) && kb + (pf == 2 ? 4 : 8) < KB) {
          // each of the group's 64 rows, a few 64-byte k-steps ahead
          const char* ahead = reinterpret_cast<const char*>(wg + (kb + (pf == 2 ? 4 : 8)) * 32);
          if (pf == 2)
            for (int j = 0; j < 64; j++) _mm_prefetch(ahead + static_cast<int64_t>(j) * K * 2, _MM_HINT_T0);
          else
            for (int j = 0; j < 64; j++) _mm_prefetch(ahead + static_cast<int64_t>(j) * K * 2, _MM_HINT_T1);
        }
        if (Packed && pf > 0) {
          const char* at = reinterpret_cast<const char*>(wg + kb * 2048);
          const int dist = pf == 1 ? 8192 : pf == 2 ? 16384 : 32768;
          for (int j = 0; j < 64; j++) _mm_prefetch(at + dist + j * 64, _MM_HINT_T1);
          if (pf == 4)
            for (int j = 0; j < 64; j++) _mm_prefetch(at + 2048 + j * 64, _MM_HINT_T0);
        }
        _tile_loadd(6, xp + kb * 16 * M * 2, M * 4);
        if (!Packed) {
          _tile_loadd(4, wg + kb * 32, K * 2); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, wg + 16 * K + kb * 32, K * 2); _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(4, wg + 32 * K + kb * 32, K * 2); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, wg + 48 * K + kb * 32, K * 2); _tile_dpbf16ps(3, 5, 6);
        } else {
          const uint16_t* t = wg + kb * 2048;
          _tile_loadd(4, t, 64); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, t + 512, 64); _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(4, t + 1024, 64); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, t + 1536, 64); _tile_dpbf16ps(3, 5, 6);
        }
      }
      _tile_stored(0, buf[0], 64); _tile_stored(1, buf[1], 64);
      _tile_stored(2, buf[2], 64); _tile_stored(3, buf[3], 64);
      for (int t = 0; t < 4; t++)
        for (int n = 0; n < 16; n++)
          for (int m = 0; m < M; m++) y[static_cast<int64_t>(m) * N + n0 + t * 16 + n] = buf[t][n][m];
    }
    _tile_release();
  }
}

template <int G>
static void linear_g(const uint16_t* xp, int M, int K, const uint16_t* w, int N, float* y) {
  const int KB = K / 32;
#pragma omp parallel
  {
    configure(M);
    alignas(64) float buf[4][16][16];
#pragma omp for schedule(static)
    for (int g = 0; g < N / (16 * G); g++) {
      const int n0 = g * 16 * G;
      _tile_zero(0); if (G > 1) _tile_zero(1);
      const uint16_t* wg = w + static_cast<int64_t>(n0) * K;
      for (int kb = 0; kb < KB; kb++) {
        _tile_loadd(6, xp + kb * 16 * M * 2, M * 4);
        _tile_loadd(4, wg + kb * 32, K * 2); _tile_dpbf16ps(0, 4, 6);
        if (G > 1) { _tile_loadd(5, wg + 16 * K + kb * 32, K * 2); _tile_dpbf16ps(1, 5, 6); }
      }
      _tile_stored(0, buf[0], 64); if (G > 1) _tile_stored(1, buf[1], 64);
      for (int t = 0; t < G; t++)
        for (int n = 0; n < 16; n++)
          for (int m = 0; m < M; m++) y[static_cast<int64_t>(m) * N + n0 + t * 16 + n] = buf[t][n][m];
    }
    _tile_release();
  }
}

// [N, K] -> [N/64][K/32][4][16][32]: each group's tiles in reading order.
static void pack(const uint16_t* w, int N, int K, uint16_t* out) {
  for (int g = 0; g < N / 64; g++)
    for (int kb = 0; kb < K / 32; kb++)
      for (int t = 0; t < 4; t++)
        for (int r = 0; r < 16; r++)
          for (int j = 0; j < 32; j++) *out++ = w[static_cast<int64_t>(g * 64 + t * 16 + r) * K + kb * 32 + j];
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "no AMX here (CPU or kernel)\n");
    return 1;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  struct Shape { int N, K; };
  std::vector<Shape> shapes;
  for (int layer = 0; layer < 30; layer++)
    for (Shape s : {Shape{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}})
      shapes.push_back(s);
  shapes.push_back({49152, 576});
  std::vector<std::vector<uint16_t>> strided, packed;
  for (Shape s : shapes) {
    strided.emplace_back(static_cast<size_t>(s.N) * s.K);
    for (auto& v : strided.back()) v = to_bf16(normal(gen) * 0.05f);
    packed.emplace_back(strided.back().size());
    pack(strided.back().data(), s.N, s.K, packed.back().data());
  }
  for (int M : {1, 6}) {
    std::vector<std::vector<uint16_t>> xs;
    std::vector<std::vector<float>> ys;
    for (Shape s : shapes) xs.emplace_back(s.K * 16 * 2, to_bf16(0.1f)), ys.emplace_back(static_cast<size_t>(M) * s.N);
    struct Variant { bool packed; int pf; const char* name; };
    const Variant variants[] = {{false, 0, "strided, no prefetch"}, {false, 10, "strided, 1 C tile per group"},
                                {false, 11, "strided, 2 C tiles per group"}, {false, 1, "strided, next group into L2"},
                                {false, 2, "strided, 4 k-steps ahead into L1"},
                                {false, 3, "strided, 8 k-steps ahead into L2"},
                                {true, 0, "packed, no prefetch"},   {true, 1, "packed, 8 KB ahead into L2"},
                                {true, 2, "packed, 16 KB ahead"},   {true, 3, "packed, 32 KB ahead"},
                                {true, 4, "packed, 32 KB into L2 + 2 KB into L1"}};
    std::vector<std::vector<double>> times(std::size(variants));
    for (int rep = 0; rep < 12; rep++)
      for (size_t v = 0; v < std::size(variants); v++) {
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < shapes.size(); i++) {
          if (variants[v].pf == 10) { linear_g<1>(xs[i].data(), M, shapes[i].K, strided[i].data(), shapes[i].N, ys[i].data()); continue; }
          if (variants[v].pf == 11) { linear_g<2>(xs[i].data(), M, shapes[i].K, strided[i].data(), shapes[i].N, ys[i].data()); continue; }
          if (variants[v].packed)
            linear<true>(xs[i].data(), M, shapes[i].K, packed[i].data(), shapes[i].N, ys[i].data(), variants[v].pf);
          else
            linear<false>(xs[i].data(), M, shapes[i].K, strided[i].data(), shapes[i].N, ys[i].data(), variants[v].pf);
        }
        times[v].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
    for (size_t v = 0; v < std::size(variants); v++) {
      std::sort(times[v].begin(), times[v].end());
      std::printf("M=%d  %-40s median %6.2f ms  min %6.2f ms\n", M, variants[v].name, times[v][6], times[v][0]);
    }
  }
}
