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
 * when none is given). The passes read the signs as packed bits (bit k: element k of the
 * block; set: s = -1): a byte of bits becomes the sign masks of 8 lanes through a lookup
 * table (lut32, lut64) and flips x's sign bit (one xor and one add per element; no hash
 * in the pass). The bits are a pure function of c, so they are cached (sign cache below):
 * an identity table over canonical indices 0..2^ID_BITS - 1 (the identity map, shards'
 * offsets, runs along a stride-1 innermost axis), and per index map whose runs are not
 * stride 1 (transposed layouts) the bits of the whole held array, built page by page
 * (a page = a block) on first use, shared by all threads and plans of the process, at
 * most tt_sig_cache_limit() bytes in all; whatever is not cached is hashed per block
 * (hash_bits: 8 lanes at a time). Cached or hashed, the bits are the same, and so is
 * every result.
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
 * The vector passes are compiled for AVX-512VL, AVX2 and the baseline and picked at run
 * time (vec_isa), the sign hash with target_clones (AVX-512, AVX2, baseline), so the
 * cached shared object stays valid on any x86-64 CPU (no -march=native). They prefetch
 * the data ahead (PREFETCH). benchmarks/sig_cost.py times this kernel against the one
 * before sig.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 32768
#define LANES 16
#define RAW 12
#define CHUNK 2048 /* elements per vector pass call (fixes the order of the sums) */
#define TT_MAXD 8  /* axes of an index map (after merging contiguous ones) */
#define WORDS (BLOCK / 64) /* 64-bit words of a block's sign bits */
#define ID_BITS 28         /* the identity table covers canonical indices below 2^ID_BITS */
#define ID_PAGES ((1 << ID_BITS) / BLOCK)
#define MAX_ENTRIES 256    /* index maps with cached signs */
#define MIN_ENTRY 4096     /* elements of the smallest buffer whose map gets an entry */

enum { NUMEL, NFIN, SUM, M2, MIN, MAX, SUMSQ, ABSS, ZEROS, NANS, EXP, SIG };

/* Field names in enum order: the Python side refuses a library whose layout differs. */
/* The hash of this file a prebuilt kernel was compiled from (setup.py defines it; "" when
 * compiled at run time, where the cache file's name carries it): native.py does not use
 * a prebuilt kernel built from other sources (an editable install keeps an old build). */
#ifndef TT_SOURCE_HASH
#define TT_SOURCE_HASH ""
#endif
const char *tt_source_hash(void) { return TT_SOURCE_HASH; }

const char *tt_raw_names(void) { return "numel,nfinite,sum,m2,min,max,sumsq,abs_sum,zeros,nan,exp,sig"; }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define TT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
/* The vector passes are compiled three times (AVX-512VL, AVX2, baseline) and picked at
 * run time (vec_isa): like target_clones, but the AVX versions use vminps / vmaxps
 * (intrinsics) and AVX-512VL's 32 vector registers (no accumulator spills). */
#define TT_DISPATCH 1
#include <immintrin.h>
#else
#define TT_CLONES
#define TT_DISPATCH 0
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

/* ---------------------------------------------------------------- sign bits
 * A block's signs: bit k (word k / 64, bit k % 64) set iff s = -1 for its element k. */

typedef uint32_t vu8 __attribute__((vector_size(32)));

/* murmur3's fmix32 less its last xor-shift (which leaves bit 31 alone): bit 31 is the
 * sign (traintape.schema.stats.pattern_sign). */
#define HASH8(h, c)         \
    do {                    \
        (h) = (c);          \
        (h) ^= (h) >> 16;   \
        (h) *= 0x85EBCA6Bu; \
        (h) ^= (h) >> 13;   \
        (h) *= 0xC2B2AE35u; \
    } while (0)

#if defined(__clang__)
#define SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE8(v, ...) __builtin_shuffle(v, (vu8){__VA_ARGS__})
#endif

/* Or the k <= 64 low bits of w into dst at bit o (dst has a spare word at the end). */
static inline void put_bits(uint64_t *dst, int64_t o, uint64_t w, int k) {
    int s = (int)(o & 63);
    dst[o >> 6] |= w << s;
    if (s && s + k > 64) dst[(o >> 6) + 1] |= w >> (64 - s);
}

