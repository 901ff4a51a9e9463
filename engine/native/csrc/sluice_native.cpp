// Sluice's native Llama step: the whole decoder stack (and the lm_head) as one call each, the GIL released.
// The family's variants are options of the same step, not copies of it: per model (embedding scale, attention
// scale, GeGLU instead of SwiGLU, final logit soft-cap) and per layer (q/k norms per head, post-attention and
// post-MLP norms, the layer's own rope tables, a sliding window): Qwen 3 and Gemma 3 beside Llama.
//
// Weights: the layers' linears on the GGUF file's own grids (the Q4 layout for Q4_0 / Q4_1 / Q4_K, with fifth bits for
// Q5_0 / Q5_1 / Q5_K, the Q6 layout for Q6_K, the Q8 layer layout for Q8_0; a linear's parts may differ), Q8_0 (int8,
// per 32-group scale) for
// the token embedding and lm_head.
// Activations are float32; the KV cache is the runner's (bf16 or float32, [blocks][KVH][block_size][D]),
// written and read in place through block tables. Kernels are compiled four times (AVX-512, AVX2+FMA with AVX-VNNI,
// AVX2+FMA, baseline x86-64) and chosen at run time from the CPU's features.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "vector_types.inc"

typedef int vi8 __attribute__((vector_size(32)));

// The Q8 layout's byte pairs of a chunk's columns (k, k + 1) and of the next chunk's, 32 bytes on (k + 2, k + 3), as
// per-column quads, one lane a column (16 lanes: a tile's whole chunk; 8: half of it), in plain C at file scope: the
// variants without the instruction the int8 lm_head kernels need compile them but never run them (their int16 kernel
// takes the int8 values); AVX-512 and AVX-VNNI have their own, which hide these inside their namespaces.
template <typename V>
inline V pairs_to_quads_c(const signed char* p) {
  V v;
  for (int c = 0; c < (int)(sizeof(V) / 4); c++)
    v[c] = (int)((unsigned)(unsigned char)p[2 * c] | (unsigned)(unsigned char)p[2 * c + 1] << 8 |
                 (unsigned)(unsigned char)p[32 + 2 * c] << 16 | (unsigned)(unsigned char)p[33 + 2 * c] << 24);
  return v;
}
inline vi pair_chunks_to_quads(const signed char* p) { return pairs_to_quads_c<vi>(p); }

// vpdpbusd on 8 lanes in plain C, for the variants without AVX-VNNI, which compile the 8-lane VNNI kernels but do
// not run them (HAS_VNNI8 is false there).
inline vi8 dot4_8_c(vi8 acc, vi8 u, vi8 s) {
  for (int i = 0; i < 8; i++)
    for (int b = 0; b < 4; b++)
      acc[i] += (int)(((unsigned)u[i] >> (8 * b)) & 0xFF) * (int)(signed char)(((unsigned)s[i] >> (8 * b)) & 0xFF);
  return acc;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")
namespace isa_avx512 {
namespace {
// Not used: the 8-lane kernels (gemm8.inc) are not this variant's.
template <typename V>
inline void in_register(V&) {}
// a * b + c in one FMA, whatever the compiler would contract (attention's sums: see kernels.inc's score_keys)
inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vi load_u8x16(const unsigned char* p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline vi load_s8x16(const signed char* p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline vu load_u16x16(const unsigned short* p) {
  return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
}
inline void store_u16x16(unsigned short* p, vu v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)v)); }
inline vf load_f16x16(const unsigned short* p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// The pair is broadcast inside the instruction ({1to16}): one micro-op fewer per dot product than a separate load.
inline vi dot2_bcast(vi acc, vi w, const short* x) {
  __m512i a = (__m512i)acc;
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(a) : "v"((__m512i)w), "m"(*(const int*)x));
  return (vi)a;
}
inline vi dot2(vi acc, vi w, vi x) { return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, (__m512i)x); }
// Per lane the 4 products of w's unsigned bytes with the 4 signed bytes at x (broadcast in the instruction).
inline vi dot4_bcast(vi acc, vi w, const signed char* x) {
  __m512i a = (__m512i)acc;
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"((__m512i)w), "m"(*(const int*)x));
  return (vi)a;
}
inline vi dot4(vi acc, vi w, vi x) { return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x); }
// 64 bytes of the Q8 layout, two chunks of 16 columns' byte pairs (k, k + 1) and (k + 2, k + 3): per lane the
// quad k .. k + 3 of its column, by one word permute.
inline vi pair_chunks_to_quads(const signed char* p) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (vi)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(p));
}
inline vs16 maddubs8(vi8 w, vi8 x) { return (vs16)_mm256_maddubs_epi16((__m256i)w, (__m256i)x); }
// int8 activations run the 16-lane vpdpbusd kernel
constexpr int INT8_GEMM_WIDTH = 16;
inline vi round_to_int(vf v) { return (vi)_mm512_cvtps_epi32((__m512)v); }
inline void store_s16(short* p, vi v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)v)); }
inline vi load_s8x32_as_s16(const signed char* p) {
  return (vi)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
}
// The 16-lane GEMMs: one zmm per tile, 32 registers hold the 8-row micro-kernel.
constexpr bool USE_GEMM8 = false;
constexpr int GEMM8_ROWS = 8;
constexpr int GEMM8_ROWS_INT8 = 8;
typedef vf attn_vec;
constexpr int ATTN_REGS = 32;
typedef vf native_vf;
// 8-lane helpers (gemm8.inc, attention), AVX2 instructions.
inline vi8 madd8(vi8 w, vi8 x) { return (vi8)_mm256_madd_epi16((__m256i)w, (__m256i)x); }
inline vu8 load_u16x8(const unsigned short* p) { return (vu8)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline vf8 load_f16x8(const unsigned short* p) { return (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline vi8 load_u8x8(const unsigned char* p) { return (vi8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline vi8 load_s8x8(const signed char* p) { return (vi8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline vi8 load_s8x16_as_s16x8(const signed char* p) {
  return (vi8)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
}
// Per 16-bit lane, the 2 products of w's unsigned bytes with the signed bytes x[0..3] repeated (pmaddubsw); then
// adjacent 16-bit lanes summed into 32 bits.
inline vs16 maddubs_bcast8(vi8 w, const signed char* x) {
  int quad;
  __builtin_memcpy(&quad, x, 4);
  return (vs16)_mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(quad));
}
inline vi8 widen_pairs8(vs16 v) { return (vi8)_mm256_madd_epi16((__m256i)v, _mm256_set1_epi16(1)); }
// int8 runs the 16-lane kernels: the 8-lane ones are compiled, not run
constexpr bool HAS_VNNI8 = false;
inline vi8 dot4_8(vi8 acc, vi8 u, vi8 s) { return dot4_8_c(acc, u, s); }
inline vi8 dot2_8(vi8 acc, vi8 w, vi8 x) { return acc + madd8(w, x); }
inline vi8 pairs_to_quads8(const signed char* p) { return pairs_to_quads_c<vi8>(p); }
}  // namespace
#include "kernels.inc"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace isa_avx2 {
namespace {
// int8 products in pairs of int16 lanes by pmaddubsw (gemm8.inc's add_octet8)
constexpr bool HAS_VNNI8 = false;
#include "avx2_helpers.inc"
inline vi8 dot4_8(vi8 acc, vi8 u, vi8 s) { return dot4_8_c(acc, u, s); }
inline vi8 dot2_8(vi8 acc, vi8 w, vi8 x) { return acc + madd8(w, x); }
inline vi8 pairs_to_quads8(const signed char* p) { return pairs_to_quads_c<vi8>(p); }
}  // namespace
#include "kernels.inc"
}  // namespace isa_avx2
#pragma GCC pop_options

// AVX2 with AVX-VNNI and no AVX-512 (Intel's client cores since Alder Lake, its E-core Xeons such as Sierra Forest;
// a CPU with AVX-512 takes that variant): the avx2 kernels, but the 8-lane int8 GEMMs add each 4 byte products into
// an int32 lane with one vpdpbusd (ymm) where AVX2 needs pmaddubsw, an int16 add and a widening, and the int16 ones
// take vpdpwssd for pmaddwd and an add. The same integer sums, so the same bits.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
namespace isa_avxvnni {
namespace {
constexpr bool HAS_VNNI8 = true;
#include "avx2_helpers.inc"
// per lane, acc plus the 4 products of u's unsigned bytes with s's signed ones
inline vi8 dot4_8(vi8 acc, vi8 u, vi8 s) { return (vi8)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s); }
// per lane, acc plus the 2 products of w's int16 pairs with x's
inline vi8 dot2_8(vi8 acc, vi8 w, vi8 x) { return (vi8)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x); }
// 16 bytes of the Q8 layout's pairs (8 columns' k, k + 1) and the 16 at p + 32 (k + 2, k + 3): per lane its quad
inline vi8 pairs_to_quads8(const signed char* p) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + 32));
  return (vi8)_mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}
}  // namespace
#include "kernels.inc"
}  // namespace isa_avxvnni
#pragma GCC pop_options

