// Row-invariant CPU kernels for AVX2 + FMA: a bf16-weight linear, a CSR (paged) attention and
// the per-token ops of a decoder layer. The linear also has an AVX-512 path, picked at run time
// where the CPU has it.
//
// "Row-invariant" means the bits of output row m depend only on row m's inputs: not on M, on the
// other rows, on m's position, on the thread count or on which micro-kernel happened to compute
// it. The recipe is the same in both kernels: every output element is produced by one fixed
// sequence of fp32 operations; blocking and threading only decide how many such sequences run
// side by side, never how a single sequence is ordered.
//
// Build with -O3 -mavx2 -mfma -ffp-contract=off and without -ffast-math: the compiler must not
// reassociate, and must not fuse our scalar a*b+c into an FMA in one inlined copy but not another.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <string>
#include <type_traits>
#include <vector>

namespace {

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// 16 bf16 in one 256-bit load are 8 32-bit words; word j holds element 2j in its low half and
// 2j+1 in its high half. A shift and a mask turn them into fp32 with no shuffle, giving the even
// elements and the odd elements as two vectors. The linear kernel keeps this "even/odd" order.
struct EvenOdd {
  __m256 e, o;
};
inline EvenOdd load_bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// 8 bf16 -> 8 fp32 in natural order (attention, where D need only be a multiple of 8).
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// The one horizontal sum used everywhere: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {  // max is exact, so any order gives the same bits (NaN aside)
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Round-to-nearest-even, same as c10::BFloat16's conversion (NaN stays a quiet NaN).
inline uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ============================================================================================
// Kernel 1: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w in bf16, fp32 accumulation.
//
// Two paths, each with one fixed order for every (m, n):
//   AVX2:    one 8-lane accumulator; for each 16-wide K block b: acc = fma(x_even_b, w_even_b,
//            acc); acc = fma(x_odd_b, w_odd_b, acc); then hsum8.
//   AVX-512: the same with one 16-lane accumulator and 32-wide K blocks; then hsum16.
// The last K block is zero-padded when K is not a multiple of the block width; then + bias, then
// (bf16 output) one rounding. x is pre-packed to fp32 in the path's even/odd order and zero-
// padded, so bf16 and fp32 inputs share one code path. The two paths round differently, so a
// process runs every call on one of them (the best the CPU has, or the one set_isa chose): row
// invariance needs no more than that.
// ============================================================================================

enum class Isa { kAvx2, kAvx512, kAmx };

bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

// Set by the module's init and by set_isa; each linear call reads it once, so no call mixes paths.
std::atomic<Isa> g_isa{Isa::kAvx2};

constexpr int64_t kColGroup = 8;          // columns whose weights all row blocks reuse from L1
constexpr int64_t kPrefetchBytes = 8192;  // ~1-2 column groups ahead; hardware prefetch alone lags
constexpr int64_t kNearPrefetchBytes = 1024;  // AVX-512: the same lines again, shortly before use
constexpr int64_t kSmallM = 16;           // up to here all rows always form one chunk
constexpr int64_t kXChunkBytes = 192 * 1024;  // otherwise chunks of packed x rows that stay in L2

// R rows x C columns of output. R*C independent FMA chains hide the 4-cycle FMA latency, and each
// weight vector loaded and converted serves R rows: that is what lets M = 4..8 cost little more
// than M = 1 when the weights stream from DRAM.
// w: C weight rows, K apart. pf: if set, points kPrefetchBytes past this tile's weights (at what a
// later tile will read); C/2 lines per K block is the rate at which this tile consumes its own.
// The hint is NTA: the weights are read once a call, and on a Zen 1 (AVX2 only) one forward's
// linears took 0-6 % less at 1-2 rows than with T0, and within noise at 3-6 rows (row blocks
// after the first still find the group's weights in L1; an A/B of builds with each hint in one
// process, at 634a3b1). -DPOLYSPEC_WEIGHT_PREFETCH=... builds this file with another hint.
#ifndef POLYSPEC_WEIGHT_PREFETCH
#define POLYSPEC_WEIGHT_PREFETCH _MM_HINT_NTA
#endif
template <int R, int C>
inline void tile(const float* xp, int64_t ldx, const uint16_t* w, int64_t K, float* out, const char* pf) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  // One K block: weights at wb (column stride ws), x at offset xo. Each weight vector is consumed
  // right after it is made (even half for all rows, then odd half), so only the accumulators and
  // one weight vector need registers.
  auto step = [&](const uint16_t* wb, int64_t ws, int64_t xo) {
    for (int c = 0; c < C; ++c) {
      const EvenOdd wv = load_bf16x16(wb + c * ws);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + r * ldx + xo), wv.e, acc[r][c]);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + r * ldx + xo + 8), wv.o, acc[r][c]);
    }
  };
  const int64_t nfull = K / 16;
  for (int64_t b = 0; b < nfull; ++b) {
    if (pf)
      for (int j = 0; j < (C + 1) / 2; ++j) _mm_prefetch(pf + b * 32 * C + 64 * j, POLYSPEC_WEIGHT_PREFETCH);
    step(w + b * 16, K, b * 16);
  }
  if (K % 16) {  // a 16-wide load would run past the row (maybe past the allocation): copy, zero-pad
    alignas(32) uint16_t buf[C][16] = {};
    for (int c = 0; c < C; ++c) std::memcpy(buf[c], w + c * K + nfull * 16, (K % 16) * 2);
    step(&buf[0][0], 16, nfull * 16);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * C + c] = hsum8(acc[r][c]);
}

// The AVX-512 path: this region is compiled for AVX-512 whatever the build flags say, and runs
// only where cpu_has_avx512().
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// 32 bf16 (one cache line of weights) -> their even and odd elements as 16 fp32 each, by the
// same shift and mask as load_bf16x16.
struct EvenOdd512 {
  __m512 e, o;
};
inline EvenOdd512 split_bf16x32(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// hsum8 of (lane i + lane i+8), i < 8.
inline float hsum16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

// hsum16 of four vectors at once: the same additions of the same pairs (a + b == b + a bit for
// bit), with a quarter of the shuffles; at K = 576 a tile has only 18 blocks to spread its sums
// over.
inline void hsum16x4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  // [a.lo a.hi] (256-bit halves) -> a.lo + a.hi, two vectors per add.
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // Each vector's two 128-bit quarters added: one 128-bit lane per vector from here on.
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xEE));  // movehl: [s0+s2, s1+s3]
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xF5));  // movehdup: (s0+s2) + (s1+s3)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
}

// tile for AVX-512, one column wide: R rows share each weight vector loaded and converted, and
// the column's weights are read as one sequential stream. That measured faster than C columns'
// streams K apart (full step, M = 4: 14.3 ms vs 16.0 ms with 4-wide tiles; M = 1: 11.6 ms vs
// 12.3 ms, although a lone row then has a single FMA chain). pf: one line per K block into L2
// (T1; full step at M = 1 12.9 ms, vs 15.0 ms with T0), and kNearPrefetchBytes ahead into L1
// (M = 6: 15.3 ms vs 15.9 ms without).
template <int R>
void tile512(const float* xp, int64_t ldx, const uint16_t* w, int64_t K, float* out, const char* pf) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // Even halves for all rows, then odd halves: an accumulator's two FMAs of a block are R apart.
  auto step = [&](__m512i wv, int64_t xo) {
    const EvenOdd512 v = split_bf16x32(wv);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r * ldx + xo), v.e, acc[r]);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r * ldx + xo + 16), v.o, acc[r]);
  };
  const char* near = pf ? pf - kPrefetchBytes + kNearPrefetchBytes : nullptr;
  const int64_t nfull = K / 32;
  for (int64_t b = 0; b < nfull; ++b) {
    if (pf) {
      _mm_prefetch(pf + b * 64, _MM_HINT_T1);
      _mm_prefetch(near + b * 64, _MM_HINT_T0);
    }
    step(_mm512_loadu_si512(w + b * 32), b * 32);
  }
  if (K % 32)  // masked-off elements read as zero and cannot fault past the allocation
    step(_mm512_maskz_loadu_epi16((1u << (K % 32)) - 1, w + nfull * 32), nfull * 32);
  int r = 0;
  for (; r + 4 <= R; r += 4) hsum16x4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], out + r);
  for (; r < R; ++r) out[r] = hsum16(acc[r]);
}

#pragma GCC pop_options

struct LinearArgs {
  const float* xp;    // [M, Kp] x as fp32, even/odd order within each K block, zero-padded
  int64_t M, K, Kp, N;
  const uint16_t* w;  // [N, K] bf16
  const float* bias;  // [N] or nullptr
  void* y;            // [M, N] fp32 or bf16
  bool y_bf16;
};

// Rows [m0, m0+R) x columns [n0, n1): C columns per tile, leftover columns one at a time.
template <Isa P, int R, int C>
void row_block(const LinearArgs& a, int64_t m0, int64_t n0, int64_t n1, bool prefetch) {
  static_assert(P == Isa::kAvx2 || C == 1, "AVX-512 tiles are one column wide");
  const char* w_end = reinterpret_cast<const char*>(a.w + a.N * a.K);
  auto run = [&](auto cols, int64_t n) {
    constexpr int CC = decltype(cols)::value;
    const uint16_t* w = a.w + n * a.K;
    const char* pf = reinterpret_cast<const char*>(w) + kPrefetchBytes;
    if (!prefetch || pf + CC * a.K * 2 > w_end) pf = nullptr;
    float out[R * CC];
    if constexpr (P == Isa::kAvx512) tile512<R>(a.xp + m0 * a.Kp, a.Kp, w, a.K, out, pf);
    else tile<R, CC>(a.xp + m0 * a.Kp, a.Kp, w, a.K, out, pf);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CC; ++c) {
        float v = out[r * CC + c];
        if (a.bias) v += a.bias[n + c];
        const int64_t at = (m0 + r) * a.N + n + c;
        if (a.y_bf16) static_cast<uint16_t*>(a.y)[at] = bf16_rne(v);
        else static_cast<float*>(a.y)[at] = v;
      }
  };
  int64_t n = n0;
  for (; n + C <= n1; n += C) run(std::integral_constant<int, C>{}, n);
  for (; n < n1; ++n) run(std::integral_constant<int, 1>{}, n);
}

// Rows [m0, m1) x columns [n0, n1): blocks of 3 rows x 4 columns (12 chains), the remainder as
// 2x4 blocks (8 chains) or, for a lone row, 1x4: that case is DRAM-bound, where 4 chains keep up
// and 4 weight streams prefetch better than 8 (measured: full step 13-14 ms vs 15.5-16.5 ms).
// Only the first row block streams the weights from memory, so only it prefetches; the other
// blocks find the group's weights in L1/L2.
void row_blocks_avx2(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t rows = m1 - m0;
  const int64_t rest = (rows % 3 == 1 && rows > 1) ? 4 : rows % 3;  // 4 -> two 2-row blocks
  int64_t m = m0;
  for (; m + 3 <= m1 - rest; m += 3) row_block<Isa::kAvx2, 3, 4>(a, m, n0, n1, m == m0);
  for (; m + 2 <= m1; m += 2) row_block<Isa::kAvx2, 2, 4>(a, m, n0, n1, m == m0);
  if (m < m1) row_block<Isa::kAvx2, 1, 4>(a, m, n0, n1, m == m0);
}

constexpr int64_t kMaxRows512 = 8;