/* Sign bits of the r elements at canonical indices c, c + d, c + 2d, ... (mod 2^32),
 * ored into dst from bit o on (8 hashes per vector, 32 packed per step). */
TT_CLONES static void hash_bits(uint64_t *restrict dst, int64_t o, uint32_t c, uint32_t d,
                                int64_t r) {
    const vu8 iota = {0, 1, 2, 3, 4, 5, 6, 7};
    vu8 cv = iota * d + c;
    const uint32_t step = 8u * d;
    for (int64_t g = 0; g < r; g += 32) {
        vu8 h0, h1, h2, h3;
        HASH8(h0, cv);
        cv += step;
        HASH8(h1, cv);
        cv += step;
        HASH8(h2, cv);
        cv += step;
        HASH8(h3, cv);
        cv += step;
        /* lane j: the signs of elements j, 8 + j, 16 + j, 24 + j at bits 0, 8, 16, 24 */
        vu8 v = (h0 >> 31) | (h1 >> 31) << 8 | (h2 >> 31) << 16 | (h3 >> 31) << 24;
        v <<= iota;
        v |= SHUFFLE8(v, 4, 5, 6, 7, 0, 1, 2, 3);
        v |= SHUFFLE8(v, 2, 3, 0, 1, 6, 7, 4, 5);
        v |= SHUFFLE8(v, 1, 0, 3, 2, 5, 4, 7, 6);
        uint64_t w = v[0];
        int k = r - g < 32 ? (int)(r - g) : 32;
        if (k < 32) w &= ((uint64_t)1 << k) - 1;
        put_bits(dst, o + g, w, k);
    }
}

/* Bits [pos, pos + k) of src (a page: WORDS words and a zero spare) ored into dst at o. */
static void copy_bits(uint64_t *restrict dst, int64_t o, const uint64_t *restrict src,
                      int64_t pos, int64_t k) {
    for (int64_t j = 0; j < k; j += 64) {
        int64_t b = pos + j;
        int s = (int)(b & 63);
        uint64_t w = src[b >> 6] >> s;
        if (s) w |= src[(b >> 6) + 1] << (64 - s);
        int n = k - j < 64 ? (int)(k - j) : 64;
        if (n < 64) w &= ((uint64_t)1 << n) - 1;
        put_bits(dst, o + j, w, n);
    }
}

/* The sign cache: pages of BLOCK sign bits (WORDS words and a zero spare), allocated on
 * first use and published with a compare-and-swap (a thread that loses the race frees
 * its copy); never freed. cache_bytes counts them against the limit: 64 MiB (2^29
 * elements' signs), or $TRAINTAPE_SIG_CACHE_MIB, or tt_sig_cache_limit(). */
#define PAGE_BYTES ((long long)(WORDS + 1) * 8)
#define DEFAULT_LIMIT (64LL << 20)
static _Atomic(uint64_t *) id_table[ID_PAGES]; /* page g: canonical indices g * BLOCK.. */
static atomic_llong cache_bytes;
static atomic_llong cache_limit = -1; /* -1: not yet read from the environment */

static long long limit_now(void) {
    long long v = atomic_load_explicit(&cache_limit, memory_order_relaxed);
    if (v >= 0) return v;
    const char *env = getenv("TRAINTAPE_SIG_CACHE_MIB");
    long long mib = env && *env ? strtoll(env, NULL, 10) : -1;
    long long want = mib < 0 ? DEFAULT_LIMIT : mib > (1LL << 30) ? (1LL << 50) : mib << 20;
    atomic_compare_exchange_strong(&cache_limit, &v, want); /* unless set meanwhile */
    return atomic_load(&cache_limit);
}

/* Set the sign cache's limit to bytes (>= 0; pages already cached stay) and return the
 * previous one; bytes < 0: only return it. */
long long tt_sig_cache_limit(long long bytes) {
    long long v = limit_now();
    return bytes < 0 ? v : atomic_exchange(&cache_limit, bytes);
}

/* Bytes of sign bits cached so far (identity table pages and index map entries). */
long long tt_sig_cache_bytes(void) { return atomic_load(&cache_bytes); }

static int charge(long long bytes) {
    if (atomic_fetch_add(&cache_bytes, bytes) + bytes <= limit_now()) return 1;
    atomic_fetch_sub(&cache_bytes, bytes);
    return 0;
}

