/* traintape fused stat kernel: one memory pass per buffer.
 *
 * For each input buffer (float32 or float64, contiguous) it computes the mergeable
 * "raw" row (12 doubles, the layout of traintape.schema.stats.RAW_NAMES, checked
 * against tt_raw_names() when the library is loaded):
 *
 *   numel, finite count, sum, M2, min, max, sum of squares, sum |x|, zero count, NaN count,
 *   exp, sig
 *
 * sig = sum s(c) x over finite x, s(c) = +-1 a hash of the element's canonical flat index c
 * (traintape.schema.stats.pattern_sign; mod 2^32). c comes from the buffer's index map
 * (imap_t: the buffer's dims, each axis' step in the canonical index, an offset; identity
 * when none is given): per chunk of CHUNK elements the sign masks are generated into a
 * small stack array (runs along the innermost axis: a vectorised hash loop), and the
 * passes flip x's sign bit with them (one xor and one add per element).
 *
 * (sum, M2, min, max, sum of squares and sum |x| over finite elements only; M2 is the sum
 * of squared deviations from the mean). sum and sum |x| are in units of 2^exp, M2 and the
 * sum of squares in units of 2^(2 exp): exp is 0 unless a block's largest finite |x|
 * reaches 2^480 (~3e144: float64 data), in which case that block is reduced again as x * 2^-e, e the
 * exponent of its largest finite |x| (exact: powers of two), and blocks are brought to
 * the larger exponent when merged (traintape.schema.stats.SCALED / merge).
 *
 * Buffers are cut into fixed blocks of BLOCK elements. Each block is reduced in one pass
 * with LANES independent accumulators (the inner loop is a plain elementwise loop over
 * fixed-size lane arrays, which gcc -O3 vectorises) around a per-block shift K (the
 * block's first finite element); float64 data accumulate in double, float32 data in
 * float32 lanes over CHUNK32-element chunks whose sums are added in double (see vec_f32): S1 = sum(x - K), S2 = sum((x - K)^2), so
 * M2_block = S2 - S1^2 / n does not cancel for near-constant data. Blocks are merged in
 * a fixed order with Chan's parallel formula, so the result does not depend on the number
 * of threads. OpenMP (when compiled with -fopenmp) spreads blocks over threads.
 *
 * target_clones gives AVX-512, AVX2 and baseline versions selected at load time, so the
 * cached shared object stays valid on any x86-64 CPU (no -march=native).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 32768
#define LANES 16
#define RAW 12
#define CHUNK 2048 /* sign masks generated per CHUNK elements */
#define TT_MAXD 8  /* axes of an index map (after merging contiguous ones) */

enum { NUMEL, NFIN, SUM, M2, MIN, MAX, SUMSQ, ABSS, ZEROS, NANS, EXP, SIG };

/* Field names in enum order: the Python side refuses a library whose layout differs. */
const char *tt_raw_names(void) { return "numel,nfinite,sum,m2,min,max,sumsq,abs_sum,zeros,nan,exp,sig"; }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define TT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TT_CLONES
#endif

typedef struct {
    double n;    /* finite count */
    double sum;  /* sum of finite x */
    double m2;   /* sum of squared deviations from the block mean */
    double mn, mx, sumsq, abss, zeros, nans;
    double sig;  /* sum s(c) x over finite x */
    int e;       /* sum, abss, sig in units of 2^e; m2, sumsq in units of 2^(2e) */
} part_t;

typedef struct {
    double s1, s2, ab; /* sum(x - K), sum((x - K)^2), sum |x| over finite x */
    double mn, mx;
    int64_t nf, nz, nn;
    double sg; /* sum s(c) x over finite x */
} acc_t;

/* Index map of a buffer: element (i_0..i_{nd-1}) (row-major over dim) has canonical
 * index off + sum i_k st[k] (mod 2^32). */
typedef struct {
    int nd;
    int64_t dim[TT_MAXD];
    uint32_t st[TT_MAXD];
    uint32_t off;
} imap_t;

/* Position of a pass in a buffer: multi-index and its canonical index. */
typedef struct {
    const imap_t *m;
    int64_t pos[TT_MAXD];
    uint32_t c;
} cursor_t;