// Each row block converts the group's weights anew, so as few blocks as possible, of balanced
// height (9 rows: 5 + 4 rather than 8 + 1, whose lone row would have a single FMA chain). 8 rows
// keep 8 FMA chains, enough to hide the FMA latency, with registers to spare.
void row_blocks_avx512(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t blocks = (m1 - m0 + kMaxRows512 - 1) / kMaxRows512;
  int64_t m = m0;
  for (int64_t left = blocks; left > 0; --left) {
    const int64_t rows = (m1 - m + left - 1) / left;
    const bool pf = m == m0;
    switch (rows) {
      case 8: row_block<Isa::kAvx512, 8, 1>(a, m, n0, n1, pf); break;
      case 7: row_block<Isa::kAvx512, 7, 1>(a, m, n0, n1, pf); break;
      case 6: row_block<Isa::kAvx512, 6, 1>(a, m, n0, n1, pf); break;
      case 5: row_block<Isa::kAvx512, 5, 1>(a, m, n0, n1, pf); break;
      case 4: row_block<Isa::kAvx512, 4, 1>(a, m, n0, n1, pf); break;
      case 3: row_block<Isa::kAvx512, 3, 1>(a, m, n0, n1, pf); break;
      case 2: row_block<Isa::kAvx512, 2, 1>(a, m, n0, n1, pf); break;
      default: row_block<Isa::kAvx512, 1, 1>(a, m, n0, n1, pf); break;
    }
    m += rows;
  }
}

// One thread's columns. Small M: one chunk of rows per column group, so each weight is read from
// memory exactly once. Large M: rows in chunks whose packed x fits in L2, re-reading the (L3-
// resident) weights once per chunk instead of re-reading all of x per column group. Chunks are
// whole numbers of the tallest tile.
template <Isa P>
void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  constexpr int64_t tall = P == Isa::kAvx512 ? kMaxRows512 : 3;
  const int64_t chunk = std::max<int64_t>(kSmallM, kXChunkBytes / (std::max<int64_t>(a.Kp, 16) * 4) / tall * tall);
  for (int64_t m0 = 0; m0 < a.M; m0 += chunk)
    for (int64_t g = n0; g < n1; g += kColGroup) {
      const int64_t m1 = std::min(m0 + chunk, a.M), g1 = std::min(g + kColGroup, n1);
      if constexpr (P == Isa::kAvx512) row_blocks_avx512(a, m0, m1, g, g1);
      else row_blocks_avx2(a, m0, m1, g, g1);
    }
}

// --------------------------------------------------------------------------------------------
// The AMX path (bf16 x only; fp32 x keeps the AVX-512 path). y^T = W x^T on the tile unit: an A
// tile is 16 weight rows x 32 k, loaded straight from w [N, K] (no repacking of the weights); the
// B tile is 32 k x (up to) 16 rows of x in the pair-interleaved layout TDPBF16PS reads; a C tile
// is 16 output columns x those rows, accumulated over the K blocks in order. Each element of C is
// one dot product that the hardware computes on its own, so a row's bits do not depend on how
// many rows share the B tile, on its column in it, or on the thread (tests/core/test_cpu_rowinv.py
// checks this; the unit's internal summation order is not documented exactly, so there is no
// Python emulation of this path's bits, only a bound on its error). One TDPBF16PS costs about
// the same for 1 or 16 rows, so a 16-row verify streams the weights at nearly the 1-row cost.
// --------------------------------------------------------------------------------------------

// cpuid leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16. Then Linux must grant this process the
// tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 18; kernel 5.16+): the
// grant is process-wide, so OpenMP workers may use tiles too.
bool cpu_has_amx() {
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 22) & 1u)) return false;
    if (!cpu_has_avx512()) return false;  // fp32 inputs on the amx path run the AVX-512 kernel
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw")

constexpr int64_t kAmxRows = 16;  // x rows per B tile (its N dimension)
constexpr int64_t kAmxCols = 16;  // output columns per C tile (weight rows per A tile)
constexpr int64_t kAmxK = 32;     // bf16 k per tile step
constexpr int kAmxGroup = 4;      // C tiles (64 columns) sharing each B tile load

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C; 4-5: A (alternating, so a load overlaps the previous product); 6: B.
void amx_configure(int64_t mt) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = kAmxCols, c.colsb[t] = static_cast<uint16_t>(mt * 4);
  for (int t = 4; t < 6; ++t) c.rows[t] = kAmxCols, c.colsb[t] = kAmxK * 2;
  c.rows[6] = kAmxK / 2, c.colsb[6] = static_cast<uint16_t>(mt * 4);
  // GCC 12's _tile_loadconfig tells the compiler it reads only the first 8 bytes, so without this
  // barrier the row and column sizes are dropped as dead stores (then the tile ops fault: #UD).
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Where a C tile's A tiles come from: weight rows n0.. (stride bytes apart) for the whole K
// blocks, and a zero-padded copy for the last, partial K block (if any).
struct ASource {
  const uint16_t* rows;
  int64_t stride;        // bytes between weight rows
  const uint16_t* tail;  // [16][32] zero-padded, or nullptr when K % 32 == 0
};

void amx_release() { _tile_release(); }

// GCC's tile intrinsics paste their tile numbers into the instruction text, so they must be
// literal numbers: macros, not templates.
#define POLYSPEC_AMX_STEP(C, A, src, kb)                       \
  do {                                                          \
    _tile_loadd(A, (src).rows + (kb) * kAmxK, (src).stride);    \
    _tile_dpbf16ps(C, A, 6);                                    \
  } while (0)
#define POLYSPEC_AMX_TAIL(C, A, src)              \
  do {                                            \
    _tile_loadd(A, (src).tail, kAmxK * 2);        \
    _tile_dpbf16ps(C, A, 6);                      \
  } while (0)

// NB C tiles x one B block of x rows: C_i = sum over K blocks (in order) of A_i,kb * B_kb.
// xb: this m block's packed x, [KB][16][mt][2]; buf: [NB][16][16] fp32 out (C_i row n = column
// n0_i + n, entry m = x row m).
template <int NB>
void amx_group(const ASource* src, const uint16_t* xb, int64_t mt, int64_t kb_full, bool tail, float* buf) {
  if constexpr (NB > 0) _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t b_stride = mt * 4, b_elems = kAmxK * mt;
  for (int64_t kb = 0; kb < kb_full; ++kb) {
    _tile_loadd(6, xb + kb * b_elems, b_stride);
    if constexpr (NB > 0) POLYSPEC_AMX_STEP(0, 4, src[0], kb);
    if constexpr (NB > 1) POLYSPEC_AMX_STEP(1, 5, src[1], kb);
    if constexpr (NB > 2) POLYSPEC_AMX_STEP(2, 4, src[2], kb);
    if constexpr (NB > 3) POLYSPEC_AMX_STEP(3, 5, src[3], kb);
  }
  if (tail) {
    _tile_loadd(6, xb + kb_full * b_elems, b_stride);
    if constexpr (NB > 0) POLYSPEC_AMX_TAIL(0, 4, src[0]);
    if constexpr (NB > 1) POLYSPEC_AMX_TAIL(1, 5, src[1]);
    if constexpr (NB > 2) POLYSPEC_AMX_TAIL(2, 4, src[2]);
    if constexpr (NB > 3) POLYSPEC_AMX_TAIL(3, 5, src[3]);
  }
  constexpr int64_t tile_floats = kAmxCols * kAmxRows, ld = kAmxRows * 4;
  if constexpr (NB > 0) _tile_stored(0, buf, ld);
  if constexpr (NB > 1) _tile_stored(1, buf + tile_floats, ld);
  if constexpr (NB > 2) _tile_stored(2, buf + 2 * tile_floats, ld);
  if constexpr (NB > 3) _tile_stored(3, buf + 3 * tile_floats, ld);
}

#undef POLYSPEC_AMX_STEP
#undef POLYSPEC_AMX_TAIL

// Output row r (x row m0 + r) of NB C tiles in buf into y[row, n0 ..]: 16 columns per tile at
// once (a gather down the tile, bias, then fp32 or bf16 with bf16_rne's rounding, NaNs quieted).
// A scalar epilogue cost ~1 ms of a 6-row step; this one ~0.1 ms.
void amx_store_rows(const float* buf, int nb, int64_t rows, int64_t n0, int64_t N, int64_t m0,
                    const float* bias, void* y, bool y_bf16) {
  const __m512i lane16 = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int i = 0; i < nb; ++i) {
    const int64_t c0 = n0 + i * kAmxCols, cols = std::min(kAmxCols, N - c0);
    if (cols <= 0) break;
    const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << cols) - 1u);
    const float* c = buf + i * kAmxCols * kAmxRows;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i idx = _mm512_add_epi32(lane16, _mm512_set1_epi32(static_cast<int>(r)));
      __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, idx, c, 4);
      if (bias) v = _mm512_add_ps(v, b);
      const int64_t at = (m0 + r) * N + c0;
      if (!y_bf16) {
        _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mask, v);
        continue;
      }
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                    _mm512_set1_epi32(0x7F800000));
      h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
      _mm512_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, static_cast<__mmask32>(mask),
                               _mm512_castsi256_si512(_mm512_cvtepi32_epi16(h)));
    }
  }
}

#pragma GCC pop_options

struct AmxArgs {
  const uint16_t* xp;  // [MB][KB][16][mt][2] packed x (module doc of this section)
  int64_t M, mt, K, KB, kb_full, N;
  const uint16_t* w;   // [N, K]
  const uint16_t* w_last;  // [16][K] zero-padded copy of the last, partial column block, or nullptr
  const uint16_t* tails;   // [N16 / 16][16][32] zero-padded last K blocks, or nullptr
  const float* bias;
  void* y;
  bool y_bf16;
};

// Column blocks [b0, b1) of 16, in groups of 4 C tiles; every m block for each group, so the
// group's weights are read from memory once and re-read from L2 for the other m blocks.
void amx_columns(const AmxArgs& a, int64_t b0, int64_t b1) {
  amx_configure(a.mt);
  const int64_t full_blocks = a.N / kAmxCols;
  const int64_t mblocks = (a.M + a.mt - 1) / a.mt;
  alignas(64) float buf[kAmxGroup * kAmxCols * kAmxRows];
  for (int64_t g = b0; g < b1; g += kAmxGroup) {
    const int nb = static_cast<int>(std::min<int64_t>(kAmxGroup, b1 - g));
    ASource src[kAmxGroup];
    for (int i = 0; i < nb; ++i) {
      const int64_t b = g + i;
      const bool partial = b >= full_blocks;
      src[i] = {partial ? a.w_last : a.w + b * kAmxCols * a.K, a.K * 2,
                a.tails ? a.tails + b * kAmxCols * kAmxK : nullptr};
    }
    // No software prefetch, and no repacking of the weights (a standalone C++ timing at e20e01d, a
    // whole SmolLM2 step's linears at M = 1 on a 2-core Sapphire Rapids): prefetching the next
    // group into L2 while one runs made it slower (15.8 ms vs 11.8 ms), and weights repacked
    // into tile order were only 2 % faster (11.6 ms), not worth a second copy of every weight.
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      const uint16_t* xb = a.xp + mb * a.KB * kAmxK * a.mt;
      const bool tail = a.tails != nullptr;
      switch (nb) {
        case 4: amx_group<4>(src, xb, a.mt, a.kb_full, tail, buf); break;
        case 3: amx_group<3>(src, xb, a.mt, a.kb_full, tail, buf); break;
        case 2: amx_group<2>(src, xb, a.mt, a.kb_full, tail, buf); break;
        default: amx_group<1>(src, xb, a.mt, a.kb_full, tail, buf); break;
      }
      const int64_t m0 = mb * a.mt, rows = std::min(a.mt, a.M - m0);
      amx_store_rows(buf, nb, rows, g * kAmxCols, a.N, m0, a.bias, a.y, a.y_bf16);
    }
  }
  amx_release();
}

