#include "pool_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace tpusync {
namespace {

// Rows per tile: the K and V rows of one kv head of a tile are converted to f32 once and
// stay in L1 while every query head of its group attends to them.
constexpr int kTile = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The inner loops are compiled twice, for AVX2 with FMA (and F16C, which converts fp8
// codes) and for the baseline ISA, and the CPU picks one at run time: the package builds
// without -march flags, so the same binary runs anywhere, and these loops are the whole
// step's compute on the host tier.
#if defined(__x86_64__) && defined(__GNUC__)
#define TPUSYNC_HAVE_AVX2_CLONE 1
#define TPUSYNC_INLINE inline __attribute__((always_inline))
#else
#define TPUSYNC_HAVE_AVX2_CLONE 0
#define TPUSYNC_INLINE inline
#endif

TPUSYNC_INLINE float Bf16ToF32(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof f);
  return f;
}

// W f32 lanes (GCC/Clang vector extension). The tile path uses 8 in every build (one AVX
// register in the AVX2 build, two SSE registers in the baseline one); the many-query path
// 4 in the baseline build (wider vectors live on the stack there), 8 in the AVX2 one, 16 in
// the AVX-512 one. Loads and stores go through memcpy (no alignment). They cross only
// always-inlined calls, so GCC's note that passing them changes the ABI without AVX does
// not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <int W>
struct Simd;
template <>
struct Simd<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
};
template <>
struct Simd<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
};
template <>
struct Simd<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
};

template <int W>
TPUSYNC_INLINE typename Simd<W>::F LoadW(const float* p) {
  typename Simd<W>::F x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

template <int W>
TPUSYNC_INLINE void StoreW(float* p, const typename Simd<W>::F& x) {
  std::memcpy(p, &x, sizeof x);
}

// exp(x) of W lanes x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// its minimax polynomial (the classic single-precision coefficients), 2^n by the exponent
// bits. (std::exp does not vectorize.) Below -87 (a weight under 1e-38) it returns exp(-87).
// Vectors go through memory or references, never by value: a vector parameter draws
// GCC's note on the ABI change of wide vectors in the baseline build.
template <int W>
TPUSYNC_INLINE void ExpW(float* values) {
  using F = typename Simd<W>::F;
  using I = typename Simd<W>::I;
  F x = LoadW<W>(values);
  const F floor_x = F{} - 87.0f;
  x = x < floor_x ? floor_x : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(t, I);
  n += __builtin_convertvector(n, F) > t;
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F y = p * r * r + r + 1.0f;
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  StoreW<W>(values, y * scale);
}

// Eight lanes: the tile path's width in both builds.
typedef Simd<8>::F Lanes;
typedef Simd<8>::I IntLanes;

TPUSYNC_INLINE Lanes LoadLanes(const float* p) { return LoadW<8>(p); }
TPUSYNC_INLINE void StoreLanes(float* p, const Lanes& x) { StoreW<8>(p, x); }
TPUSYNC_INLINE void ExpNonPositive(float* values) { ExpW<8>(values); }

typedef uint32_t BitLanes __attribute__((vector_size(32)));  // Eight f32 bit patterns.

// float8_e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinities) of every
// byte: the scalar tail of a row whose length is not a multiple of eight. 0x7f and 0xff
// (its NaNs) decode as +-480 here and in the vector path: a quantized tier never stores
// them (its codes are clipped to +-448).
struct Float8Table {
  float value[256];
  Float8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float x = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                             : std::ldexp(1.0f + m / 8.0f, e - 7);
      value[c] = c & 0x80 ? -x : x;
    }
  }
};
const Float8Table kFloat8;

// float8_e4m3fn codes (their bytes in 32-bit lanes) as f32 bits: a normal code's exponent
// and mantissa move into an f32's and its exponent is rebiased (7 to 127); a subnormal one
// (no exponent bits) is its mantissa times 2^-9. (No f32 subnormal is ever formed, so a
// flush-to-zero mode cannot change the result.)
TPUSYNC_INLINE void Float8Lanes(const BitLanes& x, float* dst) {
  const BitLanes normal_bits = ((x & 0x7f) << 20) + (120u << 23);
  Lanes normal;
  std::memcpy(&normal, &normal_bits, sizeof normal);
  IntLanes mantissa;
  const BitLanes m = x & 7;
  std::memcpy(&mantissa, &m, sizeof mantissa);
  const Lanes subnormal = __builtin_convertvector(mantissa, Lanes) * 0.001953125f;
  const Lanes magnitude = (x & 0x78) == 0 ? subnormal : normal;
  BitLanes bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= (x & 0x80) << 24;
  std::memcpy(dst, &bits, sizeof bits);
}

// Eight bytes widened to 32-bit lanes, sign-extended (int8 codes) or zero-extended (fp8
// codes' bytes), in the baseline build: SSE2 moves each byte to the top of its lane, then
// shifts it down. (GCC turns a vector-extension conversion of eight bytes into scalar code,
// hence intrinsics; the AVX2 build's are in CodesAvx2, a function built for AVX2, as
// intrinsics cannot be inlined into one that is not.)
template <bool kSigned>
TPUSYNC_INLINE BitLanes WidenBaseline(const uint8_t* p) {
  BitLanes out;
#if defined(__x86_64__) && defined(__GNUC__)
  const __m128i w16 = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                        _mm_setzero_si128());
  __m128i half[2] = {_mm_unpacklo_epi16(_mm_setzero_si128(), w16),
                     _mm_unpackhi_epi16(_mm_setzero_si128(), w16)};
  for (__m128i& h : half) {
    h = kSigned ? _mm_srai_epi32(_mm_slli_epi32(h, 8), 24) : _mm_srli_epi32(h, 16);
  }
  std::memcpy(&out, half, sizeof out);
#else
  for (int i = 0; i < 8; ++i) {
    out[i] = kSigned ? static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(p[i])))
                     : p[i];
  }
