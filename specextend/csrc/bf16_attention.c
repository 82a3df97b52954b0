/* Attention of a few query rows over a bf16 KV cache, for CPUs with AVX-512 BF16 (numerics "bf16-kv").

   For each (batch, KV head): scores = q . k (bf16 pairs multiplied and summed in fp32 by VDPBF16PS), a softmax in
   fp32, then the bf16-rounded probabilities times the values, summed in fp32. Every row sees the prefix (all keys but
   the last `tail`) and, of the tail, the keys its `order` lists, in that order, as if they sat right after the prefix:
   a tree node sees its ancestors where the autoregressive step will find them once they are committed, so its sums
   run in the same order. Keys are taken in blocks of BLOCK at fixed positions (0, BLOCK, 2*BLOCK, ...); each block's
   partial result (max, sum, weighted values) is computed by one thread, and the blocks are merged in order, so a
   row's result depends only on the keys it sees and their order: the same bits alone as among other rows, in a
   chain or a tree, whatever the thread count.
   Built and loaded by specextend/cpu_kernels.py; knows nothing of models or plans. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#define HEAD_DIM 64           /* D: a multiple of 32, at most 256 (cpu_kernels.py builds one library per D) */
#endif
#define BLOCK 256             /* keys per block (a multiple of 64) */
#define VECS (HEAD_DIM / 16)  /* fp32 vectors of one row's weighted values */
#define SETS (VECS <= 4 ? 4 : 2) /* accumulator sets of the weighted values: key pair j goes to set j % SETS */