// x [M, K] bf16 -> [MB][KB][16][mt][2]: for m block mb and K block kb, pair row r holds, for
// each x row m of the block, elements (32 kb + 2r, 32 kb + 2r + 1). Zero beyond K and beyond M
// (dst arrives zeroed). In 32-bit units each m block is the [mt][K/2] matrix of x's element
// pairs, transposed: a verify's 8-16 rows go through 8 x 8 transposes, the rest one pair at a
// time. It runs on one thread before the tile work is split, so a scalar loop here weighed on
// every verify (benchmarks/bench_draft_kernels.py, a 576 x 1536 linear at 8 / 16 rows: 20.8 / 32.9 us
// with it, 19.7 / 26-28 us with the transposes).
// Pairs p .. p + 7 of 8 bf16 rows (any alignment: an odd K leaves rows 2-byte aligned only).
inline void transpose8x8_store(const uint16_t* const* rows, int64_t p, uint32_t* d, int64_t mt) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + 2 * p)));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // column i and i + 4 of the 8 x 8 block: pairs p + i, p + i + 4
    _mm256_storeu_ps(reinterpret_cast<float*>(d + (p + i) * mt), _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(d + (p + i + 4) * mt), _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

void amx_pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t mt, int64_t KB, uint16_t* dst) {
  const int64_t pairs = K / 2, pairs8 = pairs / 8 * 8;
  for (int64_t m0 = 0; m0 < M; m0 += mt) {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst + (m0 / mt) * KB * kAmxK * mt);
    const int64_t rows = std::min(mt, M - m0);
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
      const uint16_t* src[8];
      for (int i = 0; i < 8; ++i) src[i] = x + (m0 + r + i) * K;
      for (int64_t p = 0; p < pairs8; p += 8) transpose8x8_store(src, p, d + r, mt);
    }
    for (int64_t rr = 0; rr < rows; ++rr) {
      const uint16_t* s = x + (m0 + rr) * K;
      const int64_t p0 = rr < r ? pairs8 : 0;  // what the transposes left
      for (int64_t p = p0; p < pairs; ++p) {
        uint32_t v;
        std::memcpy(&v, s + 2 * p, sizeof(v));
        d[p * mt + rr] = v;
      }
      if (K % 2) d[pairs * mt + rr] = s[K - 1];  // the odd last element, paired with a zero
    }
  }
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t mt = std::min<int64_t>(M, kAmxRows);
  const int64_t KB = (K + kAmxK - 1) / kAmxK, kb_full = K / kAmxK;
  const int64_t mblocks = (M + mt - 1) / mt, nblocks = (N + kAmxCols - 1) / kAmxCols;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xp(static_cast<size_t>(mblocks * KB * kAmxK * mt));
  amx_pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, mt, KB, xp.data());
  // Odd shapes only (not those of real models): zero-padded copies, so no tile load reads past
  // a weight row or past the tensor.
  std::vector<uint16_t> w_last, tails;
  if (N % kAmxCols) {
    w_last.assign(static_cast<size_t>(kAmxCols * K), 0);
    std::memcpy(w_last.data(), wp + (N / kAmxCols) * kAmxCols * K, static_cast<size_t>((N % kAmxCols) * K) * 2);
  }
  if (K % kAmxK) {
    tails.assign(static_cast<size_t>(nblocks * kAmxCols * kAmxK), 0);
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(tails.data() + n * kAmxK, wp + n * K + kb_full * kAmxK, static_cast<size_t>(K % kAmxK) * 2);
  }
  const AmxArgs a{xp.data(), M, mt, K, KB, kb_full, N, wp,
                  w_last.empty() ? nullptr : w_last.data(), tails.empty() ? nullptr : tails.data(),
                  bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr(),
                  y.scalar_type() == at::kBFloat16};
  // Threads split whole column blocks; the grain keeps tiny problems on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kAmxCols * std::max<int64_t>(K, 32)));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { amx_columns(a, b0, b1); });
  return y;
}

// x [M, K] (bf16 or fp32) -> [M, Kp] fp32 in the even/odd order the weights take in registers:
// within each K block of `block` (16 or 32) elements, the even ones, then the odd ones.
void pack_x(const at::Tensor& x, int64_t block, int64_t Kp, float* dst) {
  const int64_t M = x.size(0), K = x.size(1), half = block / 2;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* d = dst + m * Kp;
      for (int64_t k0 = 0; k0 < Kp; k0 += 16) {  // 16 elements: 8 even, 8 odd
        float* de = d + k0 / block * block + k0 % block / 2;
        const int64_t n = std::clamp<int64_t>(K - k0, 0, 16);
        if (bf16) {
          alignas(32) uint16_t buf[16] = {};
          const uint16_t* s = xb + m * K + k0;
          if (n < 16) s = static_cast<const uint16_t*>(std::memcpy(buf, s, n * 2));
          const EvenOdd v = load_bf16x16(s);
          _mm256_storeu_ps(de, v.e);
          _mm256_storeu_ps(de + half, v.o);
        } else {
          const float* s = xf + m * K + k0;
          for (int64_t i = 0; i < 16; ++i) de[(i % 2) * half + i / 2] = i < n ? s[i] : 0.0f;
        }
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias_opt,
                  bool out_fp32) {
  TORCH_CHECK(x_in.dim() == 2, "rowinv.linear: x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "rowinv.linear: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "rowinv.linear: w must be a 2-D bfloat16 tensor [N, K], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), "rowinv.linear: w must be contiguous (a per-call copy would be slow)");
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "rowinv.linear: CPU tensors only");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "rowinv.linear: x is [", M, ", ", K, "] but w is ", w.sizes());
  at::Tensor bias;
  if (bias_opt.has_value() && bias_opt->defined()) {
    TORCH_CHECK(bias_opt->dim() == 1 && bias_opt->size(0) == N, "rowinv.linear: bias must be [N=", N,
                "], got ", bias_opt->sizes());
    TORCH_CHECK(bias_opt->scalar_type() == at::kBFloat16 || bias_opt->scalar_type() == at::kFloat,
                "rowinv.linear: bias must be bfloat16 or float32, got ", bias_opt->scalar_type());
    bias = bias_opt->to(at::kFloat).contiguous();  // exact widening
  }
  // out_fp32: the fp32 sums before the final rounding (bf16 x), which makes 1-ulp differences
  // in the accumulation visible to tests.
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(out_fp32 ? at::kFloat : x_in.scalar_type()));
  if (M == 0 || N == 0) return y;

  Isa isa = g_isa.load();
  if (isa == Isa::kAmx) {
    if (x_in.scalar_type() == at::kBFloat16) return linear_amx(x_in.contiguous(), w, bias, y);
    isa = Isa::kAvx512;  // fp32 x: the tile unit multiplies bf16 only
  }
  const int64_t block = isa == Isa::kAvx512 ? 32 : 16;
  const int64_t Kp = round_up(K, block);
  const at::Tensor x = x_in.contiguous();
  at::Tensor xp = at::empty({M, Kp}, x.options().dtype(at::kFloat));
  pack_x(x, block, Kp, xp.data_ptr<float>());
  const LinearArgs a{xp.data_ptr<float>(), M, K, Kp, N,
                     reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                     bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr(),
                     y.scalar_type() == at::kBFloat16};

  // Threads split whole column groups; an (m, n) is computed the same way whichever thread owns
  // it. The grain keeps tiny problems, where a fork/join costs more than the work, on one thread.
  const int64_t units = (N + kColGroup - 1) / kColGroup;
  const int64_t unit_work = kColGroup * std::max<int64_t>(K, 16) * std::min<int64_t>(M, 8);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / unit_work);
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * kColGroup, n1 = std::min(u1 * kColGroup, N);
    if (isa == Isa::kAvx512) linear_columns<Isa::kAvx512>(a, n0, n1);
    else linear_columns<Isa::kAvx2>(a, n0, n1);
  });
  return y;
}

// ============================================================================================
// Kernel 1b: the weight-only int8 linear. y[m, n] = sum_k x[m, k] * q[n, k] * scale[n] (+ bias[n])
// with q int8 [N, K] and one fp32 scale per output row (polyspec.kernels.quant's symmetric
// per-row quantization), fp32 math. Each output is one fixed sequence: lane-wise FMAs over K in
// order (8 lanes on the avx2 path, 16 otherwise), a fixed horizontal sum, the K % lanes tail
// added one product at a time, one multiply by the scale, the bias, one rounding. So it is
// row-invariant like the bf16 linear. It exists for the draft head, whose weights stream from
// DRAM at every draft step (the target's forward evicts them): int8 halves those bytes.
// ============================================================================================

constexpr int kW8Rows = 4;  // x rows per tile; with kW8Cols columns, 16 FMA chains
constexpr int kW8Cols = 4;
constexpr int64_t kW8PrefetchGroups = 4;  // ~9 KB ahead at K = 576

struct W8Args {
  const float* x;  // [M, K] fp32
  int64_t M, K, N;
  const int8_t* q;     // [N, K]
  const float* scale;  // [N]
  const float* bias;   // [N] or nullptr
  void* y;             // [M, N] fp32 or bf16
  bool y_bf16;
};

inline void w8_store(const W8Args& a, int64_t m, int64_t n, float dot) {
  float v = dot * a.scale[n];
  if (a.bias) v += a.bias[n];
  if (a.y_bf16) static_cast<uint16_t*>(a.y)[m * a.N + n] = bf16_rne(v);
  else static_cast<float*>(a.y)[m * a.N + n] = v;
}

// The scalar tail of one output after its vector sum: k in [k0, K), one product at a time.
inline float w8_tail(float sum, const float* x, const int8_t* q, int64_t k0, int64_t K) {
  for (int64_t k = k0; k < K; ++k) sum = sum + x[k] * static_cast<float>(q[k]);
  return sum;
}

template <int R, int C>
void w8_tile_avx2(const W8Args& a, int64_t m0, int64_t n0) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t K = a.K, kv = K / 8 * 8;
  const float* x = a.x + m0 * K;
  const int8_t* q = a.q + n0 * K;
  for (int64_t k = 0; k < kv; k += 8) {
    for (int c = 0; c < C; ++c) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c * K + k));
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      w8_store(a, m0 + r, n0 + c, w8_tail(hsum8(acc[r][c]), x + r * K, q + c * K, kv, K));
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
template <int R, int C>
void w8_tile_avx512(const W8Args& a, int64_t m0, int64_t n0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t K = a.K, kv = K / 16 * 16;
  const float* x = a.x + m0 * K;
  const int8_t* q = a.q + n0 * K;
  for (int64_t k = 0; k < kv; k += 16) {
    for (int c = 0; c < C; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * K + k));
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      w8_store(a, m0 + r, n0 + c, w8_tail(hsum16(acc[r][c]), x + r * K, q + c * K, kv, K));
}
#pragma GCC pop_options