static void cursor_at(cursor_t *q, const imap_t *m, int64_t flat) {
    q->m = m;
    q->c = m->off;
    for (int k = m->nd - 1; k >= 0; k--) {
        q->pos[k] = flat % m->dim[k];
        flat /= m->dim[k];
        q->c += (uint32_t)q->pos[k] * m->st[k];
    }
}

/* Sign bit (bit 31) of the pattern at canonical index c: murmur3's fmix32 less its last
 * xor-shift (which leaves bit 31 alone); traintape.schema.stats.pattern_sign. */
static inline uint32_t sign_mask(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h & 0x80000000u;
}

/* Sign masks of the next n elements (n > 0, not past the end of the buffer). */
TT_CLONES static void cursor_fill(cursor_t *q, uint32_t *restrict out, int64_t n) {
    const imap_t *m = q->m;
    int L = m->nd - 1;
    while (n > 0) {
        int64_t run = m->dim[L] - q->pos[L];
        if (run > n) run = n;
        uint32_t c = q->c, d = m->st[L];
        for (int64_t j = 0; j < run; j++) out[j] = sign_mask(c + (uint32_t)j * d);
        out += run;
        n -= run;
        q->c += (uint32_t)run * d;
        q->pos[L] += run;
        for (int k = L; k > 0 && q->pos[k] == m->dim[k]; k--) { /* carry */
            q->pos[k] = 0;
            q->c -= (uint32_t)m->dim[k] * m->st[k];
            q->pos[k - 1]++;
            q->c += m->st[k - 1];
        }
    }
}

/* Masked scalar accumulation of p[from:to] (handles NaN/Inf; used for block tails and
 * for blocks the vector pass found non-finite values in). */
#define DEFINE_SCALAR(NAME, T)                                                              \
    static void NAME(const T *restrict p, const uint32_t *restrict m, int64_t from,         \
                     int64_t to, double K, acc_t *a) {                                      \
        for (int64_t i = from; i < to; i++) {                                               \
            T x = p[i];                                                                     \
            if (x != x) {                                                                   \
                a->nn++;                                                                    \
                continue;                                                                   \
            }                                                                               \
            if (x == 0) a->nz++;                                                            \
            if (x - x != 0) continue; /* +-Inf */                                           \
            double d = (double)x - K;                                                       \
            a->s1 += d;                                                                     \
            a->s2 += d * d;                                                                 \
            a->ab += fabs((double)x);                                                       \
            a->sg += m[i] ? -(double)x : (double)x;                                         \
            if ((double)x < a->mn) a->mn = (double)x;                                       \
            if ((double)x > a->mx) a->mx = (double)x;                                       \
            a->nf++;                                                                        \
        }                                                                                   \
    }
DEFINE_SCALAR(scalar_f32, float)
DEFINE_SCALAR(scalar_f64, double)

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef double vd4 __attribute__((vector_size(32)));
typedef int64_t vl4 __attribute__((vector_size(32)));

/* Unmasked vector pass over p[0:len8) (len8 a multiple of 8), assuming every element is
 * finite; the caller checks the sums and redoes the block masked if that was false.
 * float32 data are accumulated in float32 lanes over short chunks of CHUNK32 elements
 * (each lane adds CHUNK32 / 16 values: relative error ~1e-6 at worst, the precision of
 * the data) and every chunk's partial sums are added in double: no float->double
 * conversion per element, about half the instructions of a double pass. A float32
 * overflow (|x| > ~1e18 squared) shows up as a non-finite sum and sends the block
 * down the exact masked double path. */