namespace isa_base {
namespace {
typedef int vi4 __attribute__((vector_size(16)));
// An 8-lane vector spans two xmm here: nothing to pin (see the avx2 variant's).
template <typename V>
inline void in_register(V&) {}
// No FMA in baseline x86-64: a multiply, then an add.
inline vf8 fmadd(vf8 a, vf8 b, vf8 c) { return a * b + c; }
// Each element widened into a lane of V (plain C: baseline x86-64 has no widening loads).
template <typename V, typename T>
inline V widen(const T* p) {
  V v;
  for (int i = 0; i < (int)(sizeof(V) / sizeof(v[0])); i++) v[i] = p[i];
  return v;
}
inline vi load_u8x16(const unsigned char* p) { return widen<vi>(p); }
inline vi load_s8x16(const signed char* p) { return widen<vi>(p); }
inline vu load_u16x16(const unsigned short* p) { return widen<vu>(p); }
inline void store_u16x16(unsigned short* p, vu v) {
  for (int i = 0; i < 16; i++) p[i] = (unsigned short)v[i];
}
// IEEE half -> float without F16C, which baseline x86-64 lacks (a _Float16 cast is then a library call per value,
// and made the Q4 GEMM 3.5x slower than with float32 scales): the half's exponent and mantissa moved into a
// float's bits and scaled by 2^112 give every finite half exactly, subnormals included; infinities and NaNs get
// the all-ones exponent back. Checked against the cast on all 65,536 halves.
template <typename VU, typename VF>
inline VF half_to_float(VU h) {
  const VU magnitude = (h & 0x7FFFu) << 13;
  const VF f = (VF)magnitude * 0x1p112f;
  VU bits = (VU)f | ((h & 0x8000u) << 16);
  bits = (h & 0x7C00u) == 0x7C00u ? bits | 0x7F800000u : bits;
  return (VF)bits;
}
inline vf load_f16x16(const unsigned short* p) { return half_to_float<vu, vf>(load_u16x16(p)); }
inline vi load_s8x32_as_s16(const signed char* p) {
  vi v;
  for (int i = 0; i < 16; i++) v[i] = (int)(unsigned short)(short)p[2 * i] | ((int)(short)p[2 * i + 1] << 16);
  return v;
}
inline vi dot2(vi acc, vi w, vi x) {
  for (int i = 0; i < 16; i++) {
    const unsigned wi = (unsigned)w[i], xi = (unsigned)x[i];
    acc[i] += (int)(short)(wi & 0xFFFF) * (int)(short)(xi & 0xFFFF) + (int)(short)(wi >> 16) * (int)(short)(xi >> 16);
  }
  return acc;
}
inline vi dot2_bcast(vi acc, vi w, const short* x) {
  int pair;
  __builtin_memcpy(&pair, x, 4);
  return dot2(acc, w, (vi){} + pair);
}
inline vi4 round_to_int(vf4 v) { return (vi4)_mm_cvtps_epi32((__m128)v); }  // nearest even, as lrintf
inline void store_s16(short* p, vi4 v) { _mm_storel_epi64((__m128i*)p, _mm_packs_epi32((__m128i)v, (__m128i)v)); }
// 8-lane GEMM helpers on SSE2 (each 8-lane vector is two xmm of 16): 2 rows keep 8 accumulators in registers.
constexpr bool USE_GEMM8 = true;
constexpr int GEMM8_ROWS = 2;
constexpr int GEMM8_ROWS_INT8 = 2;
typedef vf8 attn_vec;  // two xmm
constexpr int ATTN_REGS = 8;
typedef vf4 native_vf;
inline vi8 madd8(vi8 w, vi8 x) {
  const vi4 lo = (vi4)_mm_madd_epi16((__m128i)__builtin_shufflevector(w, w, 0, 1, 2, 3),
                                     (__m128i)__builtin_shufflevector(x, x, 0, 1, 2, 3));
  const vi4 hi = (vi4)_mm_madd_epi16((__m128i)__builtin_shufflevector(w, w, 4, 5, 6, 7),
                                     (__m128i)__builtin_shufflevector(x, x, 4, 5, 6, 7));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
}
inline vu8 load_u16x8(const unsigned short* p) { return widen<vu8>(p); }
inline vf8 load_f16x8(const unsigned short* p) { return half_to_float<vu8, vf8>(load_u16x8(p)); }
inline vi8 load_u8x8(const unsigned char* p) { return widen<vi8>(p); }
inline vi8 load_s8x8(const signed char* p) { return widen<vi8>(p); }
inline vi8 load_s8x16_as_s16x8(const signed char* p) {
  vi8 v;
  for (int i = 0; i < 8; i++) v[i] = (int)(unsigned short)(short)p[2 * i] | ((int)(short)p[2 * i + 1] << 16);
  return v;
}
inline vs16 maddubs_bcast8(vi8 w, const signed char* x) {
  vs16 r;
  for (int i = 0; i < 16; i++) {
    const unsigned word = (unsigned)w[i / 2], b = (i % 2) * 16;
    r[i] = (short)((int)((word >> b) & 0xFF) * x[(2 * i) % 4] + (int)((word >> (b + 8)) & 0xFF) * x[(2 * i + 1) % 4]);
  }
  return r;
}
inline vi8 widen_pairs8(vs16 v) {
  vi8 r;
  for (int i = 0; i < 8; i++) r[i] = (int)v[2 * i] + (int)v[2 * i + 1];
  return r;
}
// SSE2 has no byte dot product: int8 activations run the int16 kernel on their int16 values (the same bits).
constexpr int INT8_GEMM_WIDTH = 0;
// Not used by this variant's GEMMs (the kernels compile every path): plain C.
inline vi dot4_bcast(vi acc, vi w, const signed char* x) {
  for (int i = 0; i < 16; i++)
    for (int b = 0; b < 4; b++) acc[i] += (int)(((unsigned)w[i] >> (8 * b)) & 0xFF) * x[b];
  return acc;
}
inline vi dot4(vi acc, vi w, vi x) { return dot4_bcast(acc, w, (const signed char*)&x); }
inline vs16 maddubs8(vi8 w, vi8 x) { return maddubs_bcast8(w, (const signed char*)&x); }
constexpr bool HAS_VNNI8 = false;
inline vi8 dot4_8(vi8 acc, vi8 u, vi8 s) { return dot4_8_c(acc, u, s); }
inline vi8 dot2_8(vi8 acc, vi8 w, vi8 x) { return acc + madd8(w, x); }
inline vi8 pairs_to_quads8(const signed char* p) { return pairs_to_quads_c<vi8>(p); }
}  // namespace
#include "kernels.inc"
}  // namespace isa_base