template <bool Wide, int C>
void w8_rows(const W8Args& a, int64_t n0) {
  for (int64_t m = 0; m < a.M; m += kW8Rows) {
    switch (std::min<int64_t>(kW8Rows, a.M - m)) {
#define POLYSPEC_W8_CASE(R)                                  \
  case R:                                                    \
    if constexpr (Wide) w8_tile_avx512<R, C>(a, m, n0);      \
    else w8_tile_avx2<R, C>(a, m, n0);                       \
    break;
      POLYSPEC_W8_CASE(4)
      POLYSPEC_W8_CASE(3)
      POLYSPEC_W8_CASE(2)
      default:
        if constexpr (Wide) w8_tile_avx512<1, C>(a, m, n0);
        else w8_tile_avx2<1, C>(a, m, n0);
#undef POLYSPEC_W8_CASE
    }
  }
}

template <bool Wide>
void w8_columns(const W8Args& a, int64_t g0, int64_t g1) {
  const char* end = reinterpret_cast<const char*>(a.q + a.N * a.K);
  const int64_t group_bytes = kW8Cols * a.K;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kW8Cols;
    // The hardware prefetcher alone left this kernel well below the bf16 kernel's DRAM rate: ask
    // for the group kW8PrefetchGroups ahead, one line at a time, into L2, before computing this
    // one (measured faster than into L1 and than no prefetch; 2 to 32 groups ahead alike).
    // benchmarks/bench_draft_kernels.py times the result.
    const char* pf = reinterpret_cast<const char*>(a.q + n0 * a.K) + kW8PrefetchGroups * group_bytes;
    for (int64_t i = 0; i < group_bytes && pf + i < end; i += 64) _mm_prefetch(pf + i, _MM_HINT_T1);
    if (n0 + kW8Cols <= a.N) {
      w8_rows<Wide, kW8Cols>(a, n0);
    } else {
      for (int64_t n = n0; n < a.N; ++n) w8_rows<Wide, 1>(a, n);
    }
  }
}

at::Tensor linear_w8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias_opt, bool out_fp32) {
  TORCH_CHECK(x_in.dim() == 2, "rowinv.linear_w8: x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "rowinv.linear_w8: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "rowinv.linear_w8: q must be a contiguous 2-D int8 tensor [N, K], got ", q.scalar_type(), " ",
              q.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "rowinv.linear_w8: x is [", M, ", ", K, "] but q is ", q.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "rowinv.linear_w8: scale must be a contiguous float32 [N=", N, "], got ", scale.scalar_type(), " ",
              scale.sizes());
  TORCH_CHECK(x_in.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(),
              "rowinv.linear_w8: CPU tensors only");
  at::Tensor bias;
  if (bias_opt.has_value() && bias_opt->defined()) {
    TORCH_CHECK(bias_opt->dim() == 1 && bias_opt->size(0) == N, "rowinv.linear_w8: bias must be [N=", N,
                "], got ", bias_opt->sizes());
    bias = bias_opt->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(out_fp32 ? at::kFloat : x_in.scalar_type()));
  if (M == 0 || N == 0) return y;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const W8Args a{x.data_ptr<float>(), M, K, N, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                 bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr(), y.scalar_type() == at::kBFloat16};
  const bool wide = g_isa.load() != Isa::kAvx2;
  const int64_t groups = (N + kW8Cols - 1) / kW8Cols;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kW8Cols * std::max<int64_t>(K, 16) * std::min<int64_t>(M, 4)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    if (wide) w8_columns<true>(a, g0, g1);
    else w8_columns<false>(a, g0, g1);
  });
  return y;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    default: return "avx2";
  }
}

Isa best_isa() { return cpu_has_amx() ? Isa::kAmx : cpu_has_avx512() ? Isa::kAvx512 : Isa::kAvx2; }

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"avx2"};
  if (cpu_has_avx512()) names.push_back("avx512");
  if (cpu_has_amx()) names.push_back("amx");
  return names;
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_isa = best_isa();
  } else if (name == "avx2") {
    g_isa = Isa::kAvx2;
  } else if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "rowinv: the avx512 path needs AVX-512 F and BW, which this CPU lacks; ",
                "its only path is avx2");
    g_isa = Isa::kAvx512;
  } else if (name == "amx") {
    TORCH_CHECK(cpu_has_amx(), "rowinv: the amx path needs AMX-TILE and AMX-BF16 (and AVX-512), and Linux's "
                "permission to use them; this CPU or kernel lacks them. Paths here: avx2",
                cpu_has_avx512() ? ", avx512" : "");
    g_isa = Isa::kAmx;
  } else {
    TORCH_CHECK(false, "rowinv: unknown ISA '", name, "'; use 'auto', 'avx2', 'avx512' or 'amx'");
  }
}

// ============================================================================================
// Kernel 2: attention over a slot pool, one CSR list of slots per query row.
// For (t, h): s_j = scale * dot(q, k_j) (one 8-lane FMA chain over D, then hsum8);
// m = max s; p_j = exp(s_j - m) with the vector exp on every element; l = sum_j p_j in order j;
// o = sum_j p_j v_j in order j (lanes over D); out = bf16(o / l).
// ============================================================================================

// exp(x) on [-87.33, 88]: x = n ln2 + r (Cody-Waite, |r| <= ln2/2), degree-6 polynomial
// (Cephes expf coefficients, ~1 ulp), times 2^n built in the exponent field. Below -87.33 the
// result would be subnormal: return 0 exactly. Callers only pass s - max <= 0. exp(0) == 1.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));  // operand order keeps NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // n*C1 exact: C1 has 9 bits
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Key/value rows are gathered from anywhere in the pool, which the hardware prefetcher cannot
// predict; fetch the row kAhead keys ahead so the gather does not wait on L3/DRAM latency.
constexpr int64_t kAhead = 16;  // measured: 16 beats 0 and 32 with cold (DRAM) caches
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
  _mm_prefetch(c + bytes - 1, _MM_HINT_T0);  // rows need not start on a cache line
}

// Head vectors use the same even/odd order as the linear kernel (one load + shift + mask per 16
// bf16) for every full 16-block; a trailing 8 (D % 16 == 8) stays in natural order.
inline int64_t packed_pos(int64_t d, int64_t D) {
  const int64_t full = D / 16 * 16;
  return d < full ? d / 16 * 16 + (d % 2) * 8 + (d % 16) / 2 : d;
}

constexpr int64_t kMaxD = 512;  // also the per-head stride of the q and o buffers below

// The G query heads that share one kv head (GQA) are computed together: each key or value row
// is loaded and widened once for all G heads. Every (head, key) score and every (head, lane)
// sum is its own chain whose op sequence does not depend on G or on the keys beside it, so
// G = 1 gives a head the same bits as any G.
// s[h][j] = scale * dot(q_h, k_j): acc = fma(q_even, k_even, acc); acc = fma(q_odd, k_odd, acc)
// per 16-block; a trailing 8 in natural order; hsum8.
template <int G, int NK>
inline void scores_group(const float* qp, int64_t D, const uint16_t* const* k, float scale, float* const* s,
                         int64_t j0) {
  __m256 acc[G][NK];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NK; ++j) acc[h][j] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    for (int j = 0; j < NK; ++j) {
      const EvenOdd kv = load_bf16x16(k[j] + d);
      for (int h = 0; h < G; ++h) {
        acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * kMaxD + d), kv.e, acc[h][j]);
        acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * kMaxD + d + 8), kv.o, acc[h][j]);
      }
    }
  }
  if (d < D) {
    for (int j = 0; j < NK; ++j) {
      const __m256 kt = load_bf16x8(k[j] + d);
      for (int h = 0; h < G; ++h) acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + h * kMaxD + d), kt, acc[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NK; ++j) s[h][j0 + j] = scale * hsum8(acc[h][j]);
}

// o_h[d0 : d0 + 8*NV] (packed order) = sum_j p_h[j] v_j in order j; if l is given, also
// l[h] = sum_j p_h[j] in the same order (a free scalar chain beside the FMAs).
template <int G, int NV>
inline void weighted_sum_group(const float* const* p, int64_t L, const uint16_t* v, const int64_t* slots,
                               int64_t vstride, int64_t d0, float* o, float* l) {
  __m256 acc[G][NV];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < NV; ++i) acc[h][i] = _mm256_setzero_ps();
  float sum[G];
  for (int h = 0; h < G; ++h) sum[h] = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    if (j + kAhead < L) prefetch_bytes(v + slots[j + kAhead] * vstride + d0, NV * 16);
    const uint16_t* row = v + slots[j] * vstride + d0;
    if (NV >= 2) {  // NV even: pairs of 8 lanes in the even/odd order of weighted_sum
      for (int i = 0; i + 1 < NV; i += 2) {
        const EvenOdd vv = load_bf16x16(row + 8 * i);
        for (int h = 0; h < G; ++h) {
          const __m256 pj = _mm256_set1_ps(p[h][j]);
          acc[h][i] = _mm256_fmadd_ps(pj, vv.e, acc[h][i]);
          acc[h][i + 1] = _mm256_fmadd_ps(pj, vv.o, acc[h][i + 1]);
        }
      }
    } else {
      const __m256 vt = load_bf16x8(row);
      for (int h = 0; h < G; ++h) acc[h][0] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][j]), vt, acc[h][0]);
    }
    if (l)
      for (int h = 0; h < G; ++h) sum[h] += p[h][j];
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + h * kMaxD + d0 + 8 * i, acc[h][i]);
  if (l)
    for (int h = 0; h < G; ++h) l[h] = sum[h];
}



void check_cache(const at::Tensor& c, const char* name, int64_t D) {
  TORCH_CHECK(c.dim() == 3 && c.scalar_type() == at::kBFloat16, "rowinv.attention: ", name,
              " must be a 3-D bfloat16 tensor [S, Hkv, D], got ", c.scalar_type(), " ", c.sizes());
  TORCH_CHECK(c.size(2) == D, "rowinv.attention: ", name, " has D=", c.size(2), " but q has D=", D);
  TORCH_CHECK(c.stride(2) == 1 && c.stride(1) == D, "rowinv.attention: ", name,
              " must have contiguous [Hkv, D] rows (slot stride may be anything), got strides ", c.strides());
}

// out_fp32 returns o / l unrounded: the bf16 rounding hides most 1-ulp differences, so the
// invariance tests use it; the model path uses bf16.
// Attention of the G query heads h0 .. h0 + G - 1 of token t, which share kv head g: the steps
// of Kernel 2 above for each head (scores, max, exp, sums, weighted values, divide), with each
// key and value row read once for the group. attend_group (AVX2) and attend_group512 (below)
// share every step but the two loops over the keys, whose per-lane operations are the same.

// q rows of the group -> fp32 in the packed order of the score chains.
template <int G>
inline void pack_q(const uint16_t* qb, int64_t t, int64_t Hq, int64_t h0, int64_t D, float* qp) {
  for (int h = 0; h < G; ++h) {
    const uint16_t* qh = qb + (t * Hq + h0 + h) * D;
    for (int64_t d = 0; d < D; ++d) qp[h * kMaxD + packed_pos(d, D)] = bf16_to_f32(qh[d]);
  }
}

// Scores [L] -> exp(s - max s) in place, per head; the padding up to Lp exps to exactly 0.
template <int G>
inline void exp_scores(float* const* s, int64_t L, int64_t Lp) {
  for (int h = 0; h < G; ++h) {
    float* sh = s[h];
    for (int64_t j = L; j < Lp; ++j) sh[j] = -INFINITY;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sh + j));
    const __m256 m = _mm256_set1_ps(hmax8(mv));
    for (int64_t j = 0; j < Lp; j += 8) _mm256_storeu_ps(sh + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + j), m)));
  }
}

