/* A 16 x 16 transpose of float32 vectors in AVX-512 registers, shared by the kernels
 * that move between lanes of channels and lanes of pixels (window.c's blocked
 * depthwise scheme, gemm.c's lanes tiles). */
#ifndef KEEL_TRANSPOSE_H
#define KEEL_TRANSPOSE_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* r[j] (row j, 16 columns) becomes column j. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* r[4b + j], 128-bit group q: rows 4b..4b+3 of column 4q + j. Step j reads and
       writes only r[j], r[4 + j], r[8 + j], r[12 + j], so it works in place: a copy
       from a second array at the end became a 1 KiB memcpy call per transpose (gcc). */
    for (int j = 0; j < 4; j++) {
        __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        r[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        r[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
}
#endif

#endif