namespace {

struct Kernels {
  std::string name;
  decltype(&isa_base::q4_gemm) q4_gemm;
  decltype(&isa_base::quantize) quantize;
  decltype(&isa_base::pack_x8) pack_x8;
  decltype(&isa_base::q4_gemm_i8) q4_gemm_i8;
  decltype(&isa_base::q8_gemm) q8_gemm;
  decltype(&isa_base::q8_gemm_i8) q8_gemm_i8;
  decltype(&isa_base::q8l_gemm) q8l_gemm;
  decltype(&isa_base::q8l_gemm_i8) q8l_gemm_i8;
  decltype(&isa_base::int8_bytes) int8_bytes;
  decltype(&isa_base::q6_gemm) q6_gemm;
  decltype(&isa_base::add_rmsnorm) add_rmsnorm;
  decltype(&isa_base::group_sums) group_sums;
  decltype(&isa_base::silu_mul) silu_mul;
  decltype(&isa_base::gelu_tanh_mul) gelu_tanh_mul;
  decltype(&isa_base::rope) rope;
  decltype(&isa_base::store_k_f32) store_k_f32;
  decltype(&isa_base::store_k_bf16) store_k_bf16;
  decltype(&isa_base::attend_f32) attend_f32;
  decltype(&isa_base::attend_bf16) attend_bf16;
  decltype(&isa_base::attend_pair_f32) attend_pair_f32;
  decltype(&isa_base::attend_pair_bf16) attend_pair_bf16;
  decltype(&isa_base::madd_peak) madd_peak;
  decltype(&isa_base::madd_peak_i8) madd_peak_i8;
  decltype(&isa_base::read_stream) read_stream;
  decltype(&isa_base::sample_row) sample_row;
  decltype(&isa_base::argmax_row) argmax_row;
};

#define SLUICE_KERNELS(ns)                                                                                        \
  Kernels {                                                                                                       \
    #ns, ns::q4_gemm, ns::quantize, ns::pack_x8, ns::q4_gemm_i8, ns::q8_gemm, ns::q8_gemm_i8, ns::q8l_gemm,       \
        ns::q8l_gemm_i8, ns::int8_bytes, ns::q6_gemm, ns::add_rmsnorm, ns::group_sums, ns::silu_mul, ns::gelu_tanh_mul, ns::rope, \
        ns::store_k_f32, ns::store_k_bf16, ns::attend_f32, ns::attend_bf16, ns::attend_pair_f32,                  \
        ns::attend_pair_bf16, ns::madd_peak, ns::madd_peak_i8, ns::read_stream, ns::sample_row, ns::argmax_row    \
  }

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avxvnni() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
}

Kernels best_kernels() {
  if (cpu_has_avx512()) return SLUICE_KERNELS(isa_avx512);
  if (cpu_has_avxvnni()) return SLUICE_KERNELS(isa_avxvnni);
  if (cpu_has_avx2()) return SLUICE_KERNELS(isa_avx2);
  return SLUICE_KERNELS(isa_base);
}

Kernels& kernels() {
  static Kernels k = best_kernels();
  return k;
}

// "avx512", "avxvnni", "avx2", "base" or "best": for tests of every path on one machine; refuses what the CPU lacks.
std::string set_isa(const std::string& name) {
  if (name == "best") kernels() = best_kernels();
  else if (name == "avx512" && cpu_has_avx512()) kernels() = SLUICE_KERNELS(isa_avx512);
  else if (name == "avxvnni" && cpu_has_avxvnni()) kernels() = SLUICE_KERNELS(isa_avxvnni);
  else if (name == "avx2" && cpu_has_avx2()) kernels() = SLUICE_KERNELS(isa_avx2);
  else if (name == "base") kernels() = SLUICE_KERNELS(isa_base);
  else TORCH_CHECK(false, "instruction set not available here: ", name);
  return kernels().name;
}

std::string isa() { return kernels().name; }

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), what, " must be a contiguous float32 tensor");
}

void check_f16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous(), what, " must be a contiguous float16 tensor");
}

const unsigned short* half_bits(const at::Tensor& t) { return (const unsigned short*)t.data_ptr<at::Half>(); }

// A step's scratch array: every element is written before it is read, so it is not zero-filled as a std::vector
// would be (that memset was ~1-4% of a step's samples).
template <typename T>
class Scratch {
 public:
  explicit Scratch(size_t n = 0) : data_(n ? new T[n] : nullptr), size_(n) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
  size_t size_;
};

// One row's offsets of each 16 as the Q6 kernels take them (Q6Rows): offset16 and, for int8 values, offset16_pairs.
void q6_offsets(const short* row, int K, bool is_int8, int* offset16, int* offset16_pairs) {
  for (int h = 0; h < K / 16; h++) {
    int even = 0, odd = 0;
    for (int i = 0; i < 16; i += 2) even += row[h * 16 + i], odd += row[h * 16 + i + 1];
    offset16[h] = -32 * (even + odd);
    if (is_int8)  // |32 * sum| <= 32 * 8 * 127: int16
      offset16_pairs[h] = (int)((unsigned short)(-32 * even) | (unsigned)(-32 * odd) << 16);
  }
}

// The rows of a linear's input, each quantised once per group of 32, to int16 steps (precision "exact") or int8
// steps (is_int8: llama.cpp's activations), with their group scales and sums; `bytes` also packs the int8 values
// for the kernels that multiply bytes (pack_x8), `sums16` adds the integer sums of each 16 the Q6 layout takes
// (offset16, and offset16_pairs for int8: see Q6Rows).
struct QuantizedRows {
  Scratch<short> xq;
  Scratch<signed char> x8;
  Scratch<float> sx, xsum;
  Scratch<int> offset16, offset16_pairs;

  QuantizedRows(const float* x, long ldx, int M, int K, bool is_int8, bool bytes, bool sums16 = false)
      : xq((size_t)M * K), x8(bytes ? (size_t)M * K : 0), sx((size_t)M * (K / 32)), xsum(sx.size()),
        offset16(sums16 ? (size_t)M * (K / 16) : 0), offset16_pairs(sums16 && is_int8 ? offset16.size() : 0) {
    const Kernels& kern = kernels();
    const int G = K / 32;
    const float qmax = is_int8 ? 127.0f : 32767.0f;
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; r++) {
        const short* row = xq.data() + r * K;
        kern.quantize(x + r * ldx, K, qmax, xq.data() + r * K, sx.data() + r * G, xsum.data() + r * G);
        if (bytes) kern.pack_x8(row, K, x8.data() + r * K);
        if (sums16) q6_offsets(row, K, is_int8, offset16.data() + r * (K / 16), offset16_pairs.data() + r * (K / 16));
      }
    });
  }
};

// int8 activation values as the variant's byte kernels multiply them, made once a call, a row per task (see
// int8_bytes); empty for int16 activations.
struct ByteRows {
  Scratch<unsigned char> bytes;
  Scratch<int> offset16;

  ByteRows(const QuantizedRows& rows, int M, int K, bool is_int8)
      : bytes(is_int8 ? (size_t)M * K : 0), offset16(bytes.size() / 16) {
    if (!is_int8) return;
    const Kernels& kern = kernels();
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; r++)
        kern.int8_bytes(rows.xq.data() + r * K, K, bytes.data() + r * K, offset16.data() + r * (K / 16));
    });
  }
};