// The weighted sums from lane d0 on (AVX2): 64 lanes per pass for one head, 32 for a group.
template <int G>
inline void weighted_sums_from(const float* const* pc, int64_t L, const uint16_t* vg, const int64_t* slots,
                               int64_t slot_v, int64_t d0, int64_t D, float* o, float* l) {
  if constexpr (G == 1)
    for (; d0 + 64 <= D; d0 += 64) weighted_sum_group<G, 8>(pc, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
  for (; d0 + 32 <= D; d0 += 32) weighted_sum_group<G, 4>(pc, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
  if (d0 + 16 <= D) {
    weighted_sum_group<G, 2>(pc, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
    d0 += 16;
  }
  if (d0 < D) weighted_sum_group<G, 1>(pc, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
}

// out = o / l per head, back to natural order.
template <int G>
inline void store_group(const float* o, const float* l, int64_t t, int64_t Hq, int64_t h0, int64_t D, uint16_t* ob,
                        float* of) {
  for (int h = 0; h < G; ++h) {
    const int64_t i = t * Hq + h0 + h;
    for (int64_t d = 0; d < D; ++d) {
      const float r = o[h * kMaxD + packed_pos(d, D)] / l[h];
      if (of) of[i * D + d] = r;
      else ob[i * D + d] = bf16_rne(r);
    }
  }
}

template <int G>
void attend_group(const uint16_t* qb, const uint16_t* kb, const uint16_t* vb, int64_t slot_k, int64_t slot_v,
                  const int64_t* slots, int64_t L, int64_t D, int64_t h0, int64_t g, int64_t Hq, int64_t t,
                  float scale, float* sbuf, uint16_t* ob, float* of) {
  alignas(32) float qp[G * kMaxD];
  alignas(32) float o[G * kMaxD];
  const int64_t Lp = round_up(L, 8);
  float* s[G];
  for (int h = 0; h < G; ++h) s[h] = sbuf + h * Lp;
  pack_q<G>(qb, t, Hq, h0, D, qp);
  const uint16_t* kg = kb + g * D;
  int64_t j = 0;
  // Enough independent FMA chains without spilling: 8 keys for one head, 4 keys x G heads.
  constexpr int NK = G == 1 ? 8 : 4;
  for (; j + NK <= L; j += NK) {
    const uint16_t* rows[NK];
    for (int a = 0; a < NK; ++a) {
      rows[a] = kg + slots[j + a] * slot_k;
      if (j + a + kAhead < L) prefetch_bytes(kg + slots[j + a + kAhead] * slot_k, D * 2);
    }
    scores_group<G, NK>(qp, D, rows, scale, s, j);
  }
  for (; j < L; ++j) {
    const uint16_t* row = kg + slots[j] * slot_k;
    scores_group<G, 1>(qp, D, &row, scale, s, j);
  }
  exp_scores<G>(s, L, Lp);
  float l[G];
  weighted_sums_from<G>(s, L, vb + g * D, slots, slot_v, 0, D, o, l);
  store_group<G>(o, l, t, Hq, h0, D, ob, of);
}

// --------------------------------------------------------------------------------------------
// The AVX-512 attention: the AVX2 kernel's operations lane for lane, twice as wide, so its bits
// are the AVX2 kernel's (tests/core/test_cpu_rowinv.py compares them). A score chain is 8 lanes
// wide, so two keys share a 16-lane register (key 2p in lanes 0-7, 2p+1 in lanes 8-15, q in
// both halves), and hsum8's additions run for 8 keys at once. A weighted sum is one chain per
// lane, so it simply covers 16 lanes (two 16-blocks' even or odd halves) per register.
// --------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

// 8 fp32 (one 8-lane chain's operand) in both halves of a 512-bit register.
inline __m512 dup8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// load_bf16x16 of two rows: lanes 0-7 row a's even / odd elements, lanes 8-15 row b's.
inline EvenOdd512 load_bf16x16_pair(const uint16_t* a, const uint16_t* b) {
  const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return split_bf16x32(_mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1));
}

// load_bf16x8 of two rows: lanes 0-7 row a, lanes 8-15 row b.
inline __m512 load_bf16x8_pair(const uint16_t* a, const uint16_t* b) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(va), vb, 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// hsum8 of each 8-lane half of a0..a3 (keys 0..7 in order) -> 8 sums, in lanes 0-7. The same
// additions as hsum8: (lo4 + hi4), then lanes (0 + 2, 1 + 3), then lane 0 + lane 1.
inline __m256 hsum8x8(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // Per 128-bit lane, one key: its lo4 + hi4.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x88), _mm512_shuffle_f32x4(a0, a1, 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x88), _mm512_shuffle_f32x4(a2, a3, 0xDD));
  __m512 t01 = _mm512_add_ps(s01, _mm512_permute_ps(s01, 0xEE));  // movehl
  __m512 t23 = _mm512_add_ps(s23, _mm512_permute_ps(s23, 0xEE));
  t01 = _mm512_add_ps(t01, _mm512_permute_ps(t01, 0xF5));  // movehdup
  t23 = _mm512_add_ps(t23, _mm512_permute_ps(t23, 0xF5));
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutex2var_ps(t01, pick, t23));
}

// scores_group<G, 8> for keys k[0..7]: the same chains, two keys per register.
template <int G>
inline void scores_group512(const float* qp, int64_t D, const uint16_t* const* k, float scale, float* const* s,
                            int64_t j0) {
  __m512 acc[G][4];
  for (int h = 0; h < G; ++h)
    for (int p = 0; p < 4; ++p) acc[h][p] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 qe[G], qo[G];
    for (int h = 0; h < G; ++h) {
      qe[h] = dup8(qp + h * kMaxD + d);
      qo[h] = dup8(qp + h * kMaxD + d + 8);
    }
    for (int p = 0; p < 4; ++p) {
      const EvenOdd512 kv = load_bf16x16_pair(k[2 * p] + d, k[2 * p + 1] + d);
      for (int h = 0; h < G; ++h) {
        acc[h][p] = _mm512_fmadd_ps(qe[h], kv.e, acc[h][p]);
        acc[h][p] = _mm512_fmadd_ps(qo[h], kv.o, acc[h][p]);
      }
    }
  }
  if (d < D) {
    for (int p = 0; p < 4; ++p) {
      const __m512 kt = load_bf16x8_pair(k[2 * p] + d, k[2 * p + 1] + d);
      for (int h = 0; h < G; ++h) acc[h][p] = _mm512_fmadd_ps(dup8(qp + h * kMaxD + d), kt, acc[h][p]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int h = 0; h < G; ++h)
    _mm256_storeu_ps(s[h] + j0, _mm256_mul_ps(sc, hsum8x8(acc[h][0], acc[h][1], acc[h][2], acc[h][3])));
}

// weighted_sum_group over lanes [d0, d0 + 32 NC): split_bf16x32 of a 32-block gives the even
// halves of its two 16-blocks (the AVX2 kernel's accumulators i and i + 2) in one register and
// the odd halves (i + 1 and i + 3) in another; each lane's chain is unchanged.
template <int G, int NC>
inline void weighted_sum_group512(const float* const* p, int64_t L, const uint16_t* v, const int64_t* slots,
                                  int64_t vstride, int64_t d0, float* o, float* l) {
  __m512 acc[G][2 * NC];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < 2 * NC; ++i) acc[h][i] = _mm512_setzero_ps();
  float sum[G];
  for (int h = 0; h < G; ++h) sum[h] = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    if (j + kAhead < L) prefetch_bytes(v + slots[j + kAhead] * vstride + d0, NC * 64);
    const uint16_t* row = v + slots[j] * vstride + d0;
    for (int c = 0; c < NC; ++c) {
      const EvenOdd512 vv = split_bf16x32(_mm512_loadu_si512(row + 32 * c));
      for (int h = 0; h < G; ++h) {
        const __m512 pj = _mm512_set1_ps(p[h][j]);
        acc[h][2 * c] = _mm512_fmadd_ps(pj, vv.e, acc[h][2 * c]);
        acc[h][2 * c + 1] = _mm512_fmadd_ps(pj, vv.o, acc[h][2 * c + 1]);
      }
    }
    if (l)
      for (int h = 0; h < G; ++h) sum[h] += p[h][j];
  }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < NC; ++c) {
      float* dst = o + h * kMaxD + d0 + 32 * c;
      const __m512 e = acc[h][2 * c], od = acc[h][2 * c + 1];
      _mm256_storeu_ps(dst, _mm512_castps512_ps256(e));
      _mm256_storeu_ps(dst + 8, _mm512_castps512_ps256(od));
      _mm256_storeu_ps(dst + 16, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
      _mm256_storeu_ps(dst + 24, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(od), 1)));
    }
  if (l)
    for (int h = 0; h < G; ++h) l[h] = sum[h];
}

template <int G>
void attend_group512(const uint16_t* qb, const uint16_t* kb, const uint16_t* vb, int64_t slot_k, int64_t slot_v,
                     const int64_t* slots, int64_t L, int64_t D, int64_t h0, int64_t g, int64_t Hq, int64_t t,
                     float scale, float* sbuf, uint16_t* ob, float* of) {
  alignas(64) float qp[G * kMaxD];
  alignas(64) float o[G * kMaxD];
  const int64_t Lp = round_up(L, 8);
  float* s[G];
  for (int h = 0; h < G; ++h) s[h] = sbuf + h * Lp;
  pack_q<G>(qb, t, Hq, h0, D, qp);
  const uint16_t* kg = kb + g * D;
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const uint16_t* rows[8];
    for (int a = 0; a < 8; ++a) {
      rows[a] = kg + slots[j + a] * slot_k;
      if (j + a + kAhead < L) prefetch_bytes(kg + slots[j + a + kAhead] * slot_k, D * 2);
    }
    scores_group512<G>(qp, D, rows, scale, s, j);
  }
  for (; j < L; ++j) {
    const uint16_t* row = kg + slots[j] * slot_k;
    scores_group<G, 1>(qp, D, &row, scale, s, j);
  }
  exp_scores<G>(s, L, Lp);
  float l[G];
  const uint16_t* vg = vb + g * D;
  // 64 lanes a pass (G <= 4: at most 16 accumulators), then 32, then the AVX2 passes.
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weighted_sum_group512<G, 2>(s, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
  if (d0 + 32 <= D) {
    weighted_sum_group512<G, 1>(s, L, vg, slots, slot_v, d0, o, d0 == 0 ? l : nullptr);
    d0 += 32;
  }
  if (d0 < D) weighted_sums_from<G>(s, L, vg, slots, slot_v, d0, D, o, d0 == 0 ? l : nullptr);
  store_group<G>(o, l, t, Hq, h0, D, ob, of);
}