#endif
  return out;
}

// n int8 (kFloat8Codes: float8_e4m3fn) codes from src as f32 at dst, eight at a time, then a
// scalar tail (fp8's by its 256-entry table).
template <bool kFloat8Codes>
TPUSYNC_INLINE void CodesBaseline(const uint8_t* src, int n, float* dst) {
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    const BitLanes x = WidenBaseline<!kFloat8Codes>(src + d);
    if constexpr (kFloat8Codes) {
      Float8Lanes(x, dst + d);
    } else {
      IntLanes i;
      std::memcpy(&i, &x, sizeof i);
      StoreLanes(dst + d, __builtin_convertvector(i, Lanes));
    }
  }
  for (; d < n; ++d) dst[d] = kFloat8Codes ? kFloat8.value[src[d]] : static_cast<int8_t>(src[d]);
}

#if TPUSYNC_HAVE_AVX2_CLONE
// The AVX2 build's: int8 codes sign-extended and converted eight at a time; fp8 codes,
// sixteen at a time, become f16 bits that stand for 2^-8 of their value (the byte in the
// high half of a 16-bit lane, shifted down one with the sign bit kept: the 4 exponent bits
// land in f16's 5-bit field of bias 15, 8 above e4m3's 7), converted by F16C and scaled by
// 2^8. f16 subnormals (e4m3's) convert exactly whatever the DAZ mode: VCVTPH2PS ignores it.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void Float8Avx2(
    __m128i high_bytes, float* out) {  // Eight codes, each in the high byte of a 16-bit lane.
  const __m128i f16 =
      _mm_and_si128(_mm_srai_epi16(high_bytes, 1), _mm_set1_epi16(static_cast<short>(0xbfff)));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtph_ps(f16), _mm256_set1_ps(256.0f)));
}

template <bool kFloat8Codes>
__attribute__((target("avx2,fma,f16c"))) void CodesAvx2(const uint8_t* src, int n, float* dst) {
  int d = 0;
  if constexpr (kFloat8Codes) {
    const __m128i zero = _mm_setzero_si128();
    for (; d + 16 <= n; d += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      Float8Avx2(_mm_unpacklo_epi8(zero, b), dst + d);
      Float8Avx2(_mm_unpackhi_epi8(zero, b), dst + d + 8);
    }
    for (; d + 8 <= n; d += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
      Float8Avx2(_mm_unpacklo_epi8(zero, b), dst + d);
    }
  } else {
    for (; d + 8 <= n; d += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
      _mm256_storeu_ps(dst + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
  }
  for (; d < n; ++d) dst[d] = kFloat8Codes ? kFloat8.value[src[d]] : static_cast<int8_t>(src[d]);
}
#endif

// n codes of a quantized row as f32, by the build's conversion.
template <bool kAvx2, bool kFloat8Codes>
TPUSYNC_INLINE void Codes(const uint8_t* src, int n, float* dst) {
#if TPUSYNC_HAVE_AVX2_CLONE
  if constexpr (kAvx2) {
    CodesAvx2<kFloat8Codes>(src, n, dst);
    return;
  }
#endif
  CodesBaseline<kFloat8Codes>(src, n, dst);
}

// `rows` rows of `values` values each, row i at src + i * row_bytes, as f32[rows][values]
// (codes' values, unscaled, for quantized rows; their f32[rows][heads] scales into
// `scales`). Whole rows, in memory order: the hardware prefetcher follows one stream
// through the pool.
template <bool kAvx2>
TPUSYNC_INLINE void LoadRows(const uint8_t* src, uint64_t row_bytes, int rows, int values,
                             int heads, KvDtype dtype, TierDtype tier_dtype, float* dst,
                             float* scales) {
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * row_bytes;
    float* out = dst + static_cast<int64_t>(r) * values;
    if (tier_dtype == TierDtype::kInt8) {
      Codes<kAvx2, false>(row, values, out);
      std::memcpy(scales + r * heads, row + values, 4 * static_cast<size_t>(heads));
    } else if (tier_dtype == TierDtype::kFloat8E4M3) {
      Codes<kAvx2, true>(row, values, out);
      std::memcpy(scales + r * heads, row + values, 4 * static_cast<size_t>(heads));
    } else if (dtype == KvDtype::kBfloat16) {
      for (int d = 0; d < values; ++d) {
        uint16_t bits;
        std::memcpy(&bits, row + 2 * d, sizeof bits);  // One load; rows need no alignment.
        out[d] = Bf16ToF32(bits);
      }
    } else {
      std::memcpy(out, row, 4 * static_cast<size_t>(values));
    }
  }
}

// Horizontal sum of eight lanes.
TPUSYNC_INLINE float Sum(const Lanes& x) {
  float s = 0;
  for (int j = 0; j < 8; ++j) s += x[j];
  return s;
}

// The sums of eight vectors' lanes, as one vector (lane i: the sum of x[i]): three rounds
// of pairwise shuffles and adds (7 adds, no lane leaves a register), where eight
// horizontal sums took 56 scalar adds and their extractions (a head_dim of 64 spent as
// much on them as on its multiply-adds).
TPUSYNC_INLINE void SumsOfEight(const Lanes* x, float* out) {
  Lanes t[4], u[2];
  for (int i = 0; i < 4; ++i) {  // [x0 (0+1), x1 (0+1), x0 (2+3), x1 (2+3), ...] pairs.
    t[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {  // [x0, x1, x2, x3 (lanes 0-3), x0, x1, x2, x3 (4-7)].
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  StoreLanes(out, __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15));
}

// scores[h][r] = q_h . k_r for NH query heads (q_h at q + h * n) and rows r in [lo, hi)
// (row r at k + r * stride), n values each. 8 / NH rows at a time: eight independent
// chains of fused multiply-adds, each K row loaded once for all NH heads, their eight
// sums reduced together (SumsOfEight).
template <int NH>
TPUSYNC_INLINE void Scores(const float* q, const float* k, int64_t stride, int lo, int hi, int n,
                           float (*scores)[kTile]) {
  static_assert(NH == 1 || NH == 2, "eight chains: one or two heads");
  constexpr int kRows = 8 / NH;
  int r = lo;
  for (; r + kRows <= hi; r += kRows) {
    Lanes acc[NH * kRows] = {};  // [h * kRows + i]
    int d = 0;
    for (; d + 8 <= n; d += 8) {
      Lanes rows[kRows];
      for (int i = 0; i < kRows; ++i) rows[i] = LoadLanes(k + (r + i) * stride + d);
      for (int h = 0; h < NH; ++h) {
        const Lanes x = LoadLanes(q + h * n + d);
        for (int i = 0; i < kRows; ++i) acc[h * kRows + i] += x * rows[i];
      }
    }
    alignas(32) float sums[8];
    SumsOfEight(acc, sums);
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < kRows; ++i) {
        float tail = 0;
        for (int e = d; e < n; ++e) tail += q[h * n + e] * k[(r + i) * stride + e];
        scores[h][r + i] = sums[h * kRows + i] + tail;
      }
    }
  }
  for (; r < hi; ++r) {
    for (int h = 0; h < NH; ++h) {
      Lanes acc = {};
      int d = 0;
      for (; d + 8 <= n; d += 8) acc += LoadLanes(q + h * n + d) * LoadLanes(k + r * stride + d);
      float tail = 0;
      for (; d < n; ++d) tail += q[h * n + d] * k[r * stride + d];
      scores[h][r] = Sum(acc) + tail;
    }
  }
}

// a_h (f32[n] at a + h * n) += sum over rows r in [lo, hi) of p[h][r] * v_r (row r at
// v + r * stride), for NH heads: 32 values of each a_h at a time in registers (4 * NH
// independent chains), each V row loaded once for all NH heads.
template <int NH>
TPUSYNC_INLINE void AddWeightedRows(float* a, const float (*p)[kTile], const float* v,
                                    int64_t stride, int lo, int hi, int n) {
  int d = 0;
  for (; d + 32 <= n; d += 32) {
    Lanes acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < 4; ++i) acc[h][i] = LoadLanes(a + h * n + d + 8 * i);
    }
    for (int r = lo; r < hi; ++r) {
      Lanes row[4];
      for (int i = 0; i < 4; ++i) row[i] = LoadLanes(v + r * stride + d + 8 * i);
      for (int h = 0; h < NH; ++h) {
        for (int i = 0; i < 4; ++i) acc[h][i] += p[h][r] * row[i];
      }
    }
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < 4; ++i) StoreLanes(a + h * n + d + 8 * i, acc[h][i]);
    }
  }
  for (; d + 8 <= n; d += 8) {
    for (int h = 0; h < NH; ++h) {
      Lanes acc = LoadLanes(a + h * n + d);
      for (int r = lo; r < hi; ++r) acc += p[h][r] * LoadLanes(v + r * stride + d);
      StoreLanes(a + h * n + d, acc);
    }
  }
  for (; d < n; ++d) {
    for (int h = 0; h < NH; ++h) {
      for (int r = lo; r < hi; ++r) a[h * n + d] += p[h][r] * v[r * stride + d];
    }
  }
}