// An optional float32 tensor of n values (empty: absent) as a pointer, or nullptr.
const float* optional_f32(const at::Tensor& t, int64_t n, const char* what) {
  if (!t.defined() || !t.numel()) return nullptr;
  check_f32(t, what);
  TORCH_CHECK(t.numel() == n, what, ": wrong size");
  return t.data_ptr<float>();
}

void check_tensor(const at::Tensor& t, at::ScalarType type, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == n, what, ": wrong dtype or size");
}

// A linear in the Q4 layout of kernels.inc, [qs, scale, minv, bias, scale_d, minv_d, qh]: scale / minv float16 (Q4_0,
// Q4_1), float32, or uint8 integers times float32 per super-block (Q4_K's own: scale_d / minv_d, else empty); with
// qh (else empty), the Q5 layout: the fifth bit of each q (Q5_0, Q5_1, Q5_K).
struct Q4Linear {
  std::vector<at::Tensor> t;
  int K = 0, N = 0;
  Q4ScaleArgs scales{};
  const unsigned* qh = nullptr;
  const float* bias_data = nullptr;  // checked once, here

  Q4Linear() = default;
  Q4Linear(const std::vector<at::Tensor>& t_, int K_, int N_) : t(t_), K(K_), N(N_) {
    TORCH_CHECK(t.size() == 7, "a Q4 linear is [qs, scale, minv, bias, scale_d, minv_d, qh]");
    const int64_t tiles = (N + 15) / 16, groups = tiles * (K / 32) * 16;
    TORCH_CHECK(K % 32 == 0 && K > 0, "Q4 linear: K must be a positive multiple of 32");
    check_tensor(t[0], at::kByte, tiles * K * 8, "Q4 linear: qs");
    const at::ScalarType type = t[1].scalar_type();
    TORCH_CHECK(type == at::kHalf || type == at::kFloat || type == at::kByte, "Q4 linear: scales are f16, f32 or u8");
    check_tensor(t[1], type, groups, "Q4 linear: scale");
    check_tensor(t[2], type, groups, "Q4 linear: minv");
    scales = {type == at::kHalf ? Q4_SCALES_F16 : type == at::kFloat ? Q4_SCALES_F32 : Q4_SCALES_SUPER,
              t[1].data_ptr(), t[2].data_ptr(), nullptr, nullptr};
    if (type == at::kByte) {
      TORCH_CHECK(K % 256 == 0, "Q4 linear: super-block scales need K a multiple of 256");
      check_tensor(t[4], at::kFloat, groups / 8, "Q4 linear: scale_d");
      check_tensor(t[5], at::kFloat, groups / 8, "Q4 linear: minv_d");
      scales.scale_d = t[4].data_ptr<float>();
      scales.minv_d = t[5].data_ptr<float>();
    }
    bias_data = optional_f32(t[3], N, "Q4 linear: bias");
    if (t[6].defined() && t[6].numel()) {
      check_tensor(t[6], at::kInt, groups, "Q4 linear: qh");
      qh = (const unsigned*)t[6].data_ptr<int>();
    }
  }

  // y[M, N] (row stride ldy) = x[M, K] (row stride ldx) W^T + b; each row of x quantised once, to int16 steps
  // (precision "exact") or int8 steps (is_int8: twice the multiply-add rate, llama.cpp's activations).
  void run(const float* x, long ldx, int M, float* y, long ldy, bool is_int8) const {
    const Kernels& kern = kernels();
    const QuantizedRows rows(x, ldx, M, K, is_int8, is_int8);
    const unsigned char* q = t[0].data_ptr<unsigned char>();
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
      if (is_int8)
        kern.q4_gemm_i8(q, qh, scales, K, N, bias_data, rows.xq.data(), rows.x8.data(), rows.sx.data(), rows.xsum.data(),
                        M, y, ldy, (int)t0, (int)t1);
      else
        kern.q4_gemm(q, qh, scales, K, N, bias_data, rows.xq.data(), rows.sx.data(), rows.xsum.data(), M, y, ldy, (int)t0,
                     (int)t1);
    });
  }
};

// A layer's linear in the Q8 layer layout of kernels.inc (q8l_micro), [qs, scale, minv, bias]: the file's own grid
// for the types whose q needs more than 4 bits (Q5_x, Q8_0); minv and bias optional (empty tensors). The scale's
// size tells its group: one per 32 weights (Q5_x, Q8_0) or per 16 (Q6_K's).
struct Q8Linear {
  std::vector<at::Tensor> t;
  int K = 0, N = 0;
  int scale_group = 32;
  const float *minv_data = nullptr, *bias_data = nullptr;  // checked once, here

  Q8Linear() = default;
  Q8Linear(const std::vector<at::Tensor>& t_, int K_, int N_) : t(t_), K(K_), N(N_) {
    TORCH_CHECK(t.size() == 4, "a Q8 layer linear is [qs, scale, minv, bias]");
    const int64_t tiles = (N + 15) / 16;
    TORCH_CHECK(K % 32 == 0 && K > 0, "Q8 linear: K must be a positive multiple of 32");
    check_tensor(t[0], at::kChar, tiles * K * 16, "Q8 linear: qs");
    scale_group = t[1].numel() == tiles * (K / 16) * 16 ? 16 : 32;
    check_tensor(t[1], at::kFloat, tiles * (K / scale_group) * 16, "Q8 linear: scale");
    minv_data = optional_f32(t[2], tiles * (K / 32) * 16, "Q8 linear: minv");
    bias_data = optional_f32(t[3], N, "Q8 linear: bias");
  }

  void run(const float* x, long ldx, int M, float* y, long ldy, bool is_int8) const {
    const Kernels& kern = kernels();
    const QuantizedRows rows(x, ldx, M, K, is_int8, false);
    const ByteRows xb(rows, M, K, is_int8);
    const signed char* q = t[0].data_ptr<signed char>();
    const float* s = t[1].data_ptr<float>();
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
      if (is_int8)
        kern.q8l_gemm_i8(q, s, minv_data, scale_group, K, N, bias_data, rows.xq.data(), xb.bytes.data(),
                         xb.offset16.data(), rows.sx.data(),
                         rows.xsum.data(), M, y, ldy, (int)t0, (int)t1);
      else
        kern.q8l_gemm(q, s, minv_data, scale_group, K, N, bias_data, rows.xq.data(), rows.sx.data(),
                      rows.xsum.data(), M, y, ldy, (int)t0, (int)t1);
    });
  }
};

// A linear in the Q6 layout of q6.inc (Q6_K), [qs, qh, sc, d, bias]; bias optional.
struct Q6Linear {
  std::vector<at::Tensor> t;
  int K = 0, N = 0;
  const float* bias_data = nullptr;

  Q6Linear() = default;
  Q6Linear(const std::vector<at::Tensor>& t_, int K_, int N_) : t(t_), K(K_), N(N_) {
    TORCH_CHECK(t.size() == 5, "a Q6 linear is [qs, qh, sc, d, bias]");
    const int64_t tiles = (N + 15) / 16;
    TORCH_CHECK(K % 256 == 0 && K > 0, "Q6 linear: K must be a positive multiple of 256");
    check_tensor(t[0], at::kByte, tiles * K * 8, "Q6 linear: qs");
    check_tensor(t[1], at::kInt, tiles * (K / 16) * 16, "Q6 linear: qh");
    check_tensor(t[2], at::kChar, tiles * (K / 16) * 16, "Q6 linear: sc");
    check_tensor(t[3], at::kFloat, tiles * (K / 256) * 16, "Q6 linear: d");
    bias_data = optional_f32(t[4], N, "Q6 linear: bias");
  }

