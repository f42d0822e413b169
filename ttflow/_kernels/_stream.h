/* 64-byte copies, with non-temporal stores for outputs larger than the caches.
 *
 * A regular store first reads the destination line (read-for-ownership), so a copy moves three
 * bytes per byte; a streaming store skips that read, which is what lets a large tilize keep up
 * with memcpy (glibc streams large copies too). Small outputs use ordinary stores: they are read
 * again soon and should stay in cache. */
#ifndef TTFLOW_STREAM_H
#define TTFLOW_STREAM_H
#include <string.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void ttf_copy32(char *dst, const char *src, int stream) {
#if defined(__SSE2__)
    if (stream && (((uintptr_t)dst) & 15) == 0) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        return;
    }
#endif
    memcpy(dst, src, 32);
}

static inline void ttf_copy64(char *dst, const char *src, int stream) {
    ttf_copy32(dst, src, stream);
    ttf_copy32(dst + 32, src + 32, stream);
}

static inline void ttf_fence(int stream) {
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
}
#endif