struct Tile {
  std::vector<float> k, v;  // [kTile, num_kv_heads * head_dim] each: the tile's rows in f32.
  std::vector<float> k_scale, v_scale;  // [kTile, num_kv_heads] each: quantized rows' scales.
  // Two query heads' scores, then weights. Every lane is exponentiated: keep them finite.
  alignas(32) float scores[2][kTile] = {};
  // Quantized rows: the weights times each row's V scale, what accumulates the V codes.
  alignas(32) float scaled[2][kTile] = {};
};

// Attends NH consecutive query heads of one kv head's group (the first, `head`, of query
// t) to rows [lo, hi) of the tile held in `tile`: online softmax over acc/max/sum.
template <int NH>
TPUSYNC_INLINE void AttendHeads(const AttentionShape& s, const float* q, int t, int head, int h,
                                int lo, int hi, Tile& tile, float* acc, float* max, float* sum) {
  const int d_len = s.head_dim;
  const int row_values = s.num_kv_heads * d_len;
  const int at = t * s.num_q_heads + head;  // The first head's (query, head) index.
  Scores<NH>(q + static_cast<int64_t>(at) * d_len, tile.k.data() + h * d_len, row_values, lo,
             hi, d_len, tile.scores);
  const bool quantized = s.quantized();
  const int heads = s.num_kv_heads;
  for (int i = 0; i < NH; ++i) {
    float* scores = tile.scores[i];
    if (quantized) {  // (q . codes) * s_k, as the reference scales its logits.
      for (int r = lo; r < hi; ++r) scores[r] *= tile.k_scale[r * heads + h];
    }
    float tile_max = kNegInf;
    for (int r = lo; r < hi; ++r) {
      float x = s.scale * scores[r];
      if (s.soft_cap > 0) x = s.soft_cap * std::tanh(x / s.soft_cap);
      scores[r] = x;
      tile_max = std::max(tile_max, x);
    }
    const float old_max = max[at + i];
    const float new_max = std::max(old_max, tile_max);
    if (old_max != new_max) {
      const float alpha = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
      float* a = acc + static_cast<int64_t>(at + i) * d_len;
      for (int d = 0; d < d_len; ++d) a[d] *= alpha;
      sum[at + i] *= alpha;
    }
    // The whole tile's lanes (those outside [lo, hi) are computed and never read).
    for (int r = 0; r < kTile; ++r) scores[r] -= new_max;
    for (int r = 0; r < kTile; r += 8) ExpNonPositive(scores + r);
    float weights = 0;
    for (int r = lo; r < hi; ++r) weights += scores[r];
    sum[at + i] += weights;
    max[at + i] = new_max;
    if (quantized) {  // The sum stays unscaled; what multiplies the V codes is p * s_v.
      for (int r = lo; r < hi; ++r) tile.scaled[i][r] = scores[r] * tile.v_scale[r * heads + h];
    }
  }
  AddWeightedRows<NH>(acc + static_cast<int64_t>(at) * d_len,
                      quantized ? tile.scaled : tile.scores, tile.v.data() + h * d_len,
                      row_values, lo, hi, d_len);
}