  void run(const float* x, long ldx, int M, float* y, long ldy, bool is_int8) const {
    const Kernels& kern = kernels();
    const QuantizedRows rows(x, ldx, M, K, is_int8, is_int8, true);
    const unsigned char* qs = t[0].data_ptr<unsigned char>();
    const unsigned* qh = (const unsigned*)t[1].data_ptr<int>();
    const signed char* sc = t[2].data_ptr<signed char>();
    const float* d = t[3].data_ptr<float>();
    const Q6Rows x6{rows.xq.data(), is_int8 ? rows.x8.data() : nullptr, rows.sx.data(), rows.offset16.data(),
                    is_int8 ? rows.offset16_pairs.data() : nullptr};
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
      kern.q6_gemm(qs, qh, sc, d, K, N, bias_data, x6, M, y, ldy, (int)t0, (int)t1);
    });
  }
};

// A layer's linear: one or more parts along N (q, k and v; gate and up), each in its own layout, named by the
// packing ("q4", "q8l", "q6"): a q/k/v whose v is Q6_K runs q and k in the Q4 layout and v in the Q6 one.
typedef std::vector<std::tuple<std::string, int64_t, std::vector<at::Tensor>>> LinearSpec;

struct Linear {
  struct Part {
    int layout = 0;  // 0 Q4, 1 Q8 layer, 2 Q6
    int n0 = 0;
    Q4Linear q4;
    Q8Linear q8;
    Q6Linear q6;
  };
  std::vector<Part> parts;

  Linear() = default;
  Linear(const LinearSpec& spec, int K, int N) {
    int n0 = 0;
    for (const auto& [layout, n, tensors] : spec) {
      Part p;
      p.n0 = n0;
      if (layout == "q4") p.q4 = Q4Linear(tensors, K, (int)n);
      else if (layout == "q8l") p.layout = 1, p.q8 = Q8Linear(tensors, K, (int)n);
      else if (layout == "q6") p.layout = 2, p.q6 = Q6Linear(tensors, K, (int)n);
      else TORCH_CHECK(false, "unknown linear layout ", layout);
      parts.push_back(p);
      n0 += (int)n;
    }
    TORCH_CHECK(n0 == N, "a linear's parts make ", n0, " outputs, expected ", N);
  }

  void run(const float* x, long ldx, int M, float* y, long ldy, bool is_int8) const {
    for (const Part& p : parts) {
      if (p.layout == 0) p.q4.run(x, ldx, M, y + p.n0, ldy, is_int8);
      else if (p.layout == 1) p.q8.run(x, ldx, M, y + p.n0, ldy, is_int8);
      else p.q6.run(x, ldx, M, y + p.n0, ldy, is_int8);
    }
  }
};

struct Q8Matrix {
  at::Tensor qs, scale;
  int K = 0, N = 0;

  Q8Matrix() = default;
  Q8Matrix(at::Tensor qs_, at::Tensor scale_, int K_, int N_) : qs(qs_), scale(scale_), K(K_), N(N_) {
    const int tiles = (N + 15) / 16;
    TORCH_CHECK(K % 32 == 0 && K > 0, "Q8 matrix: K must be a positive multiple of 32");
    TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.numel() == (int64_t)tiles * K * 16,
                "Q8 matrix: bad qs");
    check_f16(scale, "scale");
    TORCH_CHECK(scale.numel() == (int64_t)tiles * (K / 32) * 16, "Q8 matrix: bad scales");
  }

  // is_int8: activations in int8 steps, as llama.cpp's output multiplies them
  void run(const float* x, long ldx, int M, float* y, long ldy, bool is_int8) const {
    const int tiles = (N + 15) / 16;
    const Kernels& kern = kernels();
    const QuantizedRows rows(x, ldx, M, K, is_int8, false);
    const ByteRows xb(rows, M, K, is_int8);
    const signed char* q = qs.data_ptr<signed char>();
    const unsigned short* s = half_bits(scale);
    const int k = K, n = N;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      if (is_int8)
        kern.q8_gemm_i8(q, s, k, n, rows.xq.data(), xb.bytes.data(), xb.offset16.data(), rows.sx.data(), M, y, ldy,
                        (int)t0, (int)t1);
      else
        kern.q8_gemm(q, s, k, n, rows.xq.data(), rows.sx.data(), M, y, ldy, (int)t0, (int)t1);
    });
  }

  // row `n` dequantised into out[K]
  void row(int64_t n, float* out) const {
    const signed char* q = qs.data_ptr<signed char>() + (n / 16) * (int64_t)K * 16 + (n % 16) * 2;
    const at::Half* s = scale.data_ptr<at::Half>() + (n / 16) * (int64_t)(K / 32) * 16 + n % 16;
    for (int k = 0; k < K; k++) out[k] = (float)q[(int64_t)(k / 2) * 32 + k % 2] * (float)s[(k / 32) * 16];
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  // options (set_layer_options); an undefined tensor is an absent step
  at::Tensor q_norm, k_norm;  // [D] scales of each query / key head's RMSNorm, before the rotation (Qwen 3, Gemma 3)
  at::Tensor attn_out_norm, mlp_out_norm;  // [hidden] norms of the attention / MLP output before its residual add
  at::Tensor cos, sin;  // this layer's rope tables when they differ from the model's (Gemma 3's global layers)
  int window = 0;  // > 0: a query at position p attends keys p - window + 1 .. p only
};

const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// One layer linear of either layout (the dtype of qs tells which), as the step runs it.
at::Tensor linear(at::Tensor x, const LinearSpec& spec, int64_t N, bool is_int8) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int M = x.size(0), K = x.size(1);
  Linear w(spec, K, N);
  at::Tensor y = at::empty({M, (int64_t)N}, x.options());
  w.run(x.data_ptr<float>(), K, M, y.data_ptr<float>(), N, is_int8);
  return y;
}

at::Tensor q8_linear(at::Tensor x, at::Tensor qs, at::Tensor scale, int64_t N, bool is_int8) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int M = x.size(0), K = x.size(1);
  Q8Matrix w(qs, scale, K, N);
  at::Tensor y = at::empty({M, (int64_t)N}, x.options());
  w.run(x.data_ptr<float>(), K, M, y.data_ptr<float>(), N, is_int8);
  return y;
}

// For the kernel benchmark: the multiply-adds of `iterations` turns of the register-only dot2 loop on every thread
// of the pool (as the GEMMs run), and the sum of a float32 tensor read once (a streaming read).
// is_int8: the int8 kernels' instruction instead (vpdpbusd, pmaddubsw; the int16 one where int8 runs on it).
int64_t madd_peak(int64_t iterations, bool is_int8) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> done(threads, 0);
  const Kernels& kern = kernels();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      done[t] = (is_int8 ? kern.madd_peak_i8 : kern.madd_peak)(iterations, (int)(t + iterations) & 7);
  });
  int64_t total = 0;
  for (int64_t d : done) total += d;
  return total;
}

double read_stream(at::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.numel() % 64 == 0, "read_stream: a multiple of 64 floats");
  const int64_t n = x.numel(), chunk = 1 << 20;
  const float* p = x.data_ptr<float>();
  std::vector<double> parts((n + chunk - 1) / chunk);
  at::parallel_for(0, (int64_t)parts.size(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++) parts[c] = kernels().read_stream(p + c * chunk, std::min(chunk, n - c * chunk));
  });
  double total = 0;
  for (double v : parts) total += v;
  return total;
}

// Greedy tokens of logits [R, V] float32: torch.argmax(logits, dim=-1) in one pass a row. Rows may lie further
// apart than V (the first V columns of a model's padded vocabulary).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                  logits.size(1) < (1 << 30) && logits.stride(1) == 1 && logits.stride(0) >= logits.size(1),
              "argmax_rows: logits [R, V] float32, each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  at::Tensor tokens = at::empty({R}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const Kernels& kern = kernels();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) out[r] = kern.argmax_row(x + r * ld, (int)V);
  });
  return tokens;
}

