/* BFLOAT8_B, one 16-value face row at a time: 16 float32 <-> one exponent byte + 16 mantissas.
 *
 * Pack follows tt-metal's host packer bit for bit (SPEC section 1; `convert_u32_to_bfp` in
 * tt_metal/impl/data_format/blockfloat_common.cpp). The shared exponent is the largest biased
 * exponent of the row (zeros and subnormals count as 0, so an all-zero row has exponent 0). For
 * each value of exponent e != 0, the 24-bit significand (hidden 1 + fraction) is first shifted
 * right by d = shared - e, the bits shifted out being dropped (truncation, no sticky bit); the 24
 * remaining bits are then rounded to 7 at bit 17, to nearest with ties to even, and clamped to
 * 127. The byte is sign << 7 | magnitude, but a zero magnitude is 0x00 (no negative zero).
 * Exponent-0 inputs (zeros, subnormals) pack to 0x00.
 *
 * The SSE2 path finds sig >> d without a per-lane shift (SSE2 has none): |x| * 2^(150 - shared)
 * is exactly sig * 2^-d (a power-of-two scale), and the float-to-int conversion truncates it,
 * which is the shift. The rounding at bit 17 is then integer: add 0xFFFF plus the bit that
 * decides ties, shift by 17. The scale must stay a normal float, which holds for shared >= 24;
 * there a subnormal input (below 2^-126) scales to under 2^-102 and truncates to 0 by itself.
 * Rows with shared exponent 0 are all zero bytes; rows with shared exponent 1-23 (values below
 * 2^-103) take the portable path, which is the integer rule as written above.
 */
#ifndef TTFLOW_BFP8_H
#define TTFLOW_BFP8_H
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The rule itself, value by value; returns the shared exponent (255: a NaN or inf was seen). */
static inline unsigned ttf_bfp8_pack_row_scalar(const float *src, uint8_t *mant) {
    uint32_t bits[16];
    unsigned shared = 0, c;
    memcpy(bits, src, 64);
    for (c = 0; c < 16; c++) {
        unsigned e = (bits[c] >> 23) & 0xFF;
        shared = e > shared ? e : shared;
    }
    for (c = 0; c < 16; c++) {
        uint32_t v = bits[c], e = (v >> 23) & 0xFF, d = shared - e, q = 0;
        if (e != 0 && d < 24) {
            uint32_t t = ((v & 0x7FFFFF) | 0x800000) >> d; /* the shifted-out bits are gone */
            q = (t + 0xFFFF + ((t >> 17) & 1)) >> 17;      /* nearest, ties to even, at bit 17 */
            q = q > 127 ? 127 : q;
        }
        mant[c] = (uint8_t)(q ? ((v >> 31) << 7) | q : 0);
    }
    return shared;
}

#if defined(__SSE2__)
static inline __m128 ttf_f32_bits(uint32_t bits) {
    return _mm_castsi128_ps(_mm_set1_epi32((int)bits));
}

/* Four rounded magnitudes (0-128, before the clamp) for a row of shared exponent >= 24. */
static inline __m128i ttf_bfp8_mag4(__m128i v, __m128 scale) {
    __m128 a = _mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(0x7FFFFFFF)));
    __m128i t = _mm_cvttps_epi32(_mm_mul_ps(a, scale)); /* sig >> d, exactly */
    __m128i odd = _mm_and_si128(_mm_srli_epi32(t, 17), _mm_set1_epi32(1));
    return _mm_srli_epi32(_mm_add_epi32(t, _mm_add_epi32(odd, _mm_set1_epi32(0xFFFF))), 17);
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
    if (shared < 24) {
        if (shared == 0) { /* zeros and subnormals only */
            memset(mant, 0, 16);
            return 0;
        }
        return ttf_bfp8_pack_row_scalar(src, mant);
    }
    /* 2^(150 - shared): biased exponent 277 - shared, in 22..253 for shared in 24..255. */
    __m128 scale = ttf_f32_bits((277u - shared) << 23);
    __m128i mag = _mm_packus_epi16(
        _mm_packs_epi32(ttf_bfp8_mag4(v0, scale), ttf_bfp8_mag4(v1, scale)),
        _mm_packs_epi32(ttf_bfp8_mag4(v2, scale), ttf_bfp8_mag4(v3, scale)));
    mag = _mm_min_epu8(mag, _mm_set1_epi8(127));
    /* Sign bytes: each lane's top bit spread by an arithmetic shift, narrowed by signed packs. */
    __m128i sign = _mm_packs_epi16(
        _mm_packs_epi32(_mm_srai_epi32(v0, 31), _mm_srai_epi32(v1, 31)),
        _mm_packs_epi32(_mm_srai_epi32(v2, 31), _mm_srai_epi32(v3, 31)));
    sign = _mm_andnot_si128(_mm_cmpeq_epi8(mag, _mm_setzero_si128()),
                            _mm_and_si128(sign, _mm_set1_epi8((char)0x80)));
    _mm_storeu_si128((__m128i *)mant, _mm_or_si128(mag, sign));
    return shared;
#else
    return ttf_bfp8_pack_row_scalar(src, mant);
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