/* Publish page p in *slot unless another thread did first (then p is freed); the page
 * in the slot. */
static uint64_t *publish(_Atomic(uint64_t *) *slot, uint64_t *p) {
    uint64_t *prev = NULL;
    if (atomic_compare_exchange_strong_explicit(slot, &prev, p, memory_order_acq_rel,
                                                memory_order_acquire))
        return p;
    free(p);
    return prev;
}

/* Page g of the identity table (NULL: over the cache limit or out of memory). */
static const uint64_t *id_page(int64_t g) {
    uint64_t *p = atomic_load_explicit(&id_table[g], memory_order_acquire);
    if (p) return p;
    if (!charge(PAGE_BYTES)) return NULL;
    p = (uint64_t *)calloc(WORDS + 1, sizeof(uint64_t));
    if (!p) {
        atomic_fetch_sub(&cache_bytes, PAGE_BYTES);
        return NULL;
    }
    hash_bits(p, 0, (uint32_t)(g * BLOCK), 1, BLOCK);
    uint64_t *got = publish(&id_table[g], p);
    if (got != p) atomic_fetch_sub(&cache_bytes, PAGE_BYTES);
    return got;
}

/* Sign bits of canonical indices c..c+r-1 (c + r <= 2^ID_BITS) from the identity table
 * ored into dst at o; how many it wrote (fewer than r if a page could not be had). */
static int64_t id_bits(uint64_t *dst, int64_t o, int64_t c, int64_t r) {
    int64_t done = 0;
    while (done < r) {
        int64_t pos = c % BLOCK, k = BLOCK - pos < r - done ? BLOCK - pos : r - done;
        const uint64_t *t = id_page(c / BLOCK);
        if (!t) break;
        copy_bits(dst, o + done, t, pos, k);
        done += k;
        c += k;
    }
    return done;
}

/* Sign bits of the next n <= BLOCK elements at cursor q into dst (WORDS + 1 words):
 * runs along the innermost axis, stride 1 from the identity table, others hashed. */