// One token per row of logits [R, V] float32: softmax of logits / temperatures[r], top_p[r] by rejection over
// uniforms[r] (in (0, 1], one per round). -1 for a row whose every round was rejected (the caller sorts it).
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperatures, at::Tensor top_p, at::Tensor uniforms) {
  check_f32(logits, "logits");
  check_f32(temperatures, "temperatures");
  check_f32(top_p, "top_p");
  check_f32(uniforms, "uniforms");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.size(1) < (1 << 30), "sample_rows: logits [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperatures.numel() == R && top_p.numel() == R && uniforms.dim() == 2 && uniforms.size(0) == R &&
                  uniforms.size(1) > 0, "sample_rows: temperatures [R], top_p [R], uniforms [R, rounds]");
  const float *x = logits.data_ptr<float>(), *t = temperatures.data_ptr<float>(), *p = top_p.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  const int rounds = (int)uniforms.size(1);
  for (int64_t r = 0; r < R; r++) {
    TORCH_CHECK(t[r] > 0.0f && std::isfinite(t[r]) && p[r] >= 0.0f, "sample_rows: temperature above 0, top_p >= 0");
    for (int k = 0; k < rounds; k++)
      TORCH_CHECK(u[r * rounds + k] > 0.0f && u[r * rounds + k] <= 1.0f, "sample_rows: uniforms in (0, 1]");
  }
  at::Tensor tokens = at::empty({R}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const Kernels& kern = kernels();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(V), bsum((V + 255) / 256);
    for (int64_t r = r0; r < r1; r++)
      out[r] = kern.sample_row(x + r * V, (int)V, t[r], p[r], u + r * rounds, rounds, w.data(), bsum.data());
  });
  return tokens;
}

// Attention alone, as the step runs it for decodes: q [T, heads, D] float32; k, v caches in the step's layout,
// [blocks, KVH, block_size, D] (float32 or bfloat16); block_tables [T, max_blocks] int32; lengths [T] int64: token i
// attends to keys 0 .. lengths[i] - 1 of its table. One task per (token, KV head). Returns [T, heads, D].
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor lengths) {
  check_f32(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  k.is_contiguous() && v.is_contiguous(), "attention: q [T, heads, D], k and v [blocks, KVH, bs, D]");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16, "attention: float32 or bf16 cache");
  const int64_t T = q.size(0), heads = q.size(1), D = q.size(2), KVH = k.size(1), bs = k.size(2);
  TORCH_CHECK(k.size(3) == D && (D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && heads % KVH == 0, "attention: shapes");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == T,
              "attention: block_tables [T, max_blocks] int32");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == T, "attention: lengths [T] int64");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int* table = tables.data_ptr<int>();
  int64_t max_len = 1;
  for (int64_t i = 0; i < T; i++) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= tables.size(1) * bs, "attention: length out of range");
    max_len = std::max(max_len, len[i]);
  }
  for (int64_t i = 0; i < tables.numel(); i++)
    TORCH_CHECK(table[i] >= 0 && table[i] < k.size(0), "attention: block id");
  at::Tensor out = at::empty_like(q);
  const Kernels& kern = kernels();
  const int G = (int)(heads / KVH), Lp = (int)((max_len + 15) / 16 * 16);
  const int64_t head_stride = bs * D, block_stride = KVH * bs * D;
  const float scale = 1.0f / std::sqrt((float)D);
  at::parallel_for(0, T * KVH, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores((size_t)MAX_HEADS_PER_PASS * Lp);
    for (int64_t w = w0; w < w1; w++) {
      const int64_t i = w / KVH, kh = w % KVH;
      const float* qh = q.data_ptr<float>() + (i * heads + kh * G) * D;
      float* o = out.data_ptr<float>() + (i * heads + kh * G) * D;
      const int* tab = table + i * tables.size(1);
      if (k.scalar_type() == at::kBFloat16)
        kern.attend_bf16(qh, G, (int)D, (const unsigned short*)k.data_ptr() + kh * head_stride,
                         (const unsigned short*)v.data_ptr() + kh * head_stride, tab, (int)bs, block_stride, 0,
                         (int)len[i], true, scale, scores.data(), o);
      else
        kern.attend_f32(qh, G, (int)D, k.data_ptr<float>() + kh * head_stride, v.data_ptr<float>() + kh * head_stride,
                        tab, (int)bs, block_stride, 0, (int)len[i], true, scale, scores.data(), o);
    }
  });
  return out;
}

