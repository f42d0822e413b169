/* Tilize, untilize and interleaved page copies on raw bytes (2- or 4-byte elements).
 *
 * Loop orders, chosen by measurement on 4096x4096 arrays (docs/performance.md):
 * - tilize writes each tile front to back (sequential stores) while reading its 32 source rows as
 *   32 short streams; rows two tiles ahead are prefetched into L2, because 32 rows at a
 *   power-of-two stride fall into few cache sets and the hardware prefetchers lose them.
 * - untilize works one tile row at a time in output order: each output row is written front to
 *   back (sequential stores) from one face row of every tile in the row; the reads jump 2-4 KiB
 *   between tiles, so the face rows 16 tiles ahead are prefetched.
 * Outputs larger than TTF_STREAM_BYTES use streaming stores (_stream.h): a regular store first
 * reads its destination line, a streaming store does not.
 */
#ifndef TTFLOW_TILES_H
#define TTFLOW_TILES_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "_stream.h"
#if defined(__SSE2__)
#include <xmmintrin.h>
#define TTF_PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#define TTF_PREFETCH_L1(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define TTF_PREFETCH_L2(p) ((void)(p))
#define TTF_PREFETCH_L1(p) ((void)(p))
#endif

typedef intptr_t ttf_ss;

#define TTF_STREAM_BYTES ((ttf_ss)8 << 20)

/* Where tile/page t lives: page first + t of an interleaved buffer (one bank, no gap: flat). */
typedef struct {
    char *base;
    ttf_ss nbanks, bank_stride, address, aligned, first;
} ttf_pages;

static inline char *ttf_page(const ttf_pages *p, ttf_ss t) {
    ttf_ss page = p->first + t;
    return p->base + (page % p->nbanks) * p->bank_stride + p->address + (page / p->nbanks) * p->aligned;
}

static inline void ttf_face_row(char *dst, const char *src, ttf_ss es, int stream) {
    if (es == 4)
        ttf_copy64(dst, src, stream);
    else
        ttf_copy32(dst, src, stream);
}

/* src: (batch, h, w) with byte strides; element size es. */
static void ttf_tilize(const char *src, ttf_ss batch, ttf_ss h, ttf_ss w, ttf_ss s_batch,
                       ttf_ss s_row, ttf_ss s_col, ttf_ss es, const ttf_pages *out, int stream) {
    ttf_ss th = (h + 31) / 32, tw = (w + 31) / 32, fr = 16 * es;
    int contiguous = s_col == es;
    for (ttf_ss b = 0; b < batch; b++) {
        for (ttf_ss tr = 0; tr < th; tr++) {
            const char *band = src + b * s_batch + tr * 32 * s_row;
            int full_rows = tr * 32 + 32 <= h;
            for (ttf_ss tc = 0; tc < tw; tc++) {
                char *tile = ttf_page(out, (b * th + tr) * tw + tc);
                if (contiguous && full_rows && tc * 32 + 32 <= w) {
                    if (tc * 32 + 96 <= w) {
                        const char *ahead = band + (tc + 2) * 32 * es;
                        for (int r = 0; r < 32; r++) {
                            TTF_PREFETCH_L2(ahead + r * s_row);
                            if (es == 4) TTF_PREFETCH_L2(ahead + r * s_row + 64);
                        }
                    }
                    for (int f = 0; f < 4; f++) {
                        const char *s = band + (f >> 1) * 16 * s_row + (tc * 32 + (f & 1) * 16) * es;
                        char *d = tile + f * 256 * es;
                        for (int r = 0; r < 16; r++) ttf_face_row(d + r * fr, s + r * s_row, es, stream);
                    }
                    continue;
                }
                /* An edge tile (zero padding) or a strided source: row by row. */
                for (ttf_ss r = 0; r < 32; r++) {
                    ttf_ss row = tr * 32 + r;
                    const char *srow = band + r * s_row;
                    char *d = tile + ((r >> 4) * 512 + (r & 15) * 16) * es;
                    for (int fc = 0; fc < 2; fc++) {
                        ttf_ss col0 = tc * 32 + fc * 16, n;
                        char *dd = d + fc * 256 * es;
                        if (row >= h || col0 >= w) {
                            memset(dd, 0, fr);
                            continue;
                        }
                        n = w - col0 < 16 ? w - col0 : 16;
                        if (contiguous)
                            memcpy(dd, srow + col0 * es, n * es);
                        else
                            for (ttf_ss k = 0; k < n; k++) memcpy(dd + k * es, srow + (col0 + k) * s_col, es);
                        if (n < 16) memset(dd + n * es, 0, (16 - n) * es);
                    }
                }
            }
        }
    }
    ttf_fence(stream);
}