static inline __m512 exp_ps(__m512 x) {
    /* e^x for x <= 0 (clamped at -87): 2^n * P(r), r = x - n ln 2, |r| <= ln2/2, P of degree 7 (Taylor). */
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 rows of 16 dwords -> their transpose, in place. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* A value's dims as the accumulators hold them: unpacking two keys' 32 bf16 puts dim 8L+i (L the 128-bit lane,
   i < 4) in lane 4L+i of the low half and dim 8L+4+i in lane 4L+i of the high half. */
static inline int64_t lane_dim(int64_t lane) {
    int64_t chunk = lane / 32, half = (lane % 32) / 16, l = (lane % 16) / 4, i = lane % 4;
    return chunk * 32 + 8 * l + 4 * half + i;
}

int se_transpose_check(const uint32_t *in, uint32_t *out) { /* for the tests: out = in^T (16 x 16 dwords) */
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(in + 16 * i);
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(out + 16 * i, r[i]);
    return 0;
}

/* A thread's scratch memory of at least `size` bytes, 64-aligned, grown as needed and kept (NULL if none). */
static __thread void *partial_buf, *kt_buf, *vi_buf, *s_buf, *pb_buf;
static __thread size_t partial_cap, kt_cap, vi_cap, s_cap, pb_cap;

static void *scratch(void **buf, size_t *cap, size_t size) {
    if (size > *cap) {
        free(*buf);
        size = (size + 4095) / 4096 * 4096;
        *buf = aligned_alloc(64, size);
        *cap = *buf ? size : 0;
    }
    return *buf;
}

/* Where a block's key j lies for one row: the prefix in place, then the tail keys the row sees, in its order. */
typedef struct {
    const uint16_t *k, *v;      /* the (batch, head)'s keys and values */
    int64_t k_st, v_st, start, n, first; /* row strides, the block's first key and its count, the tail's first key */
    const int32_t *order;       /* NULL: the tail in place (every key of the block as it lies) */
    int32_t count;              /* tail keys the row sees */
} block_keys;

static inline const uint16_t *block_key(const block_keys *b, int64_t j, int which) {
    int64_t at = b->start + j;
    if (j >= b->n) return NULL;
    if (b->order && at >= b->first) {
        if (at - b->first >= b->count) return NULL;
        at = b->first + b->order[at - b->first];
    }
    return which ? b->v + at * b->v_st : b->k + at * b->k_st;
}

/* Block keys [from, to) (block-relative) as the kernel reads them: key j's row is at key(j) (NULL: a zero key) ->
   kt[p * BLOCK + j], dword p (dims 2p, 2p+1) of key j, whole vectors of 16 keys from the one holding `from`; values
   -> vi[pair * VECS + x], keys 2j and 2j+1 interleaved, low and high halves per 32 dims, whole pairs likewise. */
static void lay_out(uint32_t *kt, __m512i *vi, int64_t from, int64_t to, const block_keys *at) {
    for (int64_t g = from / 16; g < (to + 15) / 16; g++) {
        for (int64_t c = 0; c < HEAD_DIM / 32; c++) {
            __m512i rows[16];
            for (int j = 0; j < 16; j++) {
                const uint16_t *row = block_key(at, 16 * g + j, 0);
                rows[j] = row ? _mm512_loadu_si512(row + 32 * c) : _mm512_setzero_si512();
            }
            transpose16(rows);
            for (int p = 0; p < 16; p++) _mm512_store_si512(kt + (16 * c + p) * BLOCK + 16 * g, rows[p]);
        }
    }
    for (int64_t j = from / 2; j < (to + 1) / 2; j++) {
        const uint16_t *a = block_key(at, 2 * j, 1), *z = block_key(at, 2 * j + 1, 1);
        for (int64_t c = 0; c < HEAD_DIM / 32; c++) {
            __m512i lo = a ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
            __m512i hi = z ? _mm512_loadu_si512(z + 32 * c) : _mm512_setzero_si512();
            vi[j * VECS + 2 * c] = _mm512_unpacklo_epi16(lo, hi);
            vi[j * VECS + 2 * c + 1] = _mm512_unpackhi_epi16(lo, hi);
        }
    }
}

/* q: (B, H, R, D) bf16; k, v: (B, H, T, D) bf16 with strides in elements (rows contiguous); order: (R, tail) int32,
   row r's i-th tail key (0 = key T - tail) for i < count[r], ascending; out: (B, H, R, D) fp32, contiguous;
   D = HEAD_DIM. Returns 0, or -1 when scratch memory could not be had. */
int se_bf16_attention(const uint16_t *q, int64_t q_sb, int64_t q_sh, int64_t q_sr,
                      const uint16_t *k, int64_t k_sb, int64_t k_sh, int64_t k_st,
                      const uint16_t *v, int64_t v_sb, int64_t v_sh, int64_t v_st,
                      const int32_t *order, const int32_t *count, int64_t tail, float *out,
                      int64_t B, int64_t H, int64_t R, int64_t T) {
    const int64_t D = HEAD_DIM;
    const int64_t blocks = (T + BLOCK - 1) / BLOCK, items = B * H * blocks, pairs = D / 2;
    const int64_t part = 2 + D; /* per (item, row): max, sum, D weighted values (in lane order) */
    float *partial = scratch(&partial_buf, &partial_cap, sizeof(float) * items * R * part);
    if (!partial) return -1;
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: the block's keys as dword columns, its values as interleaved key pairs, a row's scores and
           probabilities; kept for the thread's life (fresh pages on every call cost more than the work) */
        uint32_t *kt = scratch(&kt_buf, &kt_cap, sizeof(uint32_t) * (HEAD_DIM / 2) * BLOCK);
        __m512i *vi = scratch(&vi_buf, &vi_cap, sizeof(__m512i) * (BLOCK / 2) * (VECS));
        float *s = scratch(&s_buf, &s_cap, sizeof(float) * BLOCK);
        uint16_t *pb = scratch(&pb_buf, &pb_cap, sizeof(uint16_t) * BLOCK);
        if (!kt || !vi || !s || !pb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;
            const int64_t bh = item / blocks, blk = item % blocks, b = bh / H, h = bh % H;
            const int64_t start = blk * BLOCK, n = (T - start < BLOCK ? T - start : BLOCK);
            const int64_t groups = (n + 63) / 64 * 4; /* vectors of 16 keys, a multiple of 4 (zero keys past n) */
            const uint16_t *kb = k + b * k_sb + h * k_sh, *vb = v + b * v_sb + h * v_sh;
            const int64_t first = T - tail; /* the tail's first key */
            block_keys in_place = {kb, vb, k_st, v_st, start, n, first, NULL, 0};
            lay_out(kt, vi, 0, 16 * groups, &in_place); /* zero keys past n */
            /* rows that see the tail in place (a chain, the autoregressive step) first, over the block as laid out;
               then each row that sees it otherwise (a tree node), over the block with its own tail keys in its own
               places: the layout of every key from the tail's first on is made again for it */
            const int64_t own = first > start ? first - start : 0;
            for (int pass = 0; pass < 2; pass++)  /* 0: rows in place; 1: the others */
            for (int64_t r = 0; r < R; r++) {
                const int32_t *ro = order + r * tail;
                int in_order = 1;
                for (int64_t i = 0; i < count[r]; i++) in_order &= ro[i] == i;
                if (in_order == pass) continue;
                if (pass && start + n > first) {
                    block_keys mine = {kb, vb, k_st, v_st, start, n, first, ro, count[r]};
                    lay_out(kt, vi, own, n, &mine);
                }
                const uint32_t *qp = (const uint32_t *)(q + b * q_sb + h * q_sh + r * q_sr);
                /* scores, 16 keys a vector, four vectors at a time; two accumulators per vector (even and odd dim
                   pairs), each summed in dim order */
                for (int64_t g = 0; g < groups; g += 4) {
                    __m512 a[4][2];
                    for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
                    for (int64_t p = 0; p < pairs; p += 2) {
                        const __m512bh even = (__m512bh)_mm512_set1_epi32((int)qp[p]);
                        const __m512bh odd = (__m512bh)_mm512_set1_epi32((int)qp[p + 1]);
                        for (int u = 0; u < 4; u++) {
                            a[u][0] = _mm512_dpbf16_ps(a[u][0], even,
                                                       (__m512bh)_mm512_load_si512(kt + p * BLOCK + 16 * (g + u)));
                            a[u][1] = _mm512_dpbf16_ps(a[u][1], odd,
                                                       (__m512bh)_mm512_load_si512(kt + (p + 1) * BLOCK + 16 * (g + u)));
                        }
                    }
                    for (int u = 0; u < 4; u++) _mm512_store_ps(s + 16 * (g + u), _mm512_add_ps(a[u][0], a[u][1]));
                }
                /* keys this row does not see: past n, and past the tail keys it sees */
                const int64_t lim = first + count[r] - start < n ? first + count[r] - start : n;
                for (int64_t j = lim > 0 ? lim : 0; j < 16 * groups; j++) s[j] = -INFINITY;
                __m512 mv = _mm512_set1_ps(-INFINITY);
                for (int64_t g = 0; g < groups; g++) mv = _mm512_max_ps(mv, _mm512_load_ps(s + 16 * g));
                const float m = _mm512_reduce_max_ps(mv);
                float *pr = partial + (item * R + r) * part;
                pr[0] = m;
                if (m == -INFINITY) { /* the row sees no key here */
                    pr[1] = 0.0f;
                    continue;
                }
                __m512 lv = _mm512_setzero_ps();
                const __m512 mm = _mm512_set1_ps(m);
                for (int64_t g = 0; g < groups; g++) {
                    __m512 x = _mm512_load_ps(s + 16 * g);
                    __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    __m512 e = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(x, mm)));
                    lv = _mm512_add_ps(lv, e);
                    _mm256_store_si256((__m256i *)(pb + 16 * g), (__m256i)_mm512_cvtneps_pbh(e));
                }
                pr[1] = _mm512_reduce_add_ps(lv);
                /* weighted values: key pair j into accumulator set j % SETS, each set summed in key order */
                __m512 acc[SETS][VECS];
                for (int u = 0; u < SETS; u++)
                    for (int x = 0; x < VECS; x++) acc[u][x] = _mm512_setzero_ps();
                const uint32_t *pp = (const uint32_t *)pb;
                const int64_t npairs = (n + 1) / 2;
                for (int64_t j = 0; j < npairs; j += SETS) {
                    for (int u = 0; u < SETS; u++) {
                        const uint32_t w = j + u < npairs ? pp[j + u] : 0;
                        if (!w) continue; /* both keys unseen or weightless: adds nothing */
                        const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)w);
                        for (int x = 0; x < VECS; x++)
                            acc[u][x] = _mm512_dpbf16_ps(acc[u][x], wb, (__m512bh)vi[(j + u) * VECS + x]);
                    }
                }
                for (int x = 0; x < VECS; x++) {
                    __m512 sum = acc[0][x];
                    for (int u = 1; u < SETS; u++) sum = _mm512_add_ps(sum, acc[u][x]);
                    _mm512_storeu_ps(pr + 2 + 16 * x, sum);
                }
            }
        }
        /* merge the blocks of each (batch, head, row) in order */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < B * H * R; row++) {
            if (failed) continue;
            const int64_t bh = row / R, r = row % R;
            float top = -INFINITY;
            for (int64_t blk = 0; blk < blocks; blk++) {
                float m = partial[((bh * blocks + blk) * R + r) * part];
                if (m > top) top = m;
            }
            float total = 0.0f, o[HEAD_DIM];
            for (int64_t x = 0; x < D; x++) o[x] = 0.0f;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const float *pr = partial + ((bh * blocks + blk) * R + r) * part;
                if (pr[0] == -INFINITY) continue;
                const float w = expf(pr[0] - top);
                total += w * pr[1];
                for (int64_t x = 0; x < D; x++) o[x] += w * pr[2 + x];
            }
            float *dst = out + row * D;
            for (int64_t x = 0; x < D; x++) dst[lane_dim(x)] = o[x] / total;
        }
    }
    return failed ? -1 : 0;
}