// One tile (rows [r0, r0 + n) of the span) for every kv head and query of the span's
// sequence. q, acc, max, sum are the sequence's slices: [q_len, num_q_heads, (head_dim)].
template <bool kAvx2>
TPUSYNC_INLINE void AttendTileBody(const AttentionShape& s, const float* q, int32_t q_start,
                                   int q_rows, const KeySpan& span, int r0, int n, Tile& tile,
                                   float* acc, float* max, float* sum) {
  const int group = s.num_q_heads / s.num_kv_heads;
  const uint64_t row_bytes = s.row_bytes();
  const int row_values = s.num_kv_heads * s.head_dim;
  const int32_t first = span.position + r0;  // Absolute position of the tile's row 0.
  bool loaded = false;
  for (int h = 0; h < s.num_kv_heads; ++h) {
    for (int t = 0; t < q_rows; ++t) {
      const int32_t q_pos = q_start + t;
      // Visible rows of the tile: causal (position <= q_pos) and inside the window.
      const int hi = static_cast<int>(std::min<int64_t>(n, int64_t{q_pos} - first + 1));
      const int lo = s.window > 0 ? static_cast<int>(std::max<int64_t>(
                                        0, int64_t{q_pos} - s.window + 1 - first))
                                  : 0;
      if (hi <= lo) continue;
      if (!loaded) {
        LoadRows<kAvx2>(span.k + r0 * row_bytes, row_bytes, n, row_values, s.num_kv_heads,
                        s.kv_dtype, s.tier_dtype, tile.k.data(), tile.k_scale.data());
        LoadRows<kAvx2>(span.v + r0 * row_bytes, row_bytes, n, row_values, s.num_kv_heads,
                        s.kv_dtype, s.tier_dtype, tile.v.data(), tile.v_scale.data());
        loaded = true;
        // The next tile's rows, requested now so they arrive while this one computes: the
        // K and V regions are two streams, which the hardware prefetcher alone left
        // waiting on DRAM.
        const int ahead = std::min(kTile, span.rows - r0 - n);
        for (uint64_t b = 0; b < ahead * row_bytes; b += 64) {
          __builtin_prefetch(span.k + (r0 + n) * row_bytes + b);
          __builtin_prefetch(span.v + (r0 + n) * row_bytes + b);
        }
      }
      int g = 0;  // The group's query heads two at a time: K and V rows loaded once per pair.
      for (; g + 2 <= group; g += 2) {
        AttendHeads<2>(s, q, t, h * group + g, h, lo, hi, tile, acc, max, sum);
      }
      if (g < group) AttendHeads<1>(s, q, t, h * group + g, h, lo, hi, tile, acc, max, sum);
    }
  }
}

// ---- Many query rows (a prefill chunk): blocks of keys against panels of query rows ----
//
// With many (query, head) rows per kv head (a chunk of a prefill, not a decode step), the
// work is two matrix products per block of keys, S = Q K^T and O += P V, and the per-row
// cost of the online softmax (its rescale of the output row, its max and sum) is paid
// once per block of kBlock keys rather than per tile of 32. A block's K rows of one kv head
// are converted to f32 and transposed ([head_dim][kBlock]), its V rows converted
// ([kBlock][head_dim]); both stay in L2 while every query row of the head's group passes
// over them, kPanel rows at a time: the scores of a panel's rows against 2 vectors of keys
// accumulate in registers over head_dim (a broadcast query value times two vectors of K,
// no horizontal sums), and the output rows take their P V 2 vectors of head_dim at a time,
// the rescale by the new max folded into their load.

// Rows (keys) per block of the many-query path.
constexpr int kBlock = 128;
// The most (query, head) rows of a panel (the AVX-512 build's; 24 accumulators of 32
// registers).
constexpr int kMaxPanel = 12;
// Rows (query rows times the group's heads) per kv head from which a sequence takes the
// many-query path; below it (decode steps) the tile path, whose K stays untransposed.
constexpr int kManyRows = 16;

// One block's rows, for one kv head at a time.
struct Block {
  std::vector<float> kt;      // [head_dim][kBlock]: the head's K, transposed.
  std::vector<float> v;       // [kBlock][head_dim]: its V.
  std::vector<float> k_rows;  // [kBlock][head_dim]: K before the transposition.
  std::vector<float> spare;   // [head_dim]: the output row of a panel's unused rows.
  std::vector<float> q;       // [head_dim][kMaxPanel]: a panel's query rows, packed.
  alignas(64) float k_scale[kBlock] = {};  // Quantized rows' scales of the head.
  alignas(64) float v_scale[kBlock] = {};
  alignas(64) float p[kMaxPanel][kBlock] = {};       // A panel's scores, then weights.
  alignas(64) float scaled[kMaxPanel][kBlock] = {};  // Quantized: weights times V scales.

  void Reserve(int head_dim) {
    const size_t values = static_cast<size_t>(kBlock) * head_dim;
    if (kt.size() < values) {
      kt.assign(values, 0.0f);
      v.assign(values, 0.0f);
      k_rows.assign(values, 0.0f);
      spare.assign(head_dim, 0.0f);
      q.assign(static_cast<size_t>(head_dim) * kMaxPanel, 0.0f);
    }
  }
};