static void cursor_bits(cursor_t *q, uint64_t *restrict dst, int64_t n) {
    const imap_t *m = q->m;
    int L = m->nd - 1;
    memset(dst, 0, sizeof(uint64_t) * (WORDS + 1));
    for (int64_t o = 0; n > 0;) {
        int64_t run = m->dim[L] - q->pos[L];
        if (run > n) run = n;
        uint32_t c = q->c, d = m->st[L];
        int64_t done = 0;
        if (d == 1 && (int64_t)c + run <= (1LL << ID_BITS)) done = id_bits(dst, o, c, run);
        if (done < run) hash_bits(dst, o + done, c + (uint32_t)done * d, d, run - done);
        o += run;
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

/* The cached sign bits of a buffer held as map m (all its elements, in held order):
 * for maps whose runs the identity table cannot serve (an innermost stride other than 1
 * or short rows: transposed layouts). Entries are never freed; a list with lock-free
 * insertion (a racing duplicate is dropped). */
typedef struct sig_entry {
    struct sig_entry *next;
    uint64_t key; /* map_key(map, len) */
    imap_t map;
    int64_t len, npages;
    _Atomic(uint64_t *) page[]; /* page b: the signs of block b */
} sig_entry;

static _Atomic(sig_entry *) entries;
static atomic_int n_entries;

static int same_map(const imap_t *a, const imap_t *b) {
    if (a->nd != b->nd || a->off != b->off) return 0;
    for (int k = 0; k < a->nd; k++)
        if (a->dim[k] != b->dim[k] || a->st[k] != b->st[k]) return 0;
    return 1;
}

static uint64_t map_key(const imap_t *m, int64_t len) {
    uint64_t h = (uint64_t)len * 0x9E3779B97F4A7C15u ^ m->off;
    for (int k = 0; k < m->nd; k++)
        h = (h ^ (uint64_t)m->dim[k] ^ ((uint64_t)m->st[k] << 40)) * 0x100000001B3u;
    return h;
}

static sig_entry *find_entry(sig_entry *e, const imap_t *m, int64_t len, uint64_t key) {
    for (; e; e = e->next)
        if (e->key == key && e->len == len && same_map(&e->map, m)) return e;
    return NULL;
}

/* The entry of map m over len elements, created if the cache has room; NULL if not
 * worth one (a small buffer, or rows the identity table serves) or no room. */
static sig_entry *entry_for(const imap_t *m, int64_t len) {
    int L = m->nd - 1;
    if (len < MIN_ENTRY || (m->st[L] == 1 && m->dim[L] >= 256)) return NULL;
    uint64_t key = map_key(m, len);
    sig_entry *head = atomic_load_explicit(&entries, memory_order_acquire);
    sig_entry *e = find_entry(head, m, len, key);
    if (e || atomic_load(&n_entries) >= MAX_ENTRIES) return e;
    int64_t npages = (len + BLOCK - 1) / BLOCK;
    if (!charge(npages * PAGE_BYTES)) return NULL;
    e = (sig_entry *)calloc(1, sizeof(sig_entry) + sizeof(e->page[0]) * (size_t)npages);
    if (!e) {
        atomic_fetch_sub(&cache_bytes, npages * PAGE_BYTES);
        return NULL;
    }
    e->key = key;
    e->map = *m;
    e->len = len;
    e->npages = npages;
    for (;;) {
        e->next = head;
        if (atomic_compare_exchange_weak_explicit(&entries, &head, e, memory_order_acq_rel,
                                                  memory_order_acquire))
            break;
        sig_entry *f = find_entry(head, m, len, key);
        if (f) {
            free(e);
            atomic_fetch_sub(&cache_bytes, npages * PAGE_BYTES);
            return f;
        }
    }
    atomic_fetch_add(&n_entries, 1);
    return e;
}

/* Page b of entry e (NULL: out of memory). Its bytes were charged with the entry. */
static const uint64_t *entry_page(sig_entry *e, int64_t b) {
    uint64_t *p = atomic_load_explicit(&e->page[b], memory_order_acquire);
    if (p) return p;
    p = (uint64_t *)malloc(sizeof(uint64_t) * (WORDS + 1));
    if (!p) return NULL;
    cursor_t q;
    cursor_at(&q, &e->map, b * BLOCK);
    cursor_bits(&q, p, e->len - b * BLOCK < BLOCK ? e->len - b * BLOCK : BLOCK);
    return publish(&e->page[b], p);
}

/* Sign bits of elements [start, start + len) (one block) of a buffer held as map m, e its
 * cache entry or NULL: a cached page, else computed into buf (WORDS + 1 words). */
static const uint64_t *block_signs(const imap_t *m, sig_entry *e, int64_t start, int64_t len,
                                   uint64_t *buf) {
    if (e) {
        const uint64_t *p = entry_page(e, start / BLOCK);
        if (p) return p;
    }
    int64_t c = (int64_t)m->off + start;
    if (m->nd == 1 && m->st[0] == 1 && c % 64 == 0 && c + len <= (1LL << ID_BITS) &&
        c / BLOCK == (c + len - 1) / BLOCK) {
        const uint64_t *t = id_page(c / BLOCK);
        if (t) return t + (c % BLOCK) / 64;
    }
    cursor_t q;
    cursor_at(&q, m, start);
    cursor_bits(&q, buf, len);
    return buf;
}

/* The passes read a block's sign bits as bytes (byte k: elements 8k..8k+7, bit j of it:
 * element 8k + j): the words themselves on a little-endian machine, else a copy. */
static inline unsigned sign_bit(const unsigned char *mb, int64_t i) {
    return (mb[i >> 3] >> (i & 7)) & 1u;
}
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define SIGN_BYTES 1 /* the copy's size: none needed */
#else
#define SIGN_BYTES (BLOCK / 8)
#endif
static const unsigned char *sign_bytes(const uint64_t *sb, int64_t len, unsigned char *bytes) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    (void)len, (void)bytes;
    return (const unsigned char *)sb;
#else
    for (int64_t w = 0; w < (len + 63) / 64; w++)
        for (int b = 0; b < 8; b++) bytes[w * 8 + b] = (unsigned char)(sb[w] >> (8 * b));
    return bytes;
#endif
}

/* Sign masks of 8 lanes from a byte of sign bits: lut32[b][j] (float32, bit 31) and
 * lut64[b][j] (float64, bit 63) are set iff bit j of b is. */
#define SB(b, j, S) (((b) >> (j)) & 1 ? (S) : 0)
#define LUT_ROW(b, S) \
    {SB(b, 0, S), SB(b, 1, S), SB(b, 2, S), SB(b, 3, S),         \
     SB(b, 4, S), SB(b, 5, S), SB(b, 6, S), SB(b, 7, S)}
#define L32(b) LUT_ROW(b, 0x80000000u)
#define S64 0x8000000000000000u
#define L64(b) {SB(b, 0, S64), SB(b, 1, S64), SB(b, 2, S64), SB(b, 3, S64)}
#define R4(M, n) M((n)), M((n) + 1), M((n) + 2), M((n) + 3)
#define R16(M, n) R4(M, n), R4(M, (n) + 4), R4(M, (n) + 8), R4(M, (n) + 12)
#define R64(M, n) R16(M, n), R16(M, (n) + 16), R16(M, (n) + 32), R16(M, (n) + 48)
static const uint32_t lut32[256][8] __attribute__((aligned(64))) = {
    R64(L32, 0), R64(L32, 64), R64(L32, 128), R64(L32, 192)};
static const uint64_t lut64[16][4] __attribute__((aligned(64))) = {R16(L64, 0)};

/* Masked scalar accumulation of p[from:to] (handles NaN/Inf; used for block tails and
 * for blocks the vector pass found non-finite values in). */
#define DEFINE_SCALAR(NAME, T)                                                              \
    static void NAME(const T *restrict p, const unsigned char *restrict mb, int64_t from,   \
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
            a->sg += sign_bit(mb, i) ? -(double)x : (double)x;                              \
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
/* The vector passes prefetch the data PREFETCH bytes ahead (one cache line per loop
 * step): the hardware prefetcher alone left a pass over a large buffer waiting on memory
 * (33M float64 elements: 2x faster with it). Integer arithmetic: the address may lie
 * beyond the buffer's end, where a prefetch is harmless (it never faults). */
#define PREFETCH 8192
#define PREFETCH_AHEAD(q) __builtin_prefetch((const void *)((uintptr_t)(q) + PREFETCH))
/* The vector passes, as macros instantiated per instruction set (TT_DISPATCH). MIN(x, m)
 * and MAX(x, m): lane by lane x < m ? x : m and x > m ? x : m (vminps / vmaxps exactly;
 * the baseline blends). */
#define DEFINE_VEC_F32(NAME, ATTR, MIN, MAX)                                                \
    ATTR static void NAME(const float *restrict p, const unsigned char *restrict mb,        \
                          int64_t len8, double K, acc_t *a) {                               \
        const float kf = (float)K; /* K is an element of p: exact */                        \
        const vf8 k = {kf, kf, kf, kf, kf, kf, kf, kf};                                     \
        const vi8 nosign = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,                     \
                            INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};                    \
        vf8 mn = {INFINITY, INFINITY, INFINITY, INFINITY,                                   \
                  INFINITY, INFINITY, INFINITY, INFINITY};                                  \
        vf8 mx = -mn;                                                                       \
        vi8 nz = {0};                                                                       \
        const vf8 zero = {0};                                                               \
        double s1 = 0, s2 = 0, ab = 0, sg = 0;                                              \
        for (int64_t c = 0; c < len8; c += CHUNK32) {                                       \
            int64_t end = c + CHUNK32 < len8 ? c + CHUNK32 : len8;                          \
            vf8 s1a = {0}, s1b = {0}, s2a = {0}, s2b = {0};                                 \
            vf8 aba = {0}, abb = {0}, sga = {0}, sgb = {0};                                 \
            int64_t i = c;                                                                  \
            for (; i + 16 <= end; i += 16) {                                                \
                vf8 x0, x1;                                                                 \
                vi8 m0, m1;                                                                 \
                memcpy(&x0, p + i, sizeof x0);                                              \
                memcpy(&x1, p + i + 8, sizeof x1);                                          \
                PREFETCH_AHEAD(p + i);                                                      \
                memcpy(&m0, lut32[mb[i >> 3]], sizeof m0);                                  \
                memcpy(&m1, lut32[mb[(i >> 3) + 1]], sizeof m1);                            \
                sga += (vf8)((vi8)x0 ^ m0);                                                 \
                sgb += (vf8)((vi8)x1 ^ m1);                                                 \
                aba += (vf8)((vi8)x0 & nosign);                                             \
                abb += (vf8)((vi8)x1 & nosign);                                             \
                vf8 d0 = x0 - k, d1 = x1 - k;                                               \
                s1a += d0;                                                                  \
                s1b += d1;                                                                  \
                s2a += d0 * d0;                                                             \
                s2b += d1 * d1;                                                             \
                mn = MIN(x0, mn);                                                           \
                mx = MAX(x0, mx);                                                           \
                mn = MIN(x1, mn);                                                           \
                mx = MAX(x1, mx);                                                           \
                nz -= (x0 == zero);                                                         \
                nz -= (x1 == zero);                                                         \
            }                                                                               \
            for (; i < end; i += 8) {                                                       \
                vf8 x0;                                                                     \
                vi8 m0;                                                                     \
                memcpy(&x0, p + i, sizeof x0);                                              \
                memcpy(&m0, lut32[mb[i >> 3]], sizeof m0);                                  \
                sga += (vf8)((vi8)x0 ^ m0);                                                 \
                aba += (vf8)((vi8)x0 & nosign);                                             \
                vf8 d0 = x0 - k;                                                            \
                s1a += d0;                                                                  \
                s2a += d0 * d0;                                                             \
                mn = MIN(x0, mn);                                                           \
                mx = MAX(x0, mx);                                                           \
                nz -= (x0 == zero);                                                         \
            }                                                                               \
            vf8 t1 = s1a + s1b, t2 = s2a + s2b, t3 = aba + abb, t4 = sga + sgb;             \
            for (int j = 0; j < 8; j++) {                                                   \
                s1 += (double)t1[j];                                                        \
                s2 += (double)t2[j];                                                        \
                ab += (double)t3[j];                                                        \
                sg += (double)t4[j];                                                        \
            }                                                                               \
        }                                                                                   \
        a->s1 += s1;                                                                        \
        a->s2 += s2;                                                                        \
        a->ab += ab;                                                                        \
        a->sg += sg;                                                                        \
        for (int j = 0; j < 8; j++) {                                                       \
            if (mn[j] < a->mn) a->mn = mn[j];                                               \
            if (mx[j] > a->mx) a->mx = mx[j];                                               \
            a->nz += nz[j];                                                                 \
        }                                                                                   \
        a->nf += len8;                                                                      \
    }

typedef uint64_t vu64 __attribute__((vector_size(32)));

#define DEFINE_VEC_F64(NAME, ATTR, MIN, MAX)                                                \
    ATTR static void NAME(const double *restrict p, const unsigned char *restrict mb,       \
                          int64_t len8, double K, acc_t *a) {                               \
        const vd4 k = {K, K, K, K};                                                         \
        const vl4 nosign = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};                    \
        vd4 s1a = {0}, s1b = {0}, s2a = {0}, s2b = {0};                                     \
        vd4 aba = {0}, abb = {0}, sga = {0}, sgb = {0};                                     \
        vd4 mn = {INFINITY, INFINITY, INFINITY, INFINITY};                                  \
        vd4 mx = -mn;                                                                       \
        vl4 nz = {0};                                                                       \
        const vd4 zero = {0};                                                               \
        for (int64_t i = 0; i < len8; i += 8) {                                             \
            vd4 xl, xh;                                                                     \
            memcpy(&xl, p + i, sizeof xl);                                                  \
            memcpy(&xh, p + i + 4, sizeof xh);                                              \
            PREFETCH_AHEAD(p + i);                                                          \
            unsigned b = mb[i >> 3];                                                        \
            vu64 ml, mh;                                                                    \
            memcpy(&ml, lut64[b & 15], sizeof ml);                                          \
            memcpy(&mh, lut64[b >> 4], sizeof mh);                                          \
            sga += (vd4)((vu64)xl ^ ml);                                                    \
            sgb += (vd4)((vu64)xh ^ mh);                                                    \
            aba += (vd4)((vl4)xl & nosign);                                                 \
            abb += (vd4)((vl4)xh & nosign);                                                 \
            mn = MIN(xl, mn);                                                               \
            mx = MAX(xl, mx);                                                               \
            mn = MIN(xh, mn);                                                               \
            mx = MAX(xh, mx);                                                               \
            nz -= (xl == zero);                                                             \
            nz -= (xh == zero);                                                             \
            vd4 dl = xl - k, dh = xh - k;                                                   \
            s1a += dl;                                                                      \
            s1b += dh;                                                                      \
            s2a += dl * dl;                                                                 \
            s2b += dh * dh;                                                                 \
        }                                                                                   \
        vd4 s1 = s1a + s1b, s2 = s2a + s2b, ab = aba + abb, sg = sga + sgb;                 \
        for (int j = 0; j < 4; j++) {                                                       \
            a->sg += sg[j];                                                                 \
            a->s1 += s1[j];                                                                 \
            a->s2 += s2[j];                                                                 \
            a->ab += ab[j];                                                                 \
            if (mn[j] < a->mn) a->mn = mn[j];                                               \
            if (mx[j] > a->mx) a->mx = mx[j];                                               \
            a->nz += nz[j];                                                                 \
        }                                                                                   \
        a->nf += len8;                                                                      \
    }

