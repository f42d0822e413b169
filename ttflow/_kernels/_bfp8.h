/* BFLOAT8_B, one 16-value face row at a time: 16 float32 <-> one exponent byte + 16 mantissas.
 *
 * Pack (SPEC section 1): the shared exponent is the largest biased exponent of the row; each
 * value keeps its sign and a 7-bit magnitude, (1 << 23 | fraction) >> (17 + shared - exp), rounded
 * once to nearest with ties to even and clamped to 127. Exponent-0 inputs (zeros, subnormals)
 * get magnitude 0 and keep their sign.
 *
 * The SSE2 path computes the magnitude as |x| * 2^(133 - shared) in float32, which is exact (a
 * power-of-two scale; a result small enough to lose bits is below 0.5 and rounds to 0 anyway),
 * then rounds it to an integer by adding and removing 2^23: one rounding, to nearest even, with
 * no branch per value. Rows whose shared exponent is below 6 would need a scale above 2^127, so
 * they are first scaled by 2^64 (exact as well). The portable path is the integer rule itself.
 */
#ifndef TTFLOW_BFP8_H
#define TTFLOW_BFP8_H
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__SSE2__)
static inline __m128 ttf_f32_bits(uint32_t bits) {
    return _mm_castsi128_ps(_mm_set1_epi32((int)bits));
}

static inline __m128i ttf_bfp8_mag(__m128i v, __m128 pre, __m128 scale) {
    const __m128 magic = _mm_set1_ps(8388608.0f);
    __m128 a = _mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(0x7FFFFFFF)));
    __m128 q = _mm_mul_ps(_mm_mul_ps(a, pre), scale);
    q = _mm_min_ps(_mm_sub_ps(_mm_add_ps(q, magic), magic), _mm_set1_ps(127.0f));
    __m128i m = _mm_cvttps_epi32(q);
    __m128i zero_exp = _mm_cmpeq_epi32(_mm_and_si128(v, _mm_set1_epi32(0x7F800000)),
                                       _mm_setzero_si128());
    m = _mm_andnot_si128(zero_exp, m);
    return _mm_or_si128(m, _mm_and_si128(_mm_srli_epi32(v, 24), _mm_set1_epi32(0x80)));
}
#endif

/* Packs src[0:16] into mant[0:16]; returns the shared exponent (255: a NaN or inf was seen). */
static inline unsigned ttf_bfp8_pack_row(const float *src, uint8_t *mant) {
#if defined(__SSE2__)
    const __m128i em = _mm_set1_epi32(0x7F800000);
    __m128i v0 = _mm_loadu_si128((const __m128i *)src);
    __m128i v1 = _mm_loadu_si128((const __m128i *)(src + 4));
    __m128i v2 = _mm_loadu_si128((const __m128i *)(src + 8));
    __m128i v3 = _mm_loadu_si128((const __m128i *)(src + 12));
    /* Exponent-only bit patterns are ordered floats (0, powers of two, +inf): max_ps works. */
    __m128 m = _mm_max_ps(
        _mm_max_ps(_mm_castsi128_ps(_mm_and_si128(v0, em)), _mm_castsi128_ps(_mm_and_si128(v1, em))),
        _mm_max_ps(_mm_castsi128_ps(_mm_and_si128(v2, em)), _mm_castsi128_ps(_mm_and_si128(v3, em))));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    unsigned shared = (unsigned)_mm_cvtsi128_si32(_mm_castps_si128(m)) >> 23;
    int e = 133 - (int)shared;
    __m128 pre = _mm_set1_ps(1.0f);
    if (shared < 6) {
        pre = ttf_f32_bits(0x5F800000u); /* 2^64 */
        e -= 64;
    }
    __m128 scale = ttf_f32_bits((uint32_t)(e + 127) << 23);
    __m128i lo = _mm_packs_epi32(ttf_bfp8_mag(v0, pre, scale), ttf_bfp8_mag(v1, pre, scale));
    __m128i hi = _mm_packs_epi32(ttf_bfp8_mag(v2, pre, scale), ttf_bfp8_mag(v3, pre, scale));
    _mm_storeu_si128((__m128i *)mant, _mm_packus_epi16(lo, hi));
    return shared;
#else
    uint32_t bits[16];
    unsigned shared = 0, c;
    memcpy(bits, src, 64);
    for (c = 0; c < 16; c++) {
        unsigned e = (bits[c] >> 23) & 0xFF;
        shared = e > shared ? e : shared;
    }
    for (c = 0; c < 16; c++) {
        uint32_t v = bits[c], e = (v >> 23) & 0xFF, q = 0;
        if (e != 0) {
            uint32_t sig = (v & 0x7FFFFF) | 0x800000, shift = 17 + shared - e;
            if (shift < 25) {
                uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
                q = sig >> shift;
                q += (rem > half) | ((rem == half) & (q & 1));
                q = q > 127 ? 127 : q;
            }
        }
        mant[c] = (uint8_t)(((v >> 31) << 7) | q);
    }
    return shared;
#endif
}

/* Unpacks one row: dst[c] = (-1)^sign * magnitude * 2^(shared - 133), exactly. */
static inline void ttf_bfp8_unpack_row(unsigned shared, const uint8_t *mant, float *dst) {
#if defined(__SSE2__)
    /* The scale is kept normal (a subnormal one would read as 0 under denormals-are-zero):
     * below shared exponent 7 it is applied as 2^(shared - 69) then 2^-64, both exact. */
    __m128 scale, post;
    if (shared >= 7) {
        scale = ttf_f32_bits((uint32_t)(shared - 6) << 23); /* 2^(shared - 133) */
        post = _mm_set1_ps(1.0f);
    } else {
        scale = ttf_f32_bits((uint32_t)(shared + 58) << 23); /* 2^(shared - 133 + 64) */
        post = ttf_f32_bits(0x1F800000u);                     /* 2^-64 */
    }
    const __m128i zero = _mm_setzero_si128(), low7 = _mm_set1_epi32(0x7F),
                  sign = _mm_set1_epi32(0x80);
    __m128i b = _mm_loadu_si128((const __m128i *)mant);
    __m128i b16[2] = {_mm_unpacklo_epi8(b, zero), _mm_unpackhi_epi8(b, zero)};
    int i;
    for (i = 0; i < 4; i++) {
        __m128i w = (i & 1) ? _mm_unpackhi_epi16(b16[i >> 1], zero)
                            : _mm_unpacklo_epi16(b16[i >> 1], zero);
        __m128 f = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_and_si128(w, low7)), scale), post);
        f = _mm_or_ps(f, _mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(w, sign), 24)));
        _mm_storeu_ps(dst + 4 * i, f);
    }
#else
    float scale = 1.0f;
    int c, e = (int)shared - 133;
    for (c = 0; c < e; c++) scale *= 2.0f;
    for (c = 0; c > e; c--) scale *= 0.5f;
    for (c = 0; c < 16; c++) {
        float f = (float)(mant[c] & 0x7F) * scale;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        bits |= (uint32_t)(mant[c] >> 7) << 31;
        memcpy(dst + c, &bits, 4);
    }
#endif
}

/* 1 if any of n float32 values is a NaN or an infinity (a read-only, vectorisable scan). */
static inline int ttf_any_non_finite(const float *src, intptr_t n) {
    const uint32_t *bits = (const uint32_t *)src;
    uint32_t bad = 0;
    intptr_t i;
    for (i = 0; i < n; i++) bad |= (uint32_t)((bits[i] & 0x7F800000u) == 0x7F800000u);
    return bad != 0;
}
#endif
