/* The vector basics the elementwise and window kernels share (fastmath.c, window.c,
 * winograd.c): VW float lanes per vector — 16 with AVX-512, 8 with AVX, else 4 (SSE2,
 * NEON, or scalars the compiler lowers GNU vectors to) — and unaligned loads and stores
 * through memcpy, which compile to single vector moves. gemm.c keeps its own: its tile
 * shapes depend on the ISA too. */
#ifndef KEEL_VEC_H
#define KEEL_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(float))));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* Every lane s (s - 0 is exact for every s, -0 included). */
static inline vf vsplat(float s) { return s - (vf){0}; }
/* a where take is set, else b (lane by lane, bitwise). */
static inline vf vselect(vi take, vf a, vf b) { return (vf)((take & (vi)a) | (~take & (vi)b)); }
static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#endif