#define BLEND(x, m, I, CMP) \
    ((__typeof__(m))(((I)(x) & (I)((x)CMP(m))) | ((I)(m) & ~(I)((x)CMP(m)))))
#define BLEND_LT(x, m, I) BLEND(x, m, I, <)
#define BLEND_GT(x, m, I) BLEND(x, m, I, >)
#define MIN_F32(x, m) BLEND_LT(x, m, vi8)
#define MAX_F32(x, m) BLEND_GT(x, m, vi8)
#define MIN_F64(x, m) BLEND_LT(x, m, vl4)
#define MAX_F64(x, m) BLEND_GT(x, m, vl4)
DEFINE_VEC_F32(vec_f32_base, , MIN_F32, MAX_F32)
DEFINE_VEC_F64(vec_f64_base, , MIN_F64, MAX_F64)

#if TT_DISPATCH
#define ATTR_AVX2 __attribute__((target("avx2")))
#define ATTR_AVX512 __attribute__((target("avx2,avx512f,avx512vl")))
#define MIN_PS(x, m) ((vf8)_mm256_min_ps((__m256)(x), (__m256)(m)))
#define MAX_PS(x, m) ((vf8)_mm256_max_ps((__m256)(x), (__m256)(m)))
#define MIN_PD(x, m) ((vd4)_mm256_min_pd((__m256d)(x), (__m256d)(m)))
#define MAX_PD(x, m) ((vd4)_mm256_max_pd((__m256d)(x), (__m256d)(m)))
DEFINE_VEC_F32(vec_f32_avx2, ATTR_AVX2, MIN_PS, MAX_PS)
DEFINE_VEC_F64(vec_f64_avx2, ATTR_AVX2, MIN_PD, MAX_PD)
DEFINE_VEC_F32(vec_f32_avx512, ATTR_AVX512, MIN_PS, MAX_PS)
DEFINE_VEC_F64(vec_f64_avx512, ATTR_AVX512, MIN_PD, MAX_PD)