#pragma GCC pop_options

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& kv_indptr_in, const at::Tensor& kv_indices_in, double scale_d,
                     bool out_fp32) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kBFloat16,
              "rowinv.attention: q must be a 3-D bfloat16 tensor [T, Hq, D], got ", q_in.scalar_type(), " ",
              q_in.sizes());
  TORCH_CHECK(q_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "rowinv.attention: CPU tensors only");
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  TORCH_CHECK(D > 0 && D % 8 == 0 && D <= kMaxD,
              "rowinv.attention: head_dim must be a positive multiple of 8, at most ", kMaxD, "; got ", D);
  check_cache(k_cache, "k_cache", D);
  check_cache(v_cache, "v_cache", D);
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1),
              "rowinv.attention: k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(), " differ");
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "rowinv.attention: Hq=", Hq, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK(kv_indptr_in.scalar_type() == at::kLong && kv_indptr_in.dim() == 1 && kv_indptr_in.numel() == T + 1,
              "rowinv.attention: kv_indptr must be int64 of shape [T+1=", T + 1, "], got ",
              kv_indptr_in.scalar_type(), " ", kv_indptr_in.sizes());
  TORCH_CHECK(kv_indices_in.scalar_type() == at::kLong && kv_indices_in.dim() == 1,
              "rowinv.attention: kv_indices must be a 1-D int64 tensor, got ", kv_indices_in.scalar_type(), " ",
              kv_indices_in.sizes());
  const at::Tensor q = q_in.contiguous(), indptr_t = kv_indptr_in.contiguous(), idx_t = kv_indices_in.contiguous();
  const int64_t* indptr = indptr_t.data_ptr<int64_t>();
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  const int64_t nnz = idx_t.numel();

  // Validate everything before any thread starts, so errors are clear and never half-written.
  int64_t max_len = 0;
  TORCH_CHECK(indptr[0] >= 0, "rowinv.attention: kv_indptr[0]=", indptr[0], " is negative");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(indptr[t + 1] > indptr[t], "rowinv.attention: query row ", t, " has an empty (or negative) key list: ",
                "kv_indptr[", t, "]=", indptr[t], ", kv_indptr[", t + 1, "]=", indptr[t + 1],
                "; every row must attend to at least one slot");
    max_len = std::max(max_len, indptr[t + 1] - indptr[t]);
  }
  TORCH_CHECK(indptr[T] <= nnz, "rowinv.attention: kv_indptr[T]=", indptr[T], " exceeds kv_indices.numel()=", nnz);
  for (int64_t i = (T > 0 ? indptr[0] : 0); i < (T > 0 ? indptr[T] : 0); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < S, "rowinv.attention: kv_indices[", i, "]=", idx[i],
                " is out of range for a cache of ", S, " slots");

  at::Tensor out = at::empty({T, Hq, D}, q.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (T == 0 || Hq == 0) return out;
  const float scale = static_cast<float>(scale_d);
  const int64_t group = Hq / Hkv, slot_k = k_cache.stride(0), slot_v = v_cache.stride(0);
  const auto* qb = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kb = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vb = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto* ob = out_fp32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  float* of = out_fp32 ? out.data_ptr<float>() : nullptr;

  // Read once, so no call mixes paths (their bits agree anyway). AMX implies AVX-512.
  const bool wide = g_isa.load() != Isa::kAvx2;
  if (group >= 2 && group <= 4) {
    // One (t, kv head) per work item, its query heads together.
    at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> sbuf(static_cast<size_t>(group * round_up(max_len, 8)));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / Hkv, g = i % Hkv;
        const int64_t* slots = idx + indptr[t];
        const int64_t L = indptr[t + 1] - indptr[t];
        const auto run = [&](auto fn) {
          fn(qb, kb, vb, slot_k, slot_v, slots, L, D, g * group, g, Hq, t, scale, sbuf.data(), ob, of);
        };
        if (group == 2) wide ? run(attend_group512<2>) : run(attend_group<2>);
        else if (group == 3) wide ? run(attend_group512<3>) : run(attend_group<3>);
        else wide ? run(attend_group512<4>) : run(attend_group<4>);
      }
    });
    return out;
  }
  // Other group sizes: one (t, h) per work item. Its result never depends on who computes it.
  at::parallel_for(0, T * Hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sbuf(static_cast<size_t>(round_up(max_len, 8)));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hq, h = i % Hq;
      const int64_t L = indptr[t + 1] - indptr[t];
      (wide ? attend_group512<1> : attend_group<1>)(qb, kb, vb, slot_k, slot_v, idx + indptr[t], L, D, h, h / group,
                                                    Hq, t, scale, sbuf.data(), ob, of);
    }
  });
  return out;
}


// ============================================================================================
// Per-token ops of a decoder layer (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul) in
// bf16 with fp32 math, one call each. In stock PyTorch each is 5-15 small ops, and at one token
// per step their dispatch costs as much as the layer's matrix work. The arithmetic follows
// polyspec.kernels.reference step by step (same roundings to bf16); reductions run in one
// fixed sequential order per row, so they are row-invariant as well. (8 lane sums would make
// the norm ~2 us faster at 8 rows, 0.13 ms a round, but change the bits of every bf16 output:
// measured at 6520afe and reverted in 7fed185.)
// ============================================================================================

// 8 fp32 -> 8 bf16 exactly as bf16_rne does lane by lane (NaNs quieted, the rest rounded to
// nearest even), in natural order.
inline __m128i bf16_rne8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);  // every lane in [0, 0xFFFF]
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

constexpr int64_t kRowGrain = 16;  // rows per task: below this, threading costs more than it saves

void check_bf16_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              " must be a contiguous 2-D bfloat16 tensor [T, H], got ", x.scalar_type(), " ", x.sizes());
}

// out[t] = w * bf16(x[t] * rsqrt(mean(x[t]^2) + eps)), as LlamaRMSNorm.
// Each row's sum of squares is one serial fp32 chain, ss = ss + v * v in order of h. The
// chains of up to 8 rows advance together, row r in lane r (8 x 8 blocks transposed in
// registers), with the scalar loop's operations per lane, so the bits are the serial loop's:
// one chain is bound by the add latency, 8 share it (fused_add_rms_norm, 8 rows of 576:
// 7.7 -> 6.0 us, 16 rows 13.6 -> 10.0 us, benchmarks/bench_draft_kernels.py; one row keeps the scalar
// loop).
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

void sum_squares(const uint16_t* x, int64_t t0, int64_t nr, int64_t H, float* ss) {
  if (nr == 1) {
    const uint16_t* xr = x + t0 * H;
    float acc = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float v = bf16_to_f32(xr[h]);
      acc = acc + v * v;
    }
    ss[0] = acc;
    return;
  }
  const uint16_t* rows[8];
  for (int r = 0; r < 8; ++r) rows[r] = x + (t0 + std::min<int64_t>(r, nr - 1)) * H;
  __m256 acc = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {
    __m256 col[8];
    for (int r = 0; r < 8; ++r) col[r] = load_bf16x8(rows[r] + h);
    transpose8(col);  // col[j]: column h + j of the 8 rows
    for (int j = 0; j < 8; ++j) acc = _mm256_add_ps(acc, _mm256_mul_ps(col[j], col[j]));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int64_t r = 0; r < nr; ++r) {
    float a = lanes[r];
    for (int64_t k = h; k < H; ++k) {
      const float v = bf16_to_f32(rows[r][k]);
      a = a + v * v;
    }
    ss[r] = a;
  }
}

void rms_rows(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t T, int64_t H, double eps) {
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    float sums[8];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t k = (t - t0) % 8;
      if (k == 0) sum_squares(x, t, std::min<int64_t>(8, t1 - t), H, sums);
      const uint16_t* xr = x + t * H;
      const float ss = sums[k];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      uint16_t* o = out + t * H;
      const __m256 rv = _mm256_set1_ps(r);
      int64_t h = 0;
      for (; h + 8 <= H; h += 8) {  // the scalar loop's roundings, 8 lanes at a time
        const __m256i normed = _mm256_slli_epi32(
            _mm256_cvtepu16_epi32(bf16_rne8(_mm256_mul_ps(load_bf16x8(xr + h), rv))), 16);
        const __m256 y = _mm256_mul_ps(load_bf16x8(w + h), _mm256_castsi256_ps(normed));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + h), bf16_rne8(y));
      }
      for (; h < H; ++h) {
        const float normed = bf16_to_f32(bf16_rne(bf16_to_f32(xr[h]) * r));
        o[h] = bf16_rne(bf16_to_f32(w[h]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_bf16_rows(x, "rms_norm: x");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "rms_norm: weight must be contiguous bfloat16 [H] with H = ", x.size(1));
  at::Tensor out = at::empty_like(x);
  rms_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(w.data_ptr()),
           reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& w, double eps) {
  check_bf16_rows(x, "fused_add_rms_norm: x");
  check_bf16_rows(residual, "fused_add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual ", residual.sizes(),
              " must have x's shape ", x.sizes());
  at::Tensor total = at::empty_like(x);
  const int64_t n = x.numel();
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* b = reinterpret_cast<const uint16_t*>(residual.data_ptr());
  uint16_t* s = reinterpret_cast<uint16_t*>(total.data_ptr());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s + i),
                     bf16_rne8(_mm256_add_ps(load_bf16x8(a + i), load_bf16x8(b + i))));
  for (; i < n; ++i) s[i] = bf16_rne(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
  return {rms_norm(total, w, eps), total};
}

// out[t, :I] = bf16(silu(x[t, :I]) * x[t, I:]), silu(v) = v / (1 + exp(-v)). Element-wise, so
// the work is split over (row, 512-column chunk) pieces: a verify's few rows still use every
// thread, and an element's arithmetic never depends on the split.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_bf16_rows(x, "silu_and_mul: x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even, got ", x.size(1));
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  constexpr int64_t kChunk = 512;  // a multiple of 8: chunk edges never split a vector
  const int64_t chunks = (I + kChunk - 1) / kChunk;
  const __m256 one = _mm256_set1_ps(1.0f);
  // grain 4 pieces (2,048 elements, ~2 us): below that a second thread costs more than it saves
  at::parallel_for(0, T * chunks, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = p / chunks, i0 = (p % chunks) * kChunk, i1 = std::min(I, i0 + kChunk);
      const uint16_t* g = xp + t * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* o = op + t * I;
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8) {  // element i always takes this path for a given I
        const __m256 gv = load_bf16x8(g + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 r = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), load_bf16x8(u + i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), bf16_rne8(r));
      }
      for (; i < i1; ++i) {
        const float gf = bf16_to_f32(g[i]);
        o[i] = bf16_rne(gf / (1.0f + std::exp(-gf)) * bf16_to_f32(u[i]));
      }
    }
  });
  return out;
}