// Head h of `n` rows (row r at src + r * row_bytes) as f32[n][head_dim] at dst (codes'
// values, unscaled, for quantized rows; their scales of head h at scales[r]).
template <bool kAvx2>
TPUSYNC_INLINE void LoadHead(const AttentionShape& s, const uint8_t* src, uint64_t row_bytes,
                             int n, int h, float* dst, float* scales) {
  const int d_len = s.head_dim;
  const uint64_t scale_at = static_cast<uint64_t>(s.num_kv_heads) * d_len + 4ull * h;
  for (int r = 0; r < n; ++r) {
    const uint8_t* row = src + r * row_bytes;
    float* out = dst + static_cast<int64_t>(r) * d_len;
    if (s.tier_dtype == TierDtype::kInt8) {
      Codes<kAvx2, false>(row + static_cast<int64_t>(h) * d_len, d_len, out);
      std::memcpy(scales + r, row + scale_at, 4);
    } else if (s.tier_dtype == TierDtype::kFloat8E4M3) {
      Codes<kAvx2, true>(row + static_cast<int64_t>(h) * d_len, d_len, out);
      std::memcpy(scales + r, row + scale_at, 4);
    } else if (s.kv_dtype == KvDtype::kBfloat16) {
      const uint8_t* head = row + 2 * static_cast<int64_t>(h) * d_len;
      for (int d = 0; d < d_len; ++d) {
        uint16_t bits;
        std::memcpy(&bits, head + 2 * d, sizeof bits);
        out[d] = Bf16ToF32(bits);
      }
    } else {
      std::memcpy(out, row + 4 * static_cast<int64_t>(h) * d_len, 4 * static_cast<size_t>(d_len));
    }
  }
}

// kt[d][c] = rows[c][d] for c < n; columns [n, cols) zero.
TPUSYNC_INLINE void Transpose(const float* rows, int n, int cols, int d_len, float* kt) {
  int c = 0;
  for (; c + 8 <= n; c += 8) {  // Eight rows at a time: each kt row written 32 bytes at once.
    for (int d = 0; d < d_len; ++d) {
      float* out = kt + static_cast<int64_t>(d) * kBlock + c;
      for (int j = 0; j < 8; ++j) out[j] = rows[static_cast<int64_t>(c + j) * d_len + d];
    }
  }
  for (; c < n; ++c) {
    for (int d = 0; d < d_len; ++d) kt[static_cast<int64_t>(d) * kBlock + c] = rows[c * d_len + d];
  }
  for (int d = 0; d < d_len; ++d) {
    for (int z = n; z < cols; ++z) kt[static_cast<int64_t>(d) * kBlock + z] = 0.0f;
  }
}

// p[i][c] = q_i . k_c for the panel's MR rows (q_i packed: q[d * MR + i]) and columns
// c < cols (a multiple of W) of the transposed block kt: 2 vectors of columns at a time,
// MR x 2 accumulators over head_dim, each query value broadcast once for both.
template <int W, int MR>
TPUSYNC_INLINE void PanelScores(const float* q, const float* kt, int d_len, int cols,
                                float (*p)[kBlock]) {
  using F = typename Simd<W>::F;
  int c = 0;
  for (; c + 2 * W <= cols; c += 2 * W) {
    F acc[MR][2] = {};
    for (int d = 0; d < d_len; ++d) {
      const float* k = kt + static_cast<int64_t>(d) * kBlock + c;
      const F k0 = LoadW<W>(k), k1 = LoadW<W>(k + W);
      for (int i = 0; i < MR; ++i) {
        const float x = q[d * MR + i];
        acc[i][0] += x * k0;
        acc[i][1] += x * k1;
      }
    }
    for (int i = 0; i < MR; ++i) {
      StoreW<W>(p[i] + c, acc[i][0]);
      StoreW<W>(p[i] + c + W, acc[i][1]);
    }
  }
  if (c < cols) {  // One vector of columns left.
    F acc[MR] = {};
    for (int d = 0; d < d_len; ++d) {
      const F k0 = LoadW<W>(kt + static_cast<int64_t>(d) * kBlock + c);
      for (int i = 0; i < MR; ++i) acc[i] += q[d * MR + i] * k0;
    }
    for (int i = 0; i < MR; ++i) StoreW<W>(p[i] + c, acc[i]);
  }
}

// out_i = out_i * alpha[i] + sum over c < n of p[i][c] * v_c (out_i at arow[i], f32[d_len];
// v_c at v + c * d_len) for the panel's MR rows: 2 vectors of head_dim at a time (MR x 2
// accumulators over the block's rows), then one, then one value at a time.
template <int W, int MR>
TPUSYNC_INLINE void PanelValues(float* const* arow, const float* alpha, const float (*p)[kBlock],
                                const float* v, int n, int d_len) {
  using F = typename Simd<W>::F;
  int d = 0;
  for (; d + 2 * W <= d_len; d += 2 * W) {
    F acc[MR][2];
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = LoadW<W>(arow[i] + d) * alpha[i];
      acc[i][1] = LoadW<W>(arow[i] + d + W) * alpha[i];
    }
    for (int c = 0; c < n; ++c) {
      const float* row = v + static_cast<int64_t>(c) * d_len + d;
      const F v0 = LoadW<W>(row), v1 = LoadW<W>(row + W);
      for (int i = 0; i < MR; ++i) {
        acc[i][0] += p[i][c] * v0;
        acc[i][1] += p[i][c] * v1;
      }
    }
    for (int i = 0; i < MR; ++i) {
      StoreW<W>(arow[i] + d, acc[i][0]);
      StoreW<W>(arow[i] + d + W, acc[i][1]);
    }
  }
  for (; d + W <= d_len; d += W) {
    F acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = LoadW<W>(arow[i] + d) * alpha[i];
    for (int c = 0; c < n; ++c) {
      const F v0 = LoadW<W>(v + static_cast<int64_t>(c) * d_len + d);
      for (int i = 0; i < MR; ++i) acc[i] += p[i][c] * v0;
    }
    for (int i = 0; i < MR; ++i) StoreW<W>(arow[i] + d, acc[i]);
  }
  for (; d < d_len; ++d) {
    for (int i = 0; i < MR; ++i) {
      float a = arow[i][d] * alpha[i];
      for (int c = 0; c < n; ++c) a += p[i][c] * v[static_cast<int64_t>(c) * d_len + d];
      arow[i][d] = a;
    }
  }
}