/* 2: AVX-512F and VL, 1: AVX2, 0: neither (determined once; a racing first call
 * computes the same value). */
static int vec_isa(void) {
    static atomic_int isa = -1;
    int v = atomic_load_explicit(&isa, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2
            : __builtin_cpu_supports("avx2")                                         ? 1
                                                                                     : 0;
        atomic_store_explicit(&isa, v, memory_order_relaxed);
    }
    return v;
}
#define VEC_DISPATCH(NAME, T)                                                               \
    static void NAME(const T *restrict p, const unsigned char *restrict mb, int64_t len8,   \
                     double K, acc_t *a) {                                                  \
        switch (vec_isa()) {                                                                \
        case 2: NAME##_avx512(p, mb, len8, K, a); break;                                    \
        case 1: NAME##_avx2(p, mb, len8, K, a); break;                                      \
        default: NAME##_base(p, mb, len8, K, a);                                            \
        }                                                                                   \
    }
#else
#define VEC_DISPATCH(NAME, T)                                                               \
    static void NAME(const T *restrict p, const unsigned char *restrict mb, int64_t len8,   \
                     double K, acc_t *a) {                                                  \
        NAME##_base(p, mb, len8, K, a);                                                     \
    }
#endif
VEC_DISPATCH(vec_f32, float)
VEC_DISPATCH(vec_f64, double)