class NativeLlama {
 public:
  NativeLlama(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double eps, int64_t vocab, at::Tensor embed_qs, at::Tensor embed_scale, at::Tensor head_qs,
              at::Tensor head_scale, at::Tensor final_norm, at::Tensor cos, at::Tensor sin)
      : H_(hidden), I_(intermediate), heads_(num_heads), kv_heads_(num_kv_heads), D_(head_dim), eps_(eps),
        vocab_(vocab), embed_(embed_qs, embed_scale, hidden, vocab), head_(head_qs, head_scale, hidden, vocab),
        final_norm_(final_norm), cos_(cos), sin_(sin) {
    TORCH_CHECK(H_ % 32 == 0 && I_ % 32 == 0 && (D_ == 16 || D_ == 32 || D_ == 64 || D_ == 128 || D_ == 256),
                "unsupported model shape");
    attn_scale_ = 1.0f / std::sqrt((float)D_);
    TORCH_CHECK(heads_ % kv_heads_ == 0, "unsupported head grouping");
    check_f32(final_norm_, "final_norm");
    check_f32(cos_, "cos");
    check_f32(sin_, "sin");
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == D_ && sin_.sizes() == cos_.sizes(), "bad rope tables");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const LinearSpec& qkv, const LinearSpec& o,
                 const LinearSpec& gate_up, const LinearSpec& down) {
    check_f32(input_norm, "input_norm");
    check_f32(post_norm, "post_norm");
    const int qkv_n = (heads_ + 2 * kv_heads_) * D_;
    layers_.push_back(Layer{input_norm, post_norm, Linear(qkv, H_, qkv_n), Linear(o, heads_ * D_, H_),
                            Linear(gate_up, H_, 2 * I_), Linear(down, I_, H_)});
  }

  // "exact": the layers' activations in int16 steps; "int8": in int8 steps (twice the rate). The lm_head stays int16.
  void set_precision(const std::string& precision) {
    TORCH_CHECK(precision == "exact" || precision == "int8", "precision must be \"exact\" or \"int8\"");
    is_int8_ = precision == "int8";
  }

  // Gemma's: embeddings times sqrt(hidden), scores times query_pre_attn_scalar^-1/2, GeGLU, capped logits.
  void set_model_options(double embed_scale, double attn_scale, bool gelu_tanh, double final_softcap) {
    embed_scale_ = (float)embed_scale;
    attn_scale_ = (float)attn_scale;
    gelu_tanh_ = gelu_tanh;
    final_softcap_ = (float)final_softcap;
  }

  // Empty tensors leave a step out. cos / sin: [positions, D] like the model's.
  void set_layer_options(int64_t index, at::Tensor q_norm, at::Tensor k_norm, at::Tensor attn_out_norm,
                         at::Tensor mlp_out_norm, at::Tensor cos, at::Tensor sin, int64_t window) {
    TORCH_CHECK(index >= 0 && index < (int64_t)layers_.size(), "no such layer");
    Layer& layer = layers_[index];
    auto optional = [](const at::Tensor& t, int64_t n, const char* what) {
      if (!t.numel()) return at::Tensor();
      check_f32(t, what);
      TORCH_CHECK(t.numel() == n, what, ": wrong size");
      return t;
    };
    layer.q_norm = optional(q_norm, D_, "q_norm");
    layer.k_norm = optional(k_norm, D_, "k_norm");
    layer.attn_out_norm = optional(attn_out_norm, H_, "attn_out_norm");
    layer.mlp_out_norm = optional(mlp_out_norm, H_, "mlp_out_norm");
    if (cos.numel()) {
      check_f32(cos, "cos");
      check_f32(sin, "sin");
      TORCH_CHECK(cos.sizes() == cos_.sizes() && sin.sizes() == cos_.sizes(), "layer rope tables: wrong shape");
      layer.cos = cos, layer.sin = sin;
    } else {
      layer.cos = at::Tensor(), layer.sin = at::Tensor();
    }
    TORCH_CHECK(window >= 0, "window must be >= 0");
    layer.window = (int)window;
  }

  void set_kv_caches(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V cache per layer");
    const auto dtype = k[0].scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "KV cache must be float32 or bfloat16");
    for (size_t i = 0; i < k.size(); i++) {
      for (const auto& c : {k[i], v[i]}) {
        TORCH_CHECK(c.scalar_type() == dtype && c.is_contiguous() && c.dim() == 4, "bad KV cache tensor");
        TORCH_CHECK(c.size(1) == kv_heads_ && c.size(3) == D_ && c.sizes() == k[0].sizes(),
                    "bad KV cache shape: [blocks, KV heads, block_size, head_dim]");
      }
    }
    k_ = k;
    v_ = v;
    num_blocks_ = k[0].size(0);
    block_size_ = k[0].size(2);
    kv_bf16_ = dtype == at::kBFloat16;
  }

  // ids, positions, slots: [T] int64; row_seq: [T] int32 row of block_tables ([S, max_blocks] int32) that
  // holds each token's sequence. Writes every token's K/V into the cache, then each token attends to positions
  // 0 .. its own of its sequence. Returns the hidden states before the final norm, [T, hidden] float32.
  at::Tensor forward(at::Tensor ids, at::Tensor positions, at::Tensor slots, at::Tensor row_seq,
                     at::Tensor block_tables) {
    TORCH_CHECK(!k_.empty(), "set_kv_caches first");
    const int64_t T = ids.numel();
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slots.scalar_type() == at::kLong && row_seq.scalar_type() == at::kInt &&
                    block_tables.scalar_type() == at::kInt,
                "forward: dtypes are int64 ids/positions/slots, int32 row_seq/block_tables");
    TORCH_CHECK(ids.is_contiguous() && positions.is_contiguous() && slots.is_contiguous() &&
                    row_seq.is_contiguous() && block_tables.is_contiguous() && block_tables.dim() == 2,
                "forward: contiguous inputs");
    TORCH_CHECK(positions.numel() == T && slots.numel() == T && row_seq.numel() == T, "forward: lengths differ");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int* seq = row_seq.data_ptr<int>();
    const int* tables = block_tables.data_ptr<int>();
    const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
    for (int64_t i = 0; i < T; i++) {
      TORCH_CHECK(id[i] >= 0 && id[i] < vocab_, "token id out of range");
      TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_.size(0), "position out of range");
      TORCH_CHECK(slot[i] >= 0 && slot[i] < num_blocks_ * block_size_, "slot out of range");
      TORCH_CHECK(seq[i] >= 0 && seq[i] < num_seqs, "row_seq out of range");
      TORCH_CHECK(pos[i] / block_size_ < max_blocks, "block table too short");
    }
    for (int64_t i = 0; i < block_tables.numel(); i++)
      TORCH_CHECK(tables[i] >= 0 && tables[i] < num_blocks_, "block id out of range");

    const Kernels& kern = kernels();
    const int H = H_, I = I_, D = D_, QKV = (heads_ + 2 * kv_heads_) * D_, G = heads_ / kv_heads_;
    at::Tensor hidden = at::empty({T, (int64_t)H}, at::kFloat);
    float* h = hidden.data_ptr<float>();
    Scratch<float> xn((size_t)T * std::max(H, heads_ * D)), qkv((size_t)T * QKV), attn((size_t)T * heads_ * D),
        out((size_t)T * H), gu((size_t)T * 2 * I), act((size_t)T * I);
    int64_t max_len = 0;
    for (int64_t i = 0; i < T; i++) max_len = std::max(max_len, pos[i] + 1);
    std::vector<int> seq_tokens(num_seqs, 0);
    for (int64_t i = 0; i < T; i++) seq_tokens[seq[i]]++;
    std::vector<char> is_decode(T);
    for (int64_t i = 0; i < T; i++) is_decode[i] = seq_tokens[seq[i]] == 1;
    const int Lp = (int)((max_len + 15) / 16 * 16);
    // One task per (token, KV head): its G query heads share the K/V loads. With few such tasks (a decode of one
    // or two streams), one task per (token, query head) instead, so both cores work; each head's arithmetic
    // is the same either way.
    const int per_task = T * kv_heads_ >= 4 * at::get_num_threads() ? G : 1;
    // The tokens the tasks take: one at a time, or two consecutive tokens of one sequence's prefill chunk, which
    // score the keys they both attend in one pass (attend_pair: each key read once for the two, the same bits).
    std::vector<int64_t> units;  // each unit's first token; a unit ends where the next begins
    for (int64_t i = 0; i < T; i++) {
      units.push_back(i);
      if (per_task == G && i + 1 < T && !is_decode[i] && seq[i + 1] == seq[i] && pos[i + 1] == pos[i] + 1) i++;
    }
    units.push_back(T);

    for (int64_t i = 0; i < T; i++) {
      embed_.row(id[i], h + i * H);
      if (embed_scale_ != 1.0f)
        for (int j = 0; j < H; j++) h[i * H + j] *= embed_scale_;
    }
    const float scale = attn_scale_;
    // [blocks, KV heads, block_size, D]: a block's rows of all KV heads lie together
    const int64_t head_stride = block_size_ * D, block_stride = kv_heads_ * head_stride;

    for (size_t l = 0; l < layers_.size(); l++) {
      const Layer& layer = layers_[l];
      const float* cos = (layer.cos.defined() ? layer.cos : cos_).data_ptr<float>();
      const float* sin = (layer.sin.defined() ? layer.sin : sin_).data_ptr<float>();
      const float *q_norm = data_or_null(layer.q_norm), *k_norm = data_or_null(layer.k_norm);
      const float* pending = l == 0 ? nullptr : out.data();  // the previous layer's MLP output, not yet added
      at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; i++)
          kern.add_rmsnorm(h + i * H, pending ? pending + i * H : nullptr, layer.input_norm.data_ptr<float>(),
                           eps_, H, xn.data() + i * H, nullptr);
      });
      layer.qkv.run(xn.data(), H, (int)T, qkv.data(), QKV, is_int8_);
      at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; i++) {
          float* row = qkv.data() + i * QKV;
          if (q_norm)
            for (int hd = 0; hd < heads_; hd++) kern.add_rmsnorm(row + hd * D, nullptr, q_norm, eps_, D, row + hd * D, nullptr);
          if (k_norm)
            for (int hd = heads_; hd < heads_ + kv_heads_; hd++)
              kern.add_rmsnorm(row + hd * D, nullptr, k_norm, eps_, D, row + hd * D, nullptr);
          kern.rope(row, heads_ + kv_heads_, D, cos + pos[i] * D, sin + pos[i] * D);
          for (int kh = 0; kh < kv_heads_; kh++) {
            const float* kr = row + (heads_ + kh) * D;
            const float* vr = row + (heads_ + kv_heads_ + kh) * D;
            const int64_t off = slot[i] / block_size_ * block_stride + kh * head_stride + slot[i] % block_size_ * D;
            if (kv_bf16_) {
              kern.store_k_bf16(kr, (unsigned short*)k_[l].data_ptr() + off, D);
              kern.store_k_bf16(vr, (unsigned short*)v_[l].data_ptr() + off, D);
            } else {
              kern.store_k_f32(kr, k_[l].data_ptr<float>() + off, D);
              kern.store_k_f32(vr, v_[l].data_ptr<float>() + off, D);
            }
          }
        }
      });
      // A sequence with one token in the step (a decode) reads keys no other query of the step has touched.
      // Tasks cost as many keys as their tokens' positions (a causal chunk, sequences of any length): the threads
      // take them one at a time, not in two fixed halves that leave one thread waiting for the other.
      const int64_t groups = heads_ / per_task, num_tasks = ((int64_t)units.size() - 1) * groups;
      std::atomic<int64_t> next_task{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        thread_local std::vector<float> scores;
        if ((int64_t)scores.size() < 2 * MAX_HEADS_PER_PASS * Lp) scores.resize(2 * MAX_HEADS_PER_PASS * Lp);
        for (int64_t w; (w = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
          const int64_t unit = w / groups, i = units[unit];
          const int head = (int)(w % groups * per_task), kh = head / G;
          const int* table = tables + (int64_t)seq[i] * max_blocks;
          const int L = (int)(pos[i] + 1);
          const int first = layer.window > 0 && L > layer.window ? L - layer.window : 0;
          // a pair shares its keys only if both tokens start at the same one (a sliding window moves B's on)
          const bool is_pair = units[unit + 1] - i == 2 && !(layer.window > 0 && L + 1 > layer.window);
          for (int64_t t = i; t < units[unit + 1]; t += is_pair ? 2 : 1) {
            const float* q = qkv.data() + t * QKV + head * D;
            float* o = attn.data() + t * heads_ * D + head * D;
            const int Lt = (int)(pos[t] + 1);
            const int first_t = layer.window > 0 && Lt > layer.window ? Lt - layer.window : 0;
            // the same calls on either cache's elements (bf16 or float32)
            const auto run = [&](const auto* k_cache, const auto* v_cache, auto attend, auto attend_pair) {
              const auto *kc = k_cache + kh * head_stride, *vc = v_cache + kh * head_stride;
              if (is_pair)
                attend_pair(q, q + QKV, per_task, D, kc, vc, table, block_size_, block_stride, first, L, scale,
                            scores.data(), o, o + heads_ * D);
              else
                attend(q, per_task, D, kc, vc, table, block_size_, block_stride, first_t, Lt, is_decode[t], scale,
                       scores.data(), o);
            };
            if (kv_bf16_)
              run((const unsigned short*)k_[l].data_ptr(), (const unsigned short*)v_[l].data_ptr(), kern.attend_bf16,
                  kern.attend_pair_bf16);
            else
              run(k_[l].data_ptr<float>(), v_[l].data_ptr<float>(), kern.attend_f32, kern.attend_pair_f32);
          }
        }
      });
      const int AD = heads_ * D;
      layer.o.run(attn.data(), AD, (int)T, out.data(), H, is_int8_);
      if (layer.attn_out_norm.defined()) normalize_rows(out.data(), T, layer.attn_out_norm);
      at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; i++)
          kern.add_rmsnorm(h + i * H, out.data() + i * H, layer.post_norm.data_ptr<float>(), eps_, H,
                           xn.data() + i * H, nullptr);
      });
      layer.gate_up.run(xn.data(), H, (int)T, gu.data(), 2 * I, is_int8_);
      // in slices of each row, so that a decode step of a few rows keeps both threads busy (elementwise: the
      // same bits however it is cut)
      constexpr int SLICE = 256;
      const int num_slices = (I + SLICE - 1) / SLICE;
      at::parallel_for(0, T * num_slices, 4, [&](int64_t w0, int64_t w1) {
        for (int64_t w = w0; w < w1; w++) {
          const int64_t i = w / num_slices, c0 = (w % num_slices) * SLICE;
          const int len = (int)std::min<int64_t>(SLICE, I - c0);
          const float *gate = gu.data() + i * 2 * I + c0, *up = gate + I;
          float* dst = act.data() + i * I + c0;
          if (gelu_tanh_) kern.gelu_tanh_mul(gate, up, len, dst);
          else kern.silu_mul(gate, up, len, dst);
        }
      });
      layer.down.run(act.data(), I, (int)T, out.data(), H, is_int8_);
      if (layer.mlp_out_norm.defined()) normalize_rows(out.data(), T, layer.mlp_out_norm);
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++) h[i] += out[i];
    return hidden;
  }

  // [N, hidden] hidden states (before the final norm) -> [N, vocab] float32 logits.
  at::Tensor logits(at::Tensor hidden) {
    check_f32(hidden, "hidden");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == H_, "hidden must be [N, hidden]");
    const int64_t N = hidden.size(0);
    std::vector<float> h(hidden.data_ptr<float>(), hidden.data_ptr<float>() + N * H_), xn((size_t)N * H_);
    for (int64_t i = 0; i < N; i++)
      kernels().add_rmsnorm(h.data() + i * H_, nullptr, final_norm_.data_ptr<float>(), eps_, H_, xn.data() + i * H_,
                            nullptr);
    at::Tensor out = at::empty({N, vocab_}, at::kFloat);
    head_.run(xn.data(), H_, (int)N, out.data_ptr<float>(), vocab_, is_int8_);
    if (final_softcap_ > 0.0f) {
      float* y = out.data_ptr<float>();
      for (int64_t i = 0; i < N * vocab_; i++) y[i] = std::tanh(y[i] / final_softcap_) * final_softcap_;
    }
    return out;
  }

 private:
  // rows [T, hidden] of x replaced by their RMSNorm times w, in place
  void normalize_rows(float* x, int64_t T, const at::Tensor& w) const {
    const Kernels& kern = kernels();
    at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; i++) kern.add_rmsnorm(x + i * H_, nullptr, w.data_ptr<float>(), eps_, H_, x + i * H_, nullptr);
    });
  }

  int H_, I_, heads_, kv_heads_, D_;
  float eps_;
  int64_t vocab_;
  Q8Matrix embed_, head_;
  at::Tensor final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_, v_;
  int64_t num_blocks_ = 0, block_size_ = 0;
  bool kv_bf16_ = false;
  float embed_scale_ = 1.0f, attn_scale_ = 1.0f, final_softcap_ = 0.0f;
  bool gelu_tanh_ = false, is_int8_ = false;
};