// Row i of a panel after PanelScores: its logits (k scale, scale, soft cap), masked to its
// visible columns [lo, hi), its online-softmax step (new max, the old partial's rescale
// `alpha`, the sum) and its weights in p (zero outside [lo, hi)), times the V scales in
// `scaled` for quantized rows. Columns [0, cols) are computed, cols a multiple of W.
template <int W>
TPUSYNC_INLINE float SoftmaxRow(const AttentionShape& s, const Block& blk, float* p,
                                float* scaled, int lo, int hi, int n, int cols, float* max,
                                float* sum) {
  using F = typename Simd<W>::F;
  const bool quantized = s.quantized();
  if (quantized) {  // (q . codes) * s_k, as the reference scales its logits.
    for (int c = 0; c < cols; c += W) StoreW<W>(p + c, LoadW<W>(p + c) * LoadW<W>(blk.k_scale + c));
  }
  for (int c = 0; c < cols; c += W) StoreW<W>(p + c, LoadW<W>(p + c) * s.scale);
  if (s.soft_cap > 0) {
    for (int c = 0; c < n; ++c) p[c] = s.soft_cap * std::tanh(p[c] / s.soft_cap);
  }
  // Masked columns (outside [lo, hi): before a window, after the query, past the block)
  // are set one by one, before the max and again after the exponentials: a block of
  // whole visible rows has none, and vector selects cost more than they save (GCC 12
  // lowers those of 16 lanes lane by lane: the AVX-512 build ran at half its speed).
  for (int c = 0; c < lo; ++c) p[c] = kNegInf;
  for (int c = hi; c < cols; ++c) p[c] = kNegInf;
  F top = F{} + kNegInf;
  for (int c = 0; c < cols; c += W) {
    const F x = LoadW<W>(p + c);
    top = x > top ? x : top;
  }
  float block_max = kNegInf;
  for (int j = 0; j < W; ++j) block_max = std::max(block_max, top[j]);
  const float old_max = *max;
  const float new_max = std::max(old_max, block_max);
  const float alpha = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
  const F shift = F{} + new_max;
  for (int c = 0; c < cols; c += W) {
    StoreW<W>(p + c, LoadW<W>(p + c) - shift);
    ExpW<W>(p + c);  // (-inf clamps to exp(-87): zeroed below.)
  }
  for (int c = 0; c < lo; ++c) p[c] = 0.0f;
  for (int c = hi; c < cols; ++c) p[c] = 0.0f;
  F total = F{};
  for (int c = 0; c < cols; c += W) {
    const F w = LoadW<W>(p + c);
    total += w;
    if (quantized) StoreW<W>(scaled + c, w * LoadW<W>(blk.v_scale + c));
  }
  float weights = 0;
  for (int j = 0; j < W; ++j) weights += total[j];
  *sum = *sum * alpha + weights;
  *max = new_max;
  return alpha;
}

// Every query row of the sequence (q, acc, max, sum its slices: [q_len, num_q_heads,
// (head_dim)]) below q_rows over the span's visible keys, by blocks of kBlock rows and
// panels of MR (query, head) rows of one kv head.
template <int W, int MR, bool kAvx2>
TPUSYNC_INLINE void AttendMany(const AttentionShape& s, const float* q, int32_t q_start,
                               int q_rows, const KeySpan& span, float* acc, float* max,
                               float* sum) {
  static_assert(MR <= kMaxPanel, "a panel's rows fit the block's buffers");
  thread_local Block blk;
  const int d_len = s.head_dim;
  blk.Reserve(d_len);
  const int group = s.num_q_heads / s.num_kv_heads;
  const uint64_t row_bytes = s.row_bytes();
  for (int r0 = 0; r0 < span.rows; r0 += kBlock) {
    const int n = std::min(kBlock, span.rows - r0);
    const int32_t first = span.position + r0;  // Absolute position of the block's row 0.
    // The queries that see a row of the block: causal (q_pos >= first) and, with a window,
    // q_pos - window + 1 <= first + n - 1.
    const int t_lo = static_cast<int>(std::clamp<int64_t>(int64_t{first} - q_start, 0, q_rows));
    const int t_hi = s.window > 0 ? static_cast<int>(std::clamp<int64_t>(
                                        int64_t{first} + n - 1 + s.window - q_start, 0, q_rows))
                                  : q_rows;
    if (t_lo >= t_hi) continue;
    // The next block's rows, requested while this one computes (two streams, K and V).
    const int ahead = std::min(kBlock, span.rows - r0 - n);
    for (uint64_t b = 0; b < ahead * row_bytes; b += 64) {
      __builtin_prefetch(span.k + (r0 + n) * row_bytes + b);
      __builtin_prefetch(span.v + (r0 + n) * row_bytes + b);
    }
    const int cols = (n + W - 1) / W * W;
    for (int h = 0; h < s.num_kv_heads; ++h) {
      LoadHead<kAvx2>(s, span.k + r0 * row_bytes, row_bytes, n, h, blk.k_rows.data(),
                      blk.k_scale);
      LoadHead<kAvx2>(s, span.v + r0 * row_bytes, row_bytes, n, h, blk.v.data(), blk.v_scale);
      Transpose(blk.k_rows.data(), n, cols, d_len, blk.kt.data());
      for (int c = n; c < cols; ++c) blk.k_scale[c] = blk.v_scale[c] = 0.0f;
      // Rows m = t * group + g (query t, head h * group + g) in [t_lo, t_hi) * group.
      const int m_hi = t_hi * group;
      for (int m0 = t_lo * group; m0 < m_hi; m0 += MR) {
        const int rows = std::min(MR, m_hi - m0);
        float* arow[MR];
        float alpha[MR];
        for (int i = 0; i < MR; ++i) {
          const int m = m0 + std::min(i, rows - 1);  // A panel's unused rows repeat its last.
          const int t = m / group;
          const int64_t at = static_cast<int64_t>(t) * s.num_q_heads + h * group + m % group;
          const float* row = q + at * d_len;
          for (int d = 0; d < d_len; ++d) blk.q[d * MR + i] = row[d];
          arow[i] = i < rows ? acc + at * d_len : blk.spare.data();
        }
        PanelScores<W, MR>(blk.q.data(), blk.kt.data(), d_len, cols, blk.p);
        for (int i = 0; i < MR; ++i) {
          int lo = 0, hi = 0;  // Row i's visible columns (none for an unused row).
          const int m = m0 + i;
          const int t = m / group;
          if (i < rows) {
            const int64_t q_pos = int64_t{q_start} + t;
            hi = static_cast<int>(std::min<int64_t>(n, q_pos - first + 1));
            lo = s.window > 0
                     ? static_cast<int>(std::max<int64_t>(0, q_pos - s.window + 1 - first))
                     : 0;
          }
          if (hi <= lo) {  // Nothing to see: the row's partial stays as it is.
            std::memset(blk.p[i], 0, sizeof blk.p[i]);
            std::memset(blk.scaled[i], 0, sizeof blk.scaled[i]);
            alpha[i] = 1.0f;
            continue;
          }
          const int64_t at = static_cast<int64_t>(t) * s.num_q_heads + h * group + m % group;
          alpha[i] = SoftmaxRow<W>(s, blk, blk.p[i], blk.scaled[i], lo, hi, n, cols, max + at,
                                   sum + at);
        }
        PanelValues<W, MR>(arow, alpha, s.quantized() ? blk.scaled : blk.p,
                           blk.v.data(), n, d_len);
      }
    }
  }
}