// Rotary embedding of q and k, fp32 math, new bf16 tensors. neox: pairs (i, i + D/2);
// otherwise interleaved pairs (2i, 2i + 1). cache[pos] = D/2 cos values then D/2 sin values.
void rotate_heads(const uint16_t* x, uint16_t* out, int64_t T, int64_t H, int64_t D, const int64_t* pos,
                  const float* cache, int64_t max_pos, bool neox) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "rotary_embedding: position ", p, " outside the cos/sin cache [0, ",
                  max_pos, ")");
      const float* c = cache + p * D;
      const float* s = c + half;
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t* xr = x + (t * H + h) * D;
        uint16_t* o = out + (t * H + h) * D;
        int64_t i = 0;
        // neox pairs are two contiguous halves: 8 pairs at a time, the scalar loop's exact
        // operations (two products and a difference or sum, each rounded in fp32) per lane.
        for (; neox && i + 8 <= half; i += 8) {
          const __m256 x1 = load_bf16x8(xr + i), x2 = load_bf16x8(xr + i + half);
          const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
          const __m256 y1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
          const __m256 y2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), bf16_rne8(y1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i + half), bf16_rne8(y2));
        }
        for (; i < half; ++i) {
          const int64_t i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
          const float x1 = bf16_to_f32(xr[i1]), x2 = bf16_to_f32(xr[i2]);
          o[i1] = bf16_rne(x1 * c[i] - x2 * s[i]);
          o[i2] = bf16_rne(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                   const at::Tensor& k, const at::Tensor& cos_sin_cache,
                                                   bool is_neox) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && q.dim() == 3 && k.dim() == 3,
              "rotary_embedding: q and k must be bfloat16 [T, H, D]");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "rotary_embedding: k must be [T, Hkv, D] with q's T and",
              " an even D; got q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == D,
              "rotary_embedding: cos_sin_cache must be float32 [max_pos, D=", D, "]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T, "rotary_embedding: positions must be [T]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor cache = cos_sin_cache.contiguous();
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  at::Tensor q_out = at::empty_like(qc), k_out = at::empty_like(kc);
  for (auto [src, dst] : {std::pair<const at::Tensor*, at::Tensor*>{&qc, &q_out}, {&kc, &k_out}}) {
    rotate_heads(reinterpret_cast<const uint16_t*>(src->data_ptr()), reinterpret_cast<uint16_t*>(dst->data_ptr()), T,
                 src->size(1), D, pos.data_ptr<int64_t>(), cache.data_ptr<float>(), cache.size(0), is_neox);
  }
  return {q_out, k_out};
}

// ---------------------------------------------------------------------------------------------
// Entry points the cpu backend calls once per op of a decoder layer, dozens of times a forward.
// They take what the Python model hands over as it is (non-contiguous views, any leading dims)
// and do in C++ what a Python wrapper did around each call: at batch 1 those wrappers cost
// about as much as the kernels they wrapped. The arithmetic is the kernels' own, unchanged.

at::Tensor rms_norm_any(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x.contiguous(), weight.contiguous(), eps);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_any(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  return fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps);
}

at::Tensor silu_and_mul_any(const at::Tensor& x) {  // [..., 2I] -> [..., I]
  TORCH_CHECK(x.dim() >= 1, "silu_and_mul: x must have at least one dim");
  if (x.dim() == 2) return silu_and_mul(x.contiguous());
  const int64_t last = x.size(-1);
  at::Tensor out = silu_and_mul(x.reshape({-1, last}).contiguous());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last / 2;
  return out.view(shape);
}

// k_cache[loc] = k, v_cache[loc] = v (as index_copy_), then attention() over the CSR lists: the
// store and the attend of one layer in one call. k / v may be strided views (slices of a qkv).
at::Tensor store_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& loc_in, const at::Tensor& kv_indptr,
                            const at::Tensor& kv_indices, double scale) {
  const int64_t T = k.size(0);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "store_and_attend: k and v must be bfloat16 [T, Hkv, D] of one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2),
              "store_and_attend: the caches must be contiguous bfloat16 [slots, Hkv, D] matching k ", k.sizes(),
              ", got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(loc_in.dim() == 1 && loc_in.size(0) == T, "store_and_attend: loc must be [T=", T, "], got ",
              loc_in.sizes());
  const at::Tensor loc = loc_in.to(at::kLong).contiguous();
  const int64_t slots = k_cache.size(0), row = k.size(1) * k.size(2);
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "store_and_attend: loc ", lp[t], " outside the cache's ", slots,
                " slots");
  // A token's [Hkv, D] block is contiguous in the model's k / v (slices of qkv along heads):
  // copy from the view with its token stride; only other layouts get a contiguous copy first.
  auto token_rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor kc = token_rows(k), vc = token_rows(v);
  auto* kd = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  auto* vd = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const int64_t k_step = kc.stride(0), v_step = vc.stride(0);
  for (int64_t t = 0; t < T; ++t) {  // a repeated slot keeps the last row, as index_copy_ on the CPU
    std::memcpy(kd + lp[t] * row, ks + t * k_step, row * 2);
    std::memcpy(vd + lp[t] * row, vs + t * v_step, row * 2);
  }
  return attention(q.contiguous(), k_cache, v_cache, kv_indptr, kv_indices, scale, false);
}

// A weight bound once, called as fn(x, bias) by polyspec.model.linear: the call goes straight
// from Python to the kernel. x may have any leading dims.
at::Tensor flat_call(const at::Tensor& x, int64_t n, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (x.dim() == 2) return f(x);
  TORCH_CHECK(x.dim() >= 1, "linear: x must have at least one dim");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  const int64_t K = shape.back();
  shape.back() = n;
  return f(x.reshape({x.numel() / std::max<int64_t>(K, 1), K})).view(shape);
}

struct BoundLinear {
  at::Tensor w;  // [N, K] bf16, contiguous
  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& bias) const {
    return flat_call(x, w.size(0), [&](const at::Tensor& x2) { return linear(x2, w, bias, false); });
  }
};

struct BoundLinearW8 {
  at::Tensor q, scale;  // [N, K] int8, [N] fp32
  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& bias) const {
    return flat_call(x, q.size(0), [&](const at::Tensor& x2) { return linear_w8(x2, q, scale, bias, false); });
  }
};

}  // namespace

// select_top_k at step >= 1 (polyspec.kernels.reference): per request, the K best of the K*K
// products scores[b, i] * topk_p[b*K + i, j] (fp32 products, as torch's), ties lower candidate
// first; their tokens, the hidden rows of the lanes they came from and their parent ids. One
// call instead of ~10 torch ops (29 us -> 5 us a step, benchmarks/bench_draft_kernels.py).
// Returns (input_ids [bs*K], hidden [bs*K, F], cs_p [bs, K], flat_scores [bs, K*K],
// tree_parents [bs, K]).
std::vector<at::Tensor> select_top_k_step(int64_t step, const at::Tensor& topk_p_in, const at::Tensor& topk_index_in,
                                          const at::Tensor& hidden_in, const at::Tensor& scores_in, int64_t K) {
  TORCH_CHECK(step >= 1 && K >= 1, "rowinv.select_top_k_step: needs step >= 1 and topk >= 1");
  TORCH_CHECK(scores_in.dim() == 2 && scores_in.size(1) == K && scores_in.scalar_type() == at::kFloat,
              "rowinv.select_top_k_step: scores must be float32 [bs, K=", K, "]");
  const int64_t bs = scores_in.size(0);
  TORCH_CHECK(topk_p_in.sizes() == at::IntArrayRef({bs * K, K}) && topk_p_in.scalar_type() == at::kFloat,
              "rowinv.select_top_k_step: topk_p must be float32 [bs*K, K]");
  TORCH_CHECK(topk_index_in.sizes() == topk_p_in.sizes() &&
                  (topk_index_in.scalar_type() == at::kLong || topk_index_in.scalar_type() == at::kInt),
              "rowinv.select_top_k_step: topk_index must be int64 or int32 [bs*K, K]");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(0) == bs * K,
              "rowinv.select_top_k_step: hidden must be [bs*K, F]");
  const at::Tensor p = topk_p_in.contiguous(), sc = scores_in.contiguous(), idx = topk_index_in.contiguous();
  const at::Tensor hid = hidden_in.contiguous();
  const int64_t KK = K * K, F = hid.size(1), esize = hid.element_size();
  at::Tensor flat = at::empty({bs, KK}, p.options());
  at::Tensor cs_p = at::empty({bs, K}, p.options());
  at::Tensor ids = at::empty({bs * K}, idx.options());
  at::Tensor parents = at::empty({bs, K}, idx.options());
  at::Tensor out_h = at::empty({bs * K, F}, hid.options());
  const float* pp = p.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* fp = flat.data_ptr<float>();
  float* cp = cs_p.data_ptr<float>();
  const bool i64 = idx.scalar_type() == at::kLong;
  const char* hsrc = static_cast<const char*>(hid.data_ptr());
  char* hdst = static_cast<char*>(out_h.data_ptr());
  std::vector<int64_t> best(K);
  for (int64_t b = 0; b < bs; ++b) {
    float* row = fp + b * KK;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) row[i * K + j] = sp[b * K + i] * pp[(b * K + i) * K + j];
    int64_t n = 0;  // insertion into the K best, a later equal value after the earlier
    for (int64_t c = 0; c < KK; ++c) {
      if (n == K && !(row[c] > row[best[K - 1]])) continue;
      int64_t at = n < K ? n++ : K - 1;
      while (at > 0 && row[best[at - 1]] < row[c]) {
        best[at] = best[at - 1];
        --at;
      }
      best[at] = c;
    }
    for (int64_t r = 0; r < K; ++r) {
      const int64_t c = best[r], lane = c / K;
      cp[b * K + r] = row[c];
      const int64_t tok_at = (b * K) * K + c;  // flat_tokens[b, c] = topk_index[b*K + c/K, c%K]
      const int64_t parent = c + KK * (step - 1) + K;
      if (i64) {
        ids.data_ptr<int64_t>()[b * K + r] = idx.data_ptr<int64_t>()[tok_at];
        parents.data_ptr<int64_t>()[b * K + r] = parent;
      } else {
        ids.data_ptr<int32_t>()[b * K + r] = idx.data_ptr<int32_t>()[tok_at];
        parents.data_ptr<int32_t>()[b * K + r] = static_cast<int32_t>(parent);
      }
      std::memcpy(hdst + (b * K + r) * F * esize, hsrc + (b * K + lane) * F * esize, F * esize);
    }
  }
  return {ids, out_h, cs_p, flat, parents};
}

// softmax_topk (polyspec.kernels.reference): per row, the k largest softmax probabilities and
// their ids. One pass keeps the running max and the k best logits (insertion; a later equal
// logit never displaces an earlier one, so ties come lower id first), a second sums
// exp(l - max) in 8 fp32 lanes; p = exp(l - max) / sum. Replaces softmax + topk over the whole
// draft vocabulary (3 x 16384: 84 us -> 30 us, benchmarks/bench_draft_kernels.py).
constexpr int64_t kMaxTopk = 64;

void softmax_topk_row(const float* l, int64_t V, int64_t k, float* p_out, int64_t* i_out) {
  float top[kMaxTopk];
  int64_t ids[kMaxTopk];
  std::fill(top, top + k, -INFINITY);
  std::fill(ids, ids + k, int64_t{0});
  float thr = -INFINITY;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  auto insert = [&](float v, int64_t i) {
    int64_t at = k - 1;
    while (at > 0 && top[at - 1] < v) {
      top[at] = top[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    top[at] = v;
    ids[at] = i;
    thr = top[k - 1];
  };
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(l + j);
    mv = _mm256_max_ps(mv, v);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GT_OQ));
    while (mask) {
      const int b = __builtin_ctz(mask);
      mask &= mask - 1;
      if (l[j + b] > thr) insert(l[j + b], j + b);
    }
  }
  float m = hmax8(mv);
  for (; j < V; ++j) {
    m = std::max(m, l[j]);
    if (l[j] > thr) insert(l[j], j);
  }
  const __m256 mb = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (j = 0; j + 8 <= V; j += 8) acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(l + j), mb)));
  float sum = hsum8(acc);
  alignas(32) float tail[8];
  for (int64_t t = 0; j + t < V; ++t) tail[t] = l[j + t] - m;
  if (j < V) {
    alignas(32) float e[8];
    for (int64_t t = V - j; t < 8; ++t) tail[t] = -INFINITY;
    _mm256_store_ps(e, exp256(_mm256_load_ps(tail)));
    for (int64_t t = 0; t < V - j; ++t) sum += e[t];
  }
  for (int64_t a = 0; a < k; ++a) {
    p_out[a] = std::exp(top[a] - m) / sum;
    i_out[a] = ids[a];
  }
}