#define CHUNK32 512
TT_CLONES static void vec_f32(const float *restrict p, const uint32_t *restrict m, int64_t len8,
                              double K, acc_t *a) {
    const float kf = (float)K; /* K is an element of p: exact */
    const vf8 k = {kf, kf, kf, kf, kf, kf, kf, kf};
    const vi8 nosign = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,
                        INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
    vf8 mn = {INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
    vf8 mx = -mn;
    vi8 nz = {0};
    const vf8 zero = {0};
    double s1 = 0, s2 = 0, ab = 0, sg = 0;
    for (int64_t c = 0; c < len8; c += CHUNK32) {
        int64_t end = c + CHUNK32 < len8 ? c + CHUNK32 : len8;
        vf8 s1a = {0}, s1b = {0}, s2a = {0}, s2b = {0}, aba = {0}, abb = {0}, sga = {0}, sgb = {0};
        int64_t i = c;
        for (; i + 16 <= end; i += 16) {
            vf8 x0, x1;
            vi8 m0, m1;
            memcpy(&x0, p + i, sizeof x0);
            memcpy(&x1, p + i + 8, sizeof x1);
            memcpy(&m0, m + i, sizeof m0);
            memcpy(&m1, m + i + 8, sizeof m1);
            sga += (vf8)((vi8)x0 ^ m0);
            sgb += (vf8)((vi8)x1 ^ m1);
            aba += (vf8)((vi8)x0 & nosign);
            abb += (vf8)((vi8)x1 & nosign);
            vf8 d0 = x0 - k, d1 = x1 - k;
            s1a += d0;
            s1b += d1;
            s2a += d0 * d0;
            s2b += d1 * d1;
            vi8 lt = x0 < mn;
            mn = (vf8)(((vi8)x0 & lt) | ((vi8)mn & ~lt));
            lt = x1 < mn;
            mn = (vf8)(((vi8)x1 & lt) | ((vi8)mn & ~lt));
            vi8 gt = x0 > mx;
            mx = (vf8)(((vi8)x0 & gt) | ((vi8)mx & ~gt));
            gt = x1 > mx;
            mx = (vf8)(((vi8)x1 & gt) | ((vi8)mx & ~gt));
            nz -= (x0 == zero);
            nz -= (x1 == zero);
        }
        for (; i < end; i += 8) {
            vf8 x0;
            vi8 m0;
            memcpy(&x0, p + i, sizeof x0);
            memcpy(&m0, m + i, sizeof m0);
            sga += (vf8)((vi8)x0 ^ m0);
            aba += (vf8)((vi8)x0 & nosign);
            vf8 d0 = x0 - k;
            s1a += d0;
            s2a += d0 * d0;
            vi8 lt = x0 < mn;
            mn = (vf8)(((vi8)x0 & lt) | ((vi8)mn & ~lt));
            vi8 gt = x0 > mx;
            mx = (vf8)(((vi8)x0 & gt) | ((vi8)mx & ~gt));
            nz -= (x0 == zero);
        }
        vf8 t1 = s1a + s1b, t2 = s2a + s2b, t3 = aba + abb, t4 = sga + sgb;
        for (int j = 0; j < 8; j++) {
            s1 += (double)t1[j];
            s2 += (double)t2[j];
            ab += (double)t3[j];
            sg += (double)t4[j];
        }
    }
    a->s1 += s1;
    a->s2 += s2;
    a->ab += ab;
    a->sg += sg;
    for (int j = 0; j < 8; j++) {
        if (mn[j] < a->mn) a->mn = mn[j];
        if (mx[j] > a->mx) a->mx = mx[j];
        a->nz += nz[j];
    }
    a->nf += len8;
}

typedef uint32_t vu4 __attribute__((vector_size(16)));
typedef uint64_t vu64 __attribute__((vector_size(32)));

TT_CLONES static void vec_f64(const double *restrict p, const uint32_t *restrict m, int64_t len8,
                              double K, acc_t *a) {
    const vd4 k = {K, K, K, K};
    const vl4 nosign = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    vd4 s1a = {0}, s1b = {0}, s2a = {0}, s2b = {0}, aba = {0}, abb = {0}, sga = {0}, sgb = {0};
    vd4 mn = {INFINITY, INFINITY, INFINITY, INFINITY};
    vd4 mx = -mn;
    vl4 nz = {0};
    const vd4 zero = {0};
    for (int64_t i = 0; i < len8; i += 8) {
        vd4 xl, xh;
        memcpy(&xl, p + i, sizeof xl);
        memcpy(&xh, p + i + 4, sizeof xh);
        vu4 ml, mh;
        memcpy(&ml, m + i, sizeof ml);
        memcpy(&mh, m + i + 4, sizeof mh);
        sga += (vd4)((vu64)xl ^ (__builtin_convertvector(ml, vu64) << 32));
        sgb += (vd4)((vu64)xh ^ (__builtin_convertvector(mh, vu64) << 32));
        aba += (vd4)((vl4)xl & nosign);
        abb += (vd4)((vl4)xh & nosign);
        vl4 lt = xl < mn;
        mn = (vd4)(((vl4)xl & lt) | ((vl4)mn & ~lt));
        lt = xh < mn;
        mn = (vd4)(((vl4)xh & lt) | ((vl4)mn & ~lt));
        vl4 gt = xl > mx;
        mx = (vd4)(((vl4)xl & gt) | ((vl4)mx & ~gt));
        gt = xh > mx;
        mx = (vd4)(((vl4)xh & gt) | ((vl4)mx & ~gt));
        nz -= (xl == zero);
        nz -= (xh == zero);
        vd4 dl = xl - k, dh = xh - k;
        s1a += dl;
        s1b += dh;
        s2a += dl * dl;
        s2b += dh * dh;
    }
    vd4 s1 = s1a + s1b, s2 = s2a + s2b, ab = aba + abb, sg = sga + sgb;
    for (int j = 0; j < 4; j++) {
        a->sg += sg[j];
        a->s1 += s1[j];
        a->s2 += s2[j];
        a->ab += ab[j];
        if (mn[j] < a->mn) a->mn = mn[j];
        if (mx[j] > a->mx) a->mx = mx[j];
        a->nz += nz[j];
    }
    a->nf += len8;
}

/* Masked pass of p[0:len] over x * 2^-e (only when the plain pass overflowed): sums of
 * values below 1 in magnitude cannot overflow. Returns the (scaled) shift K. */
#define DEFINE_SCALED(NAME, T)                                                              \
    static double NAME(const T *restrict p, int64_t len, int e, const imap_t *im,           \
                       int64_t start, acc_t *a) {                                           \
        double K = 0.0;                                                                     \
        for (int64_t i = 0; i < len; i++) {                                                 \
            if (p[i] - p[i] == 0) {                                                         \
                K = ldexp((double)p[i], -e);                                                \
                break;                                                                      \
            }                                                                               \
        }                                                                                   \
        cursor_t q;                                                                         \
        uint32_t m[CHUNK];                                                                  \
        cursor_at(&q, im, start);                                                           \
        for (int64_t c = 0; c < len; c += CHUNK) {                                          \
            int64_t end = c + CHUNK < len ? c + CHUNK : len;                                \
            cursor_fill(&q, m, end - c);                                                    \
            for (int64_t i = c; i < end; i++) {                                             \
                T x = p[i];                                                                 \
                if (x - x != 0) continue; /* NaN, +-Inf: counted by the plain pass */       \
                double xs = ldexp((double)x, -e), d = xs - K;                               \
                a->s1 += d;                                                                 \
                a->s2 += d * d;                                                             \
                a->ab += fabs(xs);                                                          \
                a->sg += m[i - c] ? -xs : xs;                                               \
            }                                                                               \
        }                                                                                   \
        return K;                                                                           \
    }

DEFINE_SCALED(scaled_f32, float)
DEFINE_SCALED(scaled_f64, double)

/* Block results from the accumulator (sums around the shift K). */
static void block_out(const acc_t *a, double K, part_t *out) {
    double N = (double)a->nf;
    out->n = N;
    out->zeros = (double)a->nz;
    out->nans = (double)a->nn;
    out->abss = a->ab;
    out->sig = a->sg;
    out->mn = a->mn;
    out->mx = a->mx;
    out->e = 0;
    if (N > 0) {
        double sq = a->s1 * a->s1, m2 = a->s2 - sq / N;
        double mean = K + a->s1 / N;
        out->m2 = !isfinite(sq) ? INFINITY : m2 > 0 ? m2 : 0.0; /* inf: redo scaled */
        out->sum = K * N + a->s1;
        out->sumsq = out->m2 + N * mean * mean;
    } else {
        out->m2 = 0;
        out->sum = 0;
        out->sumsq = 0;
    }
}

static int overflowed(const part_t *o) {
    return o->n > 0 && !(isfinite(o->sum) && isfinite(o->m2) && isfinite(o->sumsq) &&
                         isfinite(o->abss) && isfinite(o->sig));
}

/* A block whose largest finite |x| reaches 2^480 is reduced scaled (traintape.schema.stats
 * SCALE_FROM): unscaled sums of up to 2^63 elements below it cannot overflow, in a block
 * or when blocks, tensors' shards or processes are merged. */
#define SCALE_FROM 0x1p480

#define DEFINE_BLOCK(NAME, T, VEC, SCALAR, SCALED)                                          \
    static void NAME(const T *restrict p, int64_t len, const imap_t *im, int64_t start,     \
                     part_t *out) {                                                         \
        double K = 0.0;                                                                     \
        for (int64_t i = 0; i < len; i++) {                                                 \
            if (p[i] - p[i] == 0) {                                                         \
                K = (double)p[i];                                                           \
                break;                                                                      \
            }                                                                               \
        }                                                                                   \
        uint32_t m[CHUNK];                                                                  \
        cursor_t q;                                                                         \
        acc_t a = {0, 0, 0, INFINITY, -INFINITY, 0, 0, 0, 0};                               \
        cursor_at(&q, im, start);                                                           \
        for (int64_t c = 0; c < len; c += CHUNK) {                                          \
            int64_t n = c + CHUNK < len ? CHUNK : len - c, n8 = n - n % 8;                  \
            cursor_fill(&q, m, n);                                                          \
            VEC(p + c, m, n8, K, &a);                                                       \
            SCALAR(p + c, m, n8, n, K, &a);                                                 \
        }                                                                                   \
        if (!isfinite(a.s1) || !isfinite(a.s2) || !isfinite(a.ab) || !isfinite(a.sg)) {    \
            acc_t b = {0, 0, 0, INFINITY, -INFINITY, 0, 0, 0, 0};                           \
            a = b;                                                                          \
            cursor_at(&q, im, start);                                                       \
            for (int64_t c = 0; c < len; c += CHUNK) {                                      \
                int64_t n = c + CHUNK < len ? CHUNK : len - c;                              \
                cursor_fill(&q, m, n);                                                      \
                SCALAR(p + c, m, 0, n, K, &a);                                              \
            }                                                                               \
        }                                                                                   \
        block_out(&a, K, out);                                                              \
        double big = fabs(a.mn) > fabs(a.mx) ? fabs(a.mn) : fabs(a.mx);                     \
        if (a.nf > 0 && (big >= SCALE_FROM || overflowed(out))) {                           \
            int e;                                                                          \
            frexp(big, &e);                                                                 \
            acc_t b = a;                                                                    \
            b.s1 = b.s2 = b.ab = b.sg = 0;                                                  \
            double Ks = SCALED(p, len, e, im, start, &b);                                   \
            block_out(&b, Ks, out);                                                         \
            out->e = e;                                                                     \
        }                                                                                   \
    }

DEFINE_BLOCK(block_f32, float, vec_f32, scalar_f32, scaled_f32)
DEFINE_BLOCK(block_f64, double, vec_f64, scalar_f64, scaled_f64)

/* Bring a part's scaled fields to exponent e >= its own (exact unless they underflow,
 * which only happens for a part negligible beside the one with exponent e). */
static void rescale(part_t *a, int e) {
    if (a->e == e) return;
    int d = a->e - e;
    a->sum = ldexp(a->sum, d);
    a->abss = ldexp(a->abss, d);
    a->sig = ldexp(a->sig, d);
    a->m2 = ldexp(a->m2, 2 * d);
    a->sumsq = ldexp(a->sumsq, 2 * d);
    a->e = e;
}

/* Merge block b into accumulator a (Chan et al.). */
static void merge(part_t *a, const part_t *b_in) {
    part_t bs = *b_in;
    part_t *b = &bs;
    if (b->n > 0) {
        if (a->n == 0) a->e = b->e;
        int e = a->e > b->e ? a->e : b->e;
        rescale(a, e);
        rescale(b, e);
        if (a->n > 0) {
            double n = a->n + b->n;
            double delta = b->sum / b->n - a->sum / a->n;
            a->m2 += b->m2 + delta * delta * (a->n * b->n / n);
        } else {
            a->m2 = b->m2;
        }
        a->n += b->n;
        a->sum += b->sum;
        a->sumsq += b->sumsq;
        a->abss += b->abss;
        a->sig += b->sig;
        if (b->mn < a->mn) a->mn = b->mn;
        if (b->mx > a->mx) a->mx = b->mx;
    }
    a->zeros += b->zeros;
    a->nans += b->nans;
}

int tt_block_size(void) { return BLOCK; }

int tt_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* A plan: n buffers cut into global blocks, each reduced into its own part; blocks can be
 * run in any order, on any thread (tt_plan_run), then merged in a fixed order
 * (tt_plan_finish). Used by tt_raw_stats below (OpenMP) and by the JAX FFI handler
 * (XLA's own thread pool). The plan copies the buffer table, not the data. */
typedef struct tt_plan {
    int64_t n, total;
    uintptr_t *ptrs;
    int64_t *lens, *first, *owner;
    int32_t *dtypes;
    imap_t *maps;
    part_t *parts;
} tt_plan;

void tt_plan_free(tt_plan *p) {
    if (!p) return;
    free(p->ptrs); free(p->lens); free(p->first); free(p->owner); free(p->dtypes);
    free(p->maps); free(p->parts);
    free(p);
}

/* Index maps as the callers pass them: TT_MAP_WORDS int64 per buffer,
 * [nd, off, dim[TT_MAXD], st[TT_MAXD]]; nd = 0 (or no table): the identity. */
#define TT_MAP_WORDS (2 + 2 * TT_MAXD)
int tt_map_words(void) { return TT_MAP_WORDS; }
int tt_max_dims(void) { return TT_MAXD; }

/* NULL if out of memory or a map is malformed (its dims do not multiply to the length). */
tt_plan *tt_plan_new_mapped(int64_t n, const uintptr_t *ptrs, const int64_t *lens,
                            const int32_t *dtypes, const int64_t *maps) {
    tt_plan *p = (tt_plan *)calloc(1, sizeof(tt_plan));
    if (!p) return NULL;
    size_t cap = (size_t)(n > 0 ? n : 1);
    p->n = n;
    p->ptrs = (uintptr_t *)malloc(sizeof(uintptr_t) * cap);
    p->lens = (int64_t *)malloc(sizeof(int64_t) * cap);
    p->dtypes = (int32_t *)malloc(sizeof(int32_t) * cap);
    p->maps = (imap_t *)calloc(cap, sizeof(imap_t));
    p->first = (int64_t *)malloc(sizeof(int64_t) * (cap + 1));
    if (!p->ptrs || !p->lens || !p->dtypes || !p->maps || !p->first) {
        tt_plan_free(p);
        return NULL;
    }
    if (n > 0) {
        memcpy(p->ptrs, ptrs, sizeof(uintptr_t) * (size_t)n);
        memcpy(p->lens, lens, sizeof(int64_t) * (size_t)n);
        memcpy(p->dtypes, dtypes, sizeof(int32_t) * (size_t)n);
    }
    for (int64_t i = 0; i < n; i++) {
        imap_t *m = &p->maps[i];
        const int64_t *w = maps ? maps + i * TT_MAP_WORDS : NULL;
        if (!w || w[0] == 0) {
            m->nd = 1;
            m->dim[0] = lens[i] > 0 ? lens[i] : 1;
            m->st[0] = 1;
            m->off = 0;
            continue;
        }
        if (w[0] < 0 || w[0] > TT_MAXD) {
            tt_plan_free(p);
            return NULL;
        }
        m->nd = (int)w[0];
        m->off = (uint32_t)w[1];
        int64_t size = 1;
        for (int k = 0; k < m->nd; k++) {
            m->dim[k] = w[2 + k];
            m->st[k] = (uint32_t)w[2 + TT_MAXD + k];
            size *= m->dim[k];
        }
        if (size != lens[i] && lens[i] > 0) {
            tt_plan_free(p);
            return NULL;
        }
    }
    p->first[0] = 0;
    for (int64_t i = 0; i < n; i++) p->first[i + 1] = p->first[i] + (lens[i] + BLOCK - 1) / BLOCK;
    p->total = p->first[n];
    size_t tb = (size_t)(p->total > 0 ? p->total : 1);
    p->parts = (part_t *)malloc(sizeof(part_t) * tb);
    p->owner = (int64_t *)malloc(sizeof(int64_t) * tb);
    if (!p->parts || !p->owner) {
        tt_plan_free(p);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = p->first[i]; b < p->first[i + 1]; b++) p->owner[b] = i;
    return p;
}

int64_t tt_plan_blocks(const tt_plan *p) { return p->total; }

/* Reduce global blocks [b0, b1) into their parts. */
void tt_plan_run(tt_plan *p, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        int64_t i = p->owner[b];
        int64_t start = (b - p->first[i]) * (int64_t)BLOCK;
        int64_t len = p->lens[i] - start < BLOCK ? p->lens[i] - start : BLOCK;
        if (p->dtypes[i] == 1)
            block_f64((const double *)p->ptrs[i] + start, len, &p->maps[i], start, &p->parts[b]);
        else
            block_f32((const float *)p->ptrs[i] + start, len, &p->maps[i], start, &p->parts[b]);
    }
}

/* Merge every buffer's parts (in block order) into out: [n, RAW] doubles. */
void tt_plan_finish(const tt_plan *p, double *out) {
    for (int64_t i = 0; i < p->n; i++) {
        part_t acc = {0, 0, 0, INFINITY, -INFINITY, 0, 0, 0, 0, 0, 0};
        for (int64_t b = p->first[i]; b < p->first[i + 1]; b++) merge(&acc, &p->parts[b]);
        double *r = out + i * RAW;
        r[NUMEL] = (double)p->lens[i];
        r[NFIN] = acc.n;
        r[SUM] = acc.sum;
        r[M2] = acc.m2;
        r[MIN] = acc.mn;
        r[MAX] = acc.mx;
        r[SUMSQ] = acc.sumsq;
        r[ABSS] = acc.abss;
        r[ZEROS] = acc.zeros;
        r[NANS] = acc.nans;
        r[EXP] = (double)acc.e;
        r[SIG] = acc.sig;
    }
}

tt_plan *tt_plan_new(int64_t n, const uintptr_t *ptrs, const int64_t *lens,
                     const int32_t *dtypes) {
    return tt_plan_new_mapped(n, ptrs, lens, dtypes, NULL);
}

/* Raw rows of n buffers.
 *   ptrs[i]: data pointer, lens[i]: element count, dtypes[i]: 0 = float32, 1 = float64
 *   maps: NULL (identity index maps) or TT_MAP_WORDS int64 per buffer (tt_plan_new_mapped)
 *   out: [n, RAW] doubles, nthreads <= 0: OpenMP default.
 * Returns 0 on success, -1 if out of memory or a map is malformed. */
int tt_raw_stats_mapped(int64_t n, const uintptr_t *ptrs, const int64_t *lens,
                        const int32_t *dtypes, const int64_t *maps, double *out, int nthreads) {
    tt_plan *p = tt_plan_new_mapped(n, ptrs, lens, dtypes, maps);
    if (!p) return -1;
    int64_t total = p->total;
#ifdef _OPENMP
    if (nthreads <= 0) nthreads = omp_get_max_threads();
#endif
    (void)nthreads;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) if (total > 8)
    for (int64_t b = 0; b < total; b++) tt_plan_run(p, b, b + 1);
    tt_plan_finish(p, out);
    tt_plan_free(p);
    return 0;
}

int tt_raw_stats(int64_t n, const uintptr_t *ptrs, const int64_t *lens, const int32_t *dtypes,
                 double *out, int nthreads) {
    return tt_raw_stats_mapped(n, ptrs, lens, dtypes, NULL, out, nthreads);
}