/* Masked pass of p[0:len] over x * 2^-e (only when the plain pass overflowed): sums of
 * values below 1 in magnitude cannot overflow. Returns the (scaled) shift K. */
#define DEFINE_SCALED(NAME, T)                                                              \
    static double NAME(const T *restrict p, int64_t len, int e, const unsigned char *mb,    \
                       acc_t *a) {                                                          \
        double K = 0.0;                                                                     \
        for (int64_t i = 0; i < len; i++) {                                                 \
            if (p[i] - p[i] == 0) {                                                         \
                K = ldexp((double)p[i], -e);                                                \
                break;                                                                      \
            }                                                                               \
        }                                                                                   \
        for (int64_t i = 0; i < len; i++) {                                                 \
            T x = p[i];                                                                     \
            if (x - x != 0) continue; /* NaN, +-Inf: counted by the plain pass */           \
            double xs = ldexp((double)x, -e), d = xs - K;                                   \
            a->s1 += d;                                                                     \
            a->s2 += d * d;                                                                 \
            a->ab += fabs(xs);                                                              \
            a->sg += sign_bit(mb, i) ? -xs : xs;                                            \
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
    static void NAME(const T *restrict p, int64_t len, const imap_t *im, sig_entry *se,     \
                     int64_t start, part_t *out) {                                          \
        double K = 0.0;                                                                     \
        for (int64_t i = 0; i < len; i++) {                                                 \
            if (p[i] - p[i] == 0) {                                                         \
                K = (double)p[i];                                                           \
                break;                                                                      \
            }                                                                               \
        }                                                                                   \
        uint64_t buf[WORDS + 1];                                                            \
        unsigned char bytes[SIGN_BYTES];                                                    \
        const uint64_t *sb = block_signs(im, se, start, len, buf);                          \
        const unsigned char *mb = sign_bytes(sb, len, bytes);                               \
        acc_t a = {0, 0, 0, INFINITY, -INFINITY, 0, 0, 0, 0};                               \
        for (int64_t c = 0; c < len; c += CHUNK) {                                          \
            int64_t n = c + CHUNK < len ? CHUNK : len - c, n8 = n - n % 8;                  \
            VEC(p + c, mb + c / 8, n8, K, &a);                                              \
            SCALAR(p + c, mb + c / 8, n8, n, K, &a);                                        \
        }                                                                                   \
        if (!isfinite(a.s1) || !isfinite(a.s2) || !isfinite(a.ab) || !isfinite(a.sg)) {     \
            acc_t b = {0, 0, 0, INFINITY, -INFINITY, 0, 0, 0, 0};                           \
            a = b;                                                                          \
            for (int64_t c = 0; c < len; c += CHUNK) {                                      \
                int64_t n = c + CHUNK < len ? CHUNK : len - c;                              \
                SCALAR(p + c, mb + c / 8, 0, n, K, &a);                                     \
            }                                                                               \
        }                                                                                   \
        block_out(&a, K, out);                                                              \
        double big = fabs(a.mn) > fabs(a.mx) ? fabs(a.mn) : fabs(a.mx);                     \
        if (a.nf > 0 && (big >= SCALE_FROM || overflowed(out))) {                           \
            int e;                                                                          \
            frexp(big, &e);                                                                 \
            acc_t b = a;                                                                    \
            b.s1 = b.s2 = b.ab = b.sg = 0;                                                  \
            double Ks = SCALED(p, len, e, mb, &b);                                          \
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
    sig_entry **signs; /* each buffer's sign cache entry (NULL: none) */
    part_t *parts;
} tt_plan;

void tt_plan_free(tt_plan *p) {
    if (!p) return;
    free(p->ptrs); free(p->lens); free(p->first); free(p->owner); free(p->dtypes);
    free(p->maps); free(p->signs); free(p->parts);
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
    p->signs = (sig_entry **)calloc(cap, sizeof(sig_entry *));
    p->first = (int64_t *)malloc(sizeof(int64_t) * (cap + 1));
    if (!p->ptrs || !p->lens || !p->dtypes || !p->maps || !p->signs || !p->first) {
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
        p->signs[i] = entry_for(m, lens[i]);
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
            block_f64((const double *)p->ptrs[i] + start, len, &p->maps[i], p->signs[i], start,
                      &p->parts[b]);
        else
            block_f32((const float *)p->ptrs[i] + start, len, &p->maps[i], p->signs[i], start,
                      &p->parts[b]);
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
