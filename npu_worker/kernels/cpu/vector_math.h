/* Arithmetic the kernels share (included by kernels.c, matmul.c and matmul_amx.c;
   library.py keys the build by this file too). */
#ifndef NPUPOOL_VECTOR_MATH_H
#define NPUPOOL_VECTOR_MATH_H
#ifdef __AVX512F__
#include <immintrin.h>

/* float32 to bfloat16, rounding to nearest even, NaN kept quiet (as torch rounds) */
static inline __m256i narrow16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __m512i rounded = _mm512_srli_epi32(up, 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                    _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(rounded);
}

/* e^x for x <= 0, 16 lanes, each lane by kernels.c's `exp_nonpositive`'s operations in its
   order (no fused step where it has none), so each gives its bits: x = k ln2 + r, e^r by
   its Taylor polynomial, 2^k into the exponent (the maximum, as `x > -87 ? x : -87`, keeps
   -87 for a NaN too; k is a whole number, so rounding it to an integer is exact) */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 shifter = _mm512_set1_ps(12582912.0f);
    __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                           shifter), shifter);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145752f))),
                             _mm512_mul_ps(k, _mm512_set1_ps(1.42860677e-6f)));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00138888892f), _mm512_set1_ps(0.00833333377f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0416666679f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif
#endif