/* out: C-contiguous (batch, h, w). Returns 0 if its scratch could not be allocated. */
static int ttf_untilize(const ttf_pages *in, ttf_ss batch, ttf_ss h, ttf_ss w, ttf_ss es,
                        char *out, int stream) {
    ttf_ss th = (h + 31) / 32, tw = (w + 31) / 32, fr = 16 * es, ahead = 16;
    ttf_ss full = w / 32; /* tiles whose 32 columns are all inside the array */
    const char **tiles = (const char **)malloc((size_t)(tw + ahead) * sizeof(char *));
    if (tiles == NULL) return 0;
    /* Streaming stores need 16-byte aligned destinations: every row start must be one. */
    stream = stream && ((uintptr_t)out % 16 == 0) && ((w * es) % 16 == 0);
    for (ttf_ss b = 0; b < batch; b++) {
        for (ttf_ss tr = 0; tr < th; tr++) {
            for (ttf_ss tc = 0; tc < tw; tc++) tiles[tc] = ttf_page(in, (b * th + tr) * tw + tc);
            for (ttf_ss k = 0; k < ahead; k++) tiles[tw + k] = tiles[tw - 1];
            ttf_ss rows = h - tr * 32 < 32 ? h - tr * 32 : 32;
            for (ttf_ss r = 0; r < rows; r++) {
                char *d = out + ((b * h + tr * 32 + r) * w) * es;
                ttf_ss off = ((r >> 4) * 512 + (r & 15) * 16) * es;
                for (ttf_ss tc = 0; tc < full; tc++) {
                    const char *s = tiles[tc] + off;
                    TTF_PREFETCH_L1(tiles[tc + ahead] + off);
                    TTF_PREFETCH_L1(tiles[tc + ahead] + off + 256 * es);
                    ttf_face_row(d, s, es, stream);
                    ttf_face_row(d + fr, s + 256 * es, es, stream);
                    d += 2 * fr;
                }
                if (full < tw) { /* the last, partial tile column */
                    ttf_ss n = w - full * 32;
                    const char *s = tiles[full] + off;
                    memcpy(d, s, (n < 16 ? n : 16) * es);
                    if (n > 16) memcpy(d + fr, s + 256 * es, (n - 16) * es);
                }
            }
        }
    }
    free((void *)tiles);
    ttf_fence(stream);
    return 1;
}

/* n bytes; streaming stores for the 16-byte aligned middle when `stream`. */
static inline void ttf_copy(char *dst, const char *src, ttf_ss n, int stream) {
    if (!stream || n < 128) {
        memcpy(dst, src, n);
        return;
    }
    ttf_ss head = (16 - (ttf_ss)((uintptr_t)dst % 16)) % 16;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    while (n >= 64) {
        ttf_copy64(dst, src, 1);
        dst += 64, src += 64, n -= 64;
    }
    memcpy(dst, src, n);
}

static void ttf_scatter(const char *src, ttf_ss num_pages, ttf_ss page_size, const ttf_pages *out,
                        int stream) {
    for (ttf_ss j = 0; j < num_pages; j++) ttf_copy(ttf_page(out, j), src + j * page_size, page_size, stream);
    ttf_fence(stream);
}

static void ttf_gather(const ttf_pages *in, ttf_ss num_pages, ttf_ss page_size, char *dst, int stream) {
    for (ttf_ss j = 0; j < num_pages; j++) {
        if (j + 1 < num_pages) {
            const char *next = ttf_page(in, j + 1);
            for (ttf_ss k = 0; k < page_size && k < 512; k += 64) TTF_PREFETCH_L1(next + k);
        }
        ttf_copy(dst + j * page_size, ttf_page(in, j), page_size, stream);
    }
    ttf_fence(stream);
}
#endif