// The span's visible keys for every query row below q_rows of one sequence: the
// many-query path with enough rows per kv head, else tile by tile.
template <int kIsa>  // 0: baseline, 1: AVX2 with FMA, 2: AVX-512.
TPUSYNC_INLINE void AttendSpanBody(const AttentionShape& s, const float* q, int32_t q_start,
                                   int q_rows, const KeySpan& span, float* acc, float* max,
                                   float* sum) {
  constexpr bool kAvx2 = kIsa >= 1;
  if (q_rows <= 0 || span.rows <= 0) return;
  if (q_rows * (s.num_q_heads / s.num_kv_heads) >= kManyRows) {
    if constexpr (kIsa == 2) {
      AttendMany<16, 12, true>(s, q, q_start, q_rows, span, acc, max, sum);
    } else if constexpr (kIsa == 1) {
      AttendMany<8, 6, true>(s, q, q_start, q_rows, span, acc, max, sum);
    } else {
      AttendMany<4, 4, false>(s, q, q_start, q_rows, span, acc, max, sum);
    }
    return;
  }
  thread_local Tile tile;
  const size_t tile_values = static_cast<size_t>(kTile) * s.num_kv_heads * s.head_dim;
  if (tile.k.size() < tile_values) {
    tile.k.assign(tile_values, 0.0f);
    tile.v.assign(tile_values, 0.0f);
  }
  const size_t tile_scales = static_cast<size_t>(kTile) * s.num_kv_heads;
  if (s.quantized() && tile.k_scale.size() < tile_scales) {
    tile.k_scale.assign(tile_scales, 0.0f);
    tile.v_scale.assign(tile_scales, 0.0f);
  }
  for (int r0 = 0; r0 < span.rows; r0 += kTile) {
    const int n = std::min(kTile, span.rows - r0);
    AttendTileBody<kAvx2>(s, q, q_start, q_rows, span, r0, n, tile, acc, max, sum);
  }
}

void AttendSpanBaseline(const AttentionShape& s, const float* q, int32_t q_start, int q_rows,
                        const KeySpan& span, float* acc, float* max, float* sum) {
  AttendSpanBody<0>(s, q, q_start, q_rows, span, acc, max, sum);
}

#if TPUSYNC_HAVE_AVX2_CLONE
__attribute__((target("avx2,fma"))) void AttendSpanAvx2(const AttentionShape& s, const float* q,
                                                        int32_t q_start, int q_rows,
                                                        const KeySpan& span, float* acc,
                                                        float* max, float* sum) {
  AttendSpanBody<1>(s, q, q_start, q_rows, span, acc, max, sum);
}

__attribute__((target("avx512f,avx2,fma"))) void AttendSpanAvx512(
    const AttentionShape& s, const float* q, int32_t q_start, int q_rows, const KeySpan& span,
    float* acc, float* max, float* sum) {
  AttendSpanBody<2>(s, q, q_start, q_rows, span, acc, max, sum);
}
#endif

using AttendSpanFn = void (*)(const AttentionShape&, const float*, int32_t, int, const KeySpan&,
                              float*, float*, float*);

constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512"};

// The best build this CPU runs (0 baseline, 1 AVX2 with FMA and F16C, 2 AVX-512 too);
// TPUSYNC_CPU_ISA=baseline or avx2 picks a lower one (how the tests run each build).
int PickIsa() {
#if TPUSYNC_HAVE_AVX2_CLONE
  const char* isa = std::getenv("TPUSYNC_CPU_ISA");
  const std::string want = isa == nullptr ? "" : isa;
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (want == "baseline" || !avx2) return 0;
  if (want == "avx2" || !__builtin_cpu_supports("avx512f")) return 1;
  return 2;
#else
  return 0;
#endif
}