std::vector<at::Tensor> softmax_topk(const at::Tensor& logits_in, int64_t k) {
  TORCH_CHECK(logits_in.dim() == 2 && (logits_in.scalar_type() == at::kBFloat16 || logits_in.scalar_type() == at::kFloat),
              "rowinv.softmax_topk: logits must be a 2-D bfloat16 or float32 tensor [n, V], got ",
              logits_in.scalar_type(), " ", logits_in.sizes());
  const int64_t n = logits_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(k >= 1 && k <= V && k <= kMaxTopk, "rowinv.softmax_topk: k must be in [1, min(V, 64)], got k=", k,
              " for V=", V);
  const at::Tensor l = logits_in.to(at::kFloat).contiguous();
  at::Tensor p = at::empty({n, k}, l.options());
  at::Tensor idx = at::empty({n, k}, l.options().dtype(at::kLong));
  const float* lp = l.data_ptr<float>();
  float* pp = p.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) softmax_topk_row(lp + r * V, V, k, pp + r * k, ip + r * k);
  });
  return {p, idx};
}

// The GIL is released while the kernels run (arguments are converted before, the result after),
// so a Python thread (e.g. a drafter) is not blocked by a long prefill.
// Greedy tree verification, polyspec.kernels.reference.verify_tree_greedy's semantics on int64
// CPU tensors: a walk of at most S depths over at most N - 1 children each. The reference runs
// it as ~S * N masked torch ops per call (~1 ms a round on 2 cores); here it is a loop.
// Returns (predicts [bs * N], accept_index [bs, S + 1], accept_length [bs]).
std::vector<at::Tensor> verify_tree_greedy(const at::Tensor& candidates, const at::Tensor& retrive_index,
                                           const at::Tensor& next_token, const at::Tensor& next_sibling,
                                           const at::Tensor& target_predict, int64_t steps) {
  for (const at::Tensor* t : {&candidates, &retrive_index, &next_token, &next_sibling, &target_predict}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 2 &&
                    t->sizes() == candidates.sizes(),
                "rowinv.verify_tree_greedy: every input must be a contiguous int64 CPU tensor [bs, N]");
  }
  TORCH_CHECK(steps >= 0, "rowinv.verify_tree_greedy: steps must be >= 0");
  const int64_t bs = candidates.size(0), n = candidates.size(1);
  at::Tensor predicts = at::zeros({bs * n}, candidates.options());
  at::Tensor accept_index = at::full({bs, steps + 1}, -1, candidates.options());
  at::Tensor accept_length = at::zeros({bs}, candidates.options());
  const int64_t* cand = candidates.data_ptr<int64_t>();
  const int64_t* gidx = retrive_index.data_ptr<int64_t>();
  const int64_t* first = next_token.data_ptr<int64_t>();
  const int64_t* sibling = next_sibling.data_ptr<int64_t>();
  const int64_t* target = target_predict.data_ptr<int64_t>();
  int64_t* pred = predicts.data_ptr<int64_t>();
  int64_t* path = accept_index.data_ptr<int64_t>();
  int64_t* length = accept_length.data_ptr<int64_t>();
  auto link = [n](int64_t v) { return v >= 0 && v < n ? v : int64_t{-1}; };
  std::vector<char> on_path(static_cast<size_t>(n));
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t row = b * n;
    std::fill(on_path.begin(), on_path.end(), 0);
    on_path[0] = 1;
    path[b * (steps + 1)] = gidx[row];
    int64_t cur = 0;
    for (int64_t depth = 1; depth <= steps; ++depth) {
      const int64_t want = target[row + cur];
      int64_t child = link(first[row + cur]), accepted = -1;
      for (int64_t i = 0; i < n - 1 && child >= 0; ++i) {
        if (cand[row + child] == want) {
          accepted = child;
          break;
        }
        child = link(sibling[row + child]);
      }
      if (accepted < 0) break;
      cur = accepted;
      length[b] += 1;
      path[b * (steps + 1) + depth] = gidx[row + cur];
      on_path[cur] = 1;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = gidx[row + j];
      TORCH_CHECK(g >= 0 && g < bs * n, "rowinv.verify_tree_greedy: retrive_index[", b, ", ", j, "] = ", g,
                  " is outside [0, bs * N)");
      pred[g] = on_path[j] ? target[row + j] : 0;
    }
  }
  return {predicts, accept_index, accept_length};
}

// The links and ancestor walk of polyspec.kernels.reference.build_tree on int64 CPU tensors (the
// reference is ~60 torch ops, ~0.45 ms a round on 2 cores). parent_list [bs, P], selected
// [bs, N - 1]. Returns (tree [bs, N, N] bool, depth [bs, N], next_token [bs, N], next_sibling
// [bs, N]); the caller lays out the mask and positions.
std::vector<at::Tensor> build_tree(const at::Tensor& parent_list, const at::Tensor& selected, int64_t topk,
                                   int64_t steps) {
  for (const at::Tensor* t : {&parent_list, &selected}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 2,
                "rowinv.build_tree: parent_list and selected must be contiguous 2-D int64 CPU tensors");
  }
  TORCH_CHECK(topk >= 1 && steps >= 1, "rowinv.build_tree: topk and steps must be >= 1");
  const int64_t bs = selected.size(0), m = selected.size(1), n = m + 1, p = parent_list.size(1);
  TORCH_CHECK(parent_list.size(0) == bs, "rowinv.build_tree: parent_list and selected differ in batch size");
  const auto opts = selected.options();
  at::Tensor tree = at::zeros({bs, n, n}, opts.dtype(at::kBool));
  at::Tensor depth = at::zeros({bs, n}, opts);
  at::Tensor next_token = at::full({bs, n}, -1, opts);
  at::Tensor next_sibling = at::full({bs, n}, -1, opts);
  const int64_t* plist = parent_list.data_ptr<int64_t>();
  const int64_t* sel = selected.data_ptr<int64_t>();
  bool* mask = tree.data_ptr<bool>();
  int64_t* dep = depth.data_ptr<int64_t>();
  int64_t* first = next_token.data_ptr<int64_t>();
  int64_t* sibling = next_sibling.data_ptr<int64_t>();
  std::vector<int64_t> parent(static_cast<size_t>(n));
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t* s = sel + b * m;
    parent[0] = -1;
    for (int64_t j = 1; j < n; ++j) {
      const int64_t c = s[j - 1];
      int64_t pc = c / topk;
      if (c % topk != 0 && c < 0) pc -= 1;  // floor division, as the reference's
      int64_t par = -1;
      if (pc == 0) {
        par = 0;
      } else if (pc >= 1 && pc < p) {
        const int64_t want = plist[b * p + pc];
        for (int64_t i = 0; i < m; ++i) {  // the first selected position holding it
          if (s[i] == want) {
            par = i + 1;
            break;
          }
        }
      }
      parent[j] = par;
    }
    int64_t* fc = first + b * n;
    int64_t* ns = sibling + b * n;
    for (int64_t i = n - 1; i >= 1; --i) {  // descending: the smallest child is written last
      if (parent[i] >= 0) fc[parent[i]] = i;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (parent[j] < 0) continue;
      for (int64_t i = j + 1; i < n; ++i) {
        if (parent[i] == parent[j]) {
          ns[j] = i;
          break;
        }
      }
    }
    bool* rows = mask + b * n * n;
    int64_t* d = dep + b * n;
    rows[0] = true;
    for (int64_t j = 1; j < n; ++j) {  // at most `steps` nodes, stopping below the root
      bool* row = rows + j * n;
      row[0] = true;
      int64_t cur = j;
      for (int64_t k = 0; k < steps; ++k) {
        row[cur] = true;
        d[j] += 1;
        const int64_t up = parent[cur];
        if (up <= 0) break;
        cur = up;
      }
    }
  }
  return {tree, depth, next_token, next_sibling};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  g_isa = best_isa();
  m.def("available_isas", &available_isas, "the linear paths this CPU can run: 'avx2', maybe 'avx512' and 'amx'");
  m.def("isa", [] { return std::string(isa_name(g_isa.load())); }, "the path linear runs on now");
  m.def("set_isa", &set_isa, "run linear on 'avx2', 'avx512', 'amx' or 'auto' (the best available) from now on",
        py::arg("name"));
  m.def("linear", &linear, "Row-invariant y = x @ w.T (+ bias); w bf16 [N, K], x bf16/fp32 [M, K]", py::arg("x"),
        py::arg("w"), py::arg("bias") = py::none(), py::arg("out_fp32") = false, release_gil());
  m.def("linear_w8", &linear_w8,
        "Row-invariant y = (x @ q.T) * scale (+ bias); q int8 [N, K], scale fp32 [N], x bf16/fp32 [M, K]",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("out_fp32") = false,
        release_gil());
  m.def("attention", &attention, "Row-invariant CSR attention over a bf16 slot pool", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("scale"),
        py::arg("out_fp32") = false, release_gil());
  m.def("rms_norm", &rms_norm_any, "RMSNorm, bf16 [T, H]", py::arg("x"), py::arg("weight"), py::arg("eps"),
        release_gil());
  m.def("fused_add_rms_norm", &fused_add_rms_norm_any, "(rms_norm(x + residual), x + residual), bf16",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), release_gil());
  m.def("silu_and_mul", &silu_and_mul_any, "silu(x[..., :I]) * x[..., I:], bf16", py::arg("x"), release_gil());
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, bf16, fp32 cos/sin cache",
        py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos_sin_cache"), py::arg("is_neox") = true,
        release_gil());
  m.def("store_and_attend", &store_and_attend,
        "k_cache[loc] = k, v_cache[loc] = v, then attention(q, ...); bf16 caches", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("loc"), py::arg("kv_indptr"),
        py::arg("kv_indices"), py::arg("scale"), release_gil());
  py::class_<BoundLinear>(m, "BoundLinear", "linear(x, w, bias) with w bound: fn(x, bias=None)")
      .def(py::init([](const at::Tensor& w) {
             TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
                         "BoundLinear: w must be a contiguous 2-D bfloat16 tensor [N, K]");
             return BoundLinear{w};
           }),
           py::arg("w"))
      .def("__call__", &BoundLinear::operator(), py::arg("x"), py::arg("bias") = py::none(), release_gil())
      .def_readonly("weight", &BoundLinear::w);
  py::class_<BoundLinearW8>(m, "BoundLinearW8", "linear_w8(x, q, scale, bias) with q, scale bound")
      .def(py::init([](const at::Tensor& q, const at::Tensor& scale) { return BoundLinearW8{q, scale}; }),
           py::arg("q"), py::arg("scale"))
      .def("__call__", &BoundLinearW8::operator(), py::arg("x"), py::arg("bias") = py::none(), release_gil())
      .def_readonly("q", &BoundLinearW8::q)
      .def_readonly("scale", &BoundLinearW8::scale);
  m.def("select_top_k_step", &select_top_k_step, "select_top_k at step >= 1 in one call", release_gil());
  m.def("softmax_topk", &softmax_topk, "the k largest softmax probabilities per row and their ids",
        release_gil());
  m.def("verify_tree_greedy", &verify_tree_greedy, "greedy tree verification, int64 [bs, N] inputs",
        release_gil());
  m.def("build_tree", &build_tree, "build_tree's links, depths and ancestor mask, int64 inputs", release_gil());
}