#include "pack_blocks.inc"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("isa", &isa);
  m.def("set_isa", &set_isa);
  m.def("linear", &linear, py::arg("x"), py::arg("parts"), py::arg("n"), py::arg("is_int8") = false, release());
  m.def("q8_linear", &q8_linear, py::arg("x"), py::arg("qs"), py::arg("scale"), py::arg("n"),
        py::arg("is_int8") = false, release());
  m.def("madd_peak", &madd_peak, py::arg("iterations"), py::arg("is_int8") = false, release());
  m.def("read_stream", &read_stream, release());
  m.def("attention", &attention, release());
  m.def("sample_rows", &sample_rows, release());
  m.def("argmax_rows", &argmax_rows, release());
  // each releases the GIL itself, once it has the blocks' buffer
  m.def("pack_q4_k", &pack_q4_k);
  m.def("pack_q4_legacy", &pack_q4_legacy);
  m.def("pack_q6_k", &pack_q6_k);
  m.def("pack_q8_0", &pack_q8_0);
  py::class_<NativeLlama>(m, "NativeLlama")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &NativeLlama::add_layer)
      .def("set_model_options", &NativeLlama::set_model_options)
      .def("set_precision", &NativeLlama::set_precision)
      .def("set_layer_options", &NativeLlama::set_layer_options)
      .def("set_kv_caches", &NativeLlama::set_kv_caches)
      .def("forward", &NativeLlama::forward, release())
      .def("logits", &NativeLlama::logits, release());
}