const int AttendSpanIsa = PickIsa();

const AttendSpanFn AttendSpan =
#if TPUSYNC_HAVE_AVX2_CLONE
    AttendSpanIsa == 2 ? AttendSpanAvx512 : AttendSpanIsa == 1 ? AttendSpanAvx2 :
#endif
                       AttendSpanBaseline;

}  // namespace

const char* PoolAttentionIsa() { return kIsaNames[AttendSpanIsa]; }

uint64_t QuantizedRowBytes(int32_t num_kv_heads, int32_t head_dim) {
  const uint64_t raw = static_cast<uint64_t>(num_kv_heads) * head_dim + 4ull * num_kv_heads;
  return (raw + 15) / 16 * 16;
}

uint64_t AttentionShape::row_bytes() const {
  if (quantized()) return QuantizedRowBytes(num_kv_heads, head_dim);
  return static_cast<uint64_t>(num_kv_heads) * head_dim * (kv_dtype == KvDtype::kBfloat16 ? 2 : 4);
}

Status AttentionShape::Check() const {
  if (batch < 1 || q_len < 1 || num_q_heads < 1 || num_kv_heads < 1 || head_dim < 1) {
    return InvalidArgument("attention shape needs batch, q_len, heads and head_dim >= 1, got "
                           "batch " +
                           std::to_string(batch) + ", q_len " + std::to_string(q_len) +
                           ", q heads " + std::to_string(num_q_heads) + ", kv heads " +
                           std::to_string(num_kv_heads) + ", head_dim " +
                           std::to_string(head_dim));
  }
  if (num_q_heads % num_kv_heads != 0) {
    return InvalidArgument(std::to_string(num_q_heads) + " query heads are not a multiple of " +
                           std::to_string(num_kv_heads) + " kv heads");
  }
  if (kv_dtype != KvDtype::kFloat32 && kv_dtype != KvDtype::kBfloat16) {
    return InvalidArgument("kv dtype code " + std::to_string(static_cast<int>(kv_dtype)) +
                           " is neither float32 (0) nor bfloat16 (1)");
  }
  if (tier_dtype != TierDtype::kNone && tier_dtype != TierDtype::kInt8 &&
      tier_dtype != TierDtype::kFloat8E4M3) {
    return InvalidArgument("tier dtype code " + std::to_string(static_cast<int>(tier_dtype)) +
                           " is neither none (0), int8 (1) nor float8_e4m3fn (2)");
  }
  return Status::Ok();
}

void SplitSpans(const std::vector<KeySpan>& spans, uint64_t row_bytes,
                std::vector<KeySpan>* first, std::vector<KeySpan>* second) {
  int64_t total = 0;
  for (const KeySpan& s : spans) total += s.rows;
  const int64_t half = total / 2;
  int64_t seen = 0;
  for (const KeySpan& s : spans) {
    if (seen >= half) {
      second->push_back(s);
    } else if (seen + s.rows <= half) {
      first->push_back(s);
    } else {
      const int32_t n = static_cast<int32_t>(half - seen);
      KeySpan head = s, tail = s;
      head.rows = n;
      tail.rows = s.rows - n;
      tail.position = s.position + n;
      tail.k = s.k + n * row_bytes;
      tail.v = s.v + n * row_bytes;
      first->push_back(head);
      second->push_back(tail);
    }
    seen += s.rows;
  }
}

AttentionPartial::AttentionPartial(const AttentionShape& shape)
    : shape_(shape),
      acc_(static_cast<size_t>(shape.batch) * shape.q_len * shape.num_q_heads * shape.head_dim,
           0.0f),
      max_(static_cast<size_t>(shape.batch) * shape.q_len * shape.num_q_heads, kNegInf),
      sum_(max_.size(), 0.0f) {}

void AttentionPartial::Attend(const float* q, const int32_t* q_start, const int32_t* q_rows,
                              const KeySpan& span) {
  const AttentionShape& s = shape_;
  const int64_t per_seq = static_cast<int64_t>(s.q_len) * s.num_q_heads;
  const int b = span.batch;
  const int rows = q_rows == nullptr ? s.q_len : std::clamp(q_rows[b], 0, s.q_len);
  AttendSpan(s, q + b * per_seq * s.head_dim, q_start[b], rows, span,
             acc_.data() + b * per_seq * s.head_dim, max_.data() + b * per_seq,
             sum_.data() + b * per_seq);
}

void AttentionPartial::MergeFrom(const AttentionPartial& other) {
  const int d_len = shape_.head_dim;
  for (size_t i = 0; i < max_.size(); ++i) {
    const float m = std::max(max_[i], other.max_[i]);
    if (m == kNegInf) continue;  // Neither saw a key.
    const float a = max_[i] == kNegInf ? 0.0f : std::exp(max_[i] - m);
    const float b = other.max_[i] == kNegInf ? 0.0f : std::exp(other.max_[i] - m);
    float* x = acc_.data() + i * d_len;
    const float* y = other.acc_.data() + i * d_len;
    for (int d = 0; d < d_len; ++d) x[d] = a * x[d] + b * y[d];
    sum_[i] = a * sum_[i] + b * other.sum_[i];
    max_[i] = m;
  }
}

void AttentionPartial::Finish(float* out, float* lse) const {
  const int d_len = shape_.head_dim;
  for (size_t i = 0; i < max_.size(); ++i) {
    const bool seen = sum_[i] > 0;
    const float inv = seen ? 1.0f / sum_[i] : 0.0f;
    for (int d = 0; d < d_len; ++d) out[i * d_len + d] = seen ? acc_[i * d_len + d] * inv : 0.0f;
    lse[i] = seen ? max_[i] + std::log(sum_[i]) : kNegInf;
  }
}

}  // namespace tpusync
