/* nccl_ref: NCCL in its best configuration, one process per GPU, as the reference our collectives
 * are compared with in the same run (allreduce, all_gather, reduce_scatter, broadcast, alltoall).
 *
 *   nccl_ref --rank R --nranks N --id-file PATH [options]      (one process per rank)
 *   nccl_ref --self-test [--nranks N]                           (host code only, no CUDA call)
 *   nccl_ref --dry-run [options]                                (prints the plan, no CUDA call)
 *
 * C, CUDA runtime API and NCCL only, no kernels: plain gcc builds it (bench/scripts/nccl_ref.sh
 * builds and launches it on the GPU machine). For each collective, size and buffer kind (plain
 * cudaMalloc buffers; symmetric windows: ncclMemAlloc + ncclCommWindowRegister(...,
 * NCCL_WIN_COLL_SYMMETRIC), registered before capture) it
 *   1. uploads deterministic random data (each rank can compute every rank's data, so each
 *      checks its own output against a host reference: a reduction is summed in f32 in rank
 *      order and rounded once to the data type; copies must match bit for bit),
 *   2. checks one eager call,
 *   3. "pipelined": K calls captured into one CUDA graph, replayed R times between two events,
 *      time per call = elapsed / (K*R), max over ranks; the output is checked again afterwards,
 *   4. "single": a graph of one call with event-record nodes around it, launched right after a
 *      host barrier between the processes, S times; median per rank, max over ranks.
 * alltoall: ncclAlltoAll (NCCL 2.28 and later, looked up at run time) with count = bytes / N / size
 * elements per peer; with an older NCCL the same exchange as grouped ncclSend/ncclRecv (what
 * nccl-tests' alltoall does), said in a `#` line and in the RESULT's "algorithm" field.
 * Rank 0 prints one `RESULT {json}` line per measurement, `CHECK {json}` lines with the errors,
 * and a summary table last. NVLink multicast stays off: NCCL_NVLS_ENABLE must be 0 (set to 0
 * when unset; the program refuses any other value).
 *
 * Rank 0 creates the ncclUniqueId and writes it, together with a small shared area (a
 * sense-reversing barrier and exchange slots, mapped by every rank), to a temporary file that it
 * renames to --id-file; the other ranks poll for it. Every wait is bounded (--wait-s). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef NCCL_REF_HOST_ONLY
#include <cuda_runtime.h>
#include <nccl.h>
#endif

#define MAXR 64
#define MAXT 64
#define MAX_SIZES 64

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                    */

enum { AR = 0, AG = 1, RS = 2, BC = 3, A2A = 4, NCOLL = 5 };
static const char *const coll_name[NCOLL] = {"allreduce", "all_gather", "reduce_scatter", "broadcast", "alltoall"};
/* `all` and the default: the four collectives of bench-hw allreduce / collectives (alltoall is
 * asked for by name: bench-hw alltoall) */
#define COLLS_ALL ((1u << A2A) - 1)
enum { BF16 = 0, F32 = 1 };
static const char *const dtype_name[2] = {"bf16", "f32"};
enum { PLAIN = 0, SYMM = 1, NKIND = 2 };
static const char *const kind_impl[NKIND] __attribute__((unused)) = {"nccl-plain", "nccl-symmetric"};
enum { PIPE = 0, SINGLE = 1, NMODE = 2 };
static const char *const mode_name[NMODE] __attribute__((unused)) = {"pipelined", "single"};

struct opts {
    int rank, nranks, device;
    const char *id_file, *token;
    unsigned colls;  /* bit per collective */
    int dtype;
    size_t min_bytes, max_bytes;
    size_t sizes[MAX_SIZES];
    int nsizes;      /* 0: min..max, x2 steps */
    unsigned kinds;  /* bit per buffer kind */
    unsigned modes;  /* bit per mode */
    int iters, warmup, graph_calls, single_reps; /* 0 = chosen per size */
    double wait_s;
    uint64_t seed;
    int threads;
    int self_test, dry_run;
};

static struct opts O;

static void usage(FILE *f) {
    fprintf(f,
        "usage: nccl_ref --rank R --nranks N --id-file PATH [options]\n"
        "       nccl_ref --self-test [--nranks N]      host code paths only, no CUDA\n"
        "       nccl_ref --dry-run [options]           print the plan, no CUDA\n"
        "options:\n"
        "  --coll allreduce|all_gather|reduce_scatter|broadcast|alltoall|all\n"
        "                                    (comma list; default all = the first four)\n"
        "  --dtype bf16|f32                  (default bf16)\n"
        "  --min-bytes B --max-bytes B       sizes B, 2B, 4B ... (default 1024 .. 1073741824)\n"
        "  --sizes a,b,c                     explicit sizes (suffixes K, M, G = KiB, MiB, GiB)\n"
        "  --buffers plain|symmetric|both    (default both)\n"
        "  --mode pipelined|single|both      (default both)\n"
        "  --graph-calls K                   calls captured per graph (default: by size, 2..100)\n"
        "  --iters R                         timed graph replays (default: by size, 3..100)\n"
        "  --warmup W                        untimed graph replays first (default: by size)\n"
        "  --single-reps S                   single-call repetitions (default: by size)\n"
        "  --device D                        CUDA device (default: rank %% visible devices)\n"
        "  --wait-s T                        bound of every wait (default 120)\n"
        "  --seed X                          data seed (default 1234)\n"
        "  --threads T                       host threads for data and checks\n"
        "  --token STR                       run token (the launcher's; guards against stale id files)\n"
        "bytes = the whole reduced / gathered / scattered buffer, as nccl-tests counts them\n"
        "(alltoall: one rank's whole send buffer of N parts; busbw = algbw x (N-1)/N).\n");
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------------------ */
/* Failure: message, mark the shared area failed (peers stop waiting), abort NCCL, exit.       */

struct shared {
    uint64_t magic;
    int32_t nranks;
    int32_t version;
    char token[64];
    unsigned char id[128];  /* ncclUniqueId */
    int32_t count;          /* barrier arrivals */
    int32_t sense;          /* barrier sense */
    int32_t failed;         /* 1 + failing rank, or 0 */
    int32_t pad;
    double slot[2][MAXR];   /* exchange slots, by parity */
    int32_t phase[MAXR];    /* self-test */
};
#define SHM_MAGIC 0x6e63636c5f726566ULL /* "nccl_ref" */

static struct shared *sh;
static int in_die;
static void (*abort_hook)(void);

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "nccl_ref rank %d: ERROR: ", O.rank);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    if (sh) {
        int32_t zero = 0;
        __atomic_compare_exchange_n(&sh->failed, &zero, O.rank + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    if (!in_die) {
        in_die = 1;
        if (abort_hook) abort_hook();
    }
    exit(1);
}

static void peer_failed_check(const char *what) {
    int32_t f = sh ? __atomic_load_n(&sh->failed, __ATOMIC_ACQUIRE) : 0;
    if (f && f != O.rank + 1) die("rank %d failed; giving up while %s", f - 1, what);
}

/* ------------------------------------------------------------------------------------------ */
/* Argument parsing                                                                           */

static int parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    unsigned long long m = 1;
    if (*end == 'K' || *end == 'k') m = 1ULL << 10, end++;
    else if (*end == 'M' || *end == 'm') m = 1ULL << 20, end++;
    else if (*end == 'G' || *end == 'g') m = 1ULL << 30, end++;
    if (*end == 'i' && end[1] == 'B') end += 2;
    else if (*end == 'B' && m > 1) end++;
    if (*end) return -1;
    if (v == 0 || v > (1ULL << 40) / m) return -1;
    *out = (size_t)(v * m);
    return 0;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static int parse_colls(const char *s, unsigned *out) {
    unsigned m = 0;
    char buf[256];
    if (strlen(s) >= sizeof buf) return -1;
    strcpy(buf, s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int found = 0;
        if (!strcmp(t, "all")) m |= COLLS_ALL, found = 1;
        for (int c = 0; c < NCOLL; c++)
            if (!strcmp(t, coll_name[c])) m |= 1u << c, found = 1;
        /* nccl-tests spellings too */
        if (!strcmp(t, "all_reduce")) m |= 1u << AR, found = 1;
        if (!strcmp(t, "allgather")) m |= 1u << AG, found = 1;
        if (!strcmp(t, "reducescatter")) m |= 1u << RS, found = 1;
        if (!strcmp(t, "bcast")) m |= 1u << BC, found = 1;
        if (!strcmp(t, "all_to_all")) m |= 1u << A2A, found = 1;
        if (!found) return -1;
    }
    if (!m) return -1;
    *out = m;
    return 0;
}

/* Returns 0, or -1 after printing what is wrong. */
static int parse_args(int argc, char **argv, struct opts *o) {
    memset(o, 0, sizeof *o);
    o->rank = -1;
    o->nranks = -1;
    o->device = -1;
    o->token = "";
    o->colls = COLLS_ALL;
    o->dtype = BF16;
    o->min_bytes = 1024;
    o->max_bytes = 1ULL << 30;
    o->kinds = (1u << NKIND) - 1;
    o->modes = (1u << NMODE) - 1;
    o->wait_s = 120;
    o->seed = 1234;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        char name[64];
        const char *eq = strchr(a, '=');
        if (strncmp(a, "--", 2)) {
            fprintf(stderr, "nccl_ref: unexpected argument `%s`\n", a);
            return -1;
        }
        if (eq) {
            size_t n = (size_t)(eq - a);
            if (n >= sizeof name) n = sizeof name - 1;
            memcpy(name, a, n);
            name[n] = 0;
            v = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a);
        }
#define FLAG(s) (!strcmp(name, s))
#define VALUE()                                                                    \
    do {                                                                           \
        if (!v) {                                                                  \
            if (i + 1 >= argc) {                                                   \
                fprintf(stderr, "nccl_ref: %s needs a value\n", name);             \
                return -1;                                                         \
            }                                                                      \
            v = argv[++i];                                                         \
        }                                                                          \
    } while (0)
#define BAD()                                                                      \
    do {                                                                           \
        fprintf(stderr, "nccl_ref: bad value `%s` for %s\n", v, name);             \
        return -1;                                                                 \
    } while (0)
        if (FLAG("--help") || FLAG("-h")) {
            usage(stdout);
            exit(0);
        } else if (FLAG("--self-test")) {
            o->self_test = 1;
        } else if (FLAG("--dry-run")) {
            o->dry_run = 1;
        } else if (FLAG("--rank")) {
            VALUE();
            if (parse_int(v, 0, MAXR - 1, &o->rank)) BAD();
        } else if (FLAG("--nranks")) {
            VALUE();
            if (parse_int(v, 1, MAXR, &o->nranks)) BAD();
        } else if (FLAG("--device")) {
            VALUE();
            if (parse_int(v, 0, 1023, &o->device)) BAD();
        } else if (FLAG("--id-file")) {
            VALUE();
            o->id_file = v;
        } else if (FLAG("--token")) {
            VALUE();
            if (strlen(v) >= sizeof(((struct shared *)0)->token)) BAD();
            o->token = v;
        } else if (FLAG("--coll")) {
            VALUE();
            if (parse_colls(v, &o->colls)) BAD();
        } else if (FLAG("--dtype")) {
            VALUE();
            if (!strcmp(v, "bf16")) o->dtype = BF16;
            else if (!strcmp(v, "f32")) o->dtype = F32;
            else BAD();
        } else if (FLAG("--min-bytes")) {
            VALUE();
            if (parse_size(v, &o->min_bytes)) BAD();
        } else if (FLAG("--max-bytes")) {
            VALUE();
            if (parse_size(v, &o->max_bytes)) BAD();
        } else if (FLAG("--sizes")) {
            VALUE();
            char buf[1024];
            if (strlen(v) >= sizeof buf) BAD();
            strcpy(buf, v);
            o->nsizes = 0;
            for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (o->nsizes >= MAX_SIZES || parse_size(t, &o->sizes[o->nsizes])) BAD();
                o->nsizes++;
            }
            if (!o->nsizes) BAD();
        } else if (FLAG("--buffers")) {
            VALUE();
            if (!strcmp(v, "plain")) o->kinds = 1u << PLAIN;
            else if (!strcmp(v, "symmetric")) o->kinds = 1u << SYMM;
            else if (!strcmp(v, "both")) o->kinds = 3;
            else BAD();
        } else if (FLAG("--mode")) {
            VALUE();
            if (!strcmp(v, "pipelined")) o->modes = 1u << PIPE;
            else if (!strcmp(v, "single")) o->modes = 1u << SINGLE;
            else if (!strcmp(v, "both")) o->modes = 3;
            else BAD();
        } else if (FLAG("--iters")) {
            VALUE();
            if (parse_int(v, 1, 1000000, &o->iters)) BAD();
        } else if (FLAG("--warmup")) {
            VALUE();
            if (parse_int(v, 0, 1000000, &o->warmup)) BAD();
            if (!o->warmup) o->warmup = -1; /* explicit 0 */
        } else if (FLAG("--graph-calls")) {
            VALUE();
            if (parse_int(v, 1, 10000, &o->graph_calls)) BAD();
        } else if (FLAG("--single-reps")) {
            VALUE();
            if (parse_int(v, 1, 1000000, &o->single_reps)) BAD();
        } else if (FLAG("--wait-s")) {
            VALUE();
            char *end;
            o->wait_s = strtod(v, &end);
            if (*end || !(o->wait_s > 0 && o->wait_s < 1e6)) BAD();
        } else if (FLAG("--seed")) {
            VALUE();
            char *end;
            errno = 0;
            o->seed = strtoull(v, &end, 0);
            if (errno || *end || end == v) BAD();
        } else if (FLAG("--threads")) {
            VALUE();
            if (parse_int(v, 1, MAXT, &o->threads)) BAD();
        } else {
            fprintf(stderr, "nccl_ref: unknown option `%s` (--help)\n", a);
            return -1;
        }
#undef FLAG
#undef VALUE
#undef BAD
    }
    if (o->nsizes == 0) {
        if (o->min_bytes > o->max_bytes) {
            fprintf(stderr, "nccl_ref: --min-bytes %zu > --max-bytes %zu\n", o->min_bytes, o->max_bytes);
            return -1;
        }
        for (size_t b = o->min_bytes; b <= o->max_bytes; b *= 2) {
            if (o->nsizes >= MAX_SIZES) {
                fprintf(stderr, "nccl_ref: more than %d sizes\n", MAX_SIZES);
                return -1;
            }
            o->sizes[o->nsizes++] = b;
        }
    }
    if (o->self_test) {
        if (o->nranks < 0) o->nranks = 2;
        if (o->rank < 0) o->rank = 0;
        return 0;
    }
    if (o->dry_run) {
        if (o->nranks < 0) o->nranks = 2;
        if (o->rank < 0) o->rank = 0;
    }
    if (o->nranks < 1 || o->rank < 0 || o->rank >= o->nranks) {
        fprintf(stderr, "nccl_ref: need --rank R --nranks N with 0 <= R < N <= %d\n", MAXR);
        return -1;
    }
    if (!o->dry_run && !o->id_file) {
        fprintf(stderr, "nccl_ref: need --id-file PATH\n");
        return -1;
    }
    if (!o->threads) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        long t = n > 0 ? n / o->nranks : 1;
        o->threads = (int)(t < 1 ? 1 : t > 16 ? 16 : t);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Data: bf16 rounding, deterministic values, the host reference and the check               */

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN). */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }
static inline float round_dtype(int dtype, float f) { return dtype == BF16 ? bf16_to_f32(bf16_from_f32(f)) : f; }
static inline size_t esize(int dtype) { return dtype == BF16 ? 2 : 4; }

static inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* Element i of the data with key `key`: sign random, magnitude in [1/16, 16), mantissa random;
 * every value is exact in its type and nonzero (so the error scale below is never 0). One hash
 * gives a group of 4 bf16 or 2 f32 values; these are element i's raw bits from its group's hash. */
static inline uint32_t bits_from_hash(int dtype, uint64_t h, size_t i) {
    if (dtype == BF16) {
        uint16_t b = (uint16_t)(h >> (16 * (i & 3)));
        return (b & 0x8000u) | ((123u + ((b >> 7) & 7u)) << 7) | (b & 0x7fu);
    }
    uint32_t b = (uint32_t)(h >> (32 * (i & 1)));
    return (b & 0x80000000u) | ((123u + ((b >> 23) & 7u)) << 23) | (b & 0x7fffffu);
}
static inline float float_from_bits(int dtype, uint32_t b) { return dtype == BF16 ? bf16_to_f32((uint16_t)b) : u2f(b); }

static inline uint16_t val_bf16_bits(uint64_t key, size_t i) { return (uint16_t)bits_from_hash(BF16, mix64(key + (uint64_t)(i >> 2)), i); }
static inline uint32_t val_f32_bits(uint64_t key, size_t i) { return bits_from_hash(F32, mix64(key + (uint64_t)(i >> 1)), i); }
static inline float val(int dtype, uint64_t key, size_t i) {
    return dtype == BF16 ? bf16_to_f32(val_bf16_bits(key, i)) : u2f(val_f32_bits(key, i));
}
static inline float load_elem(int dtype, const void *p, size_t j) {
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[j]);
    return ((const float *)p)[j];
}

/* What one rank sends and receives for one collective at one size. */
struct case_desc {
    int coll, dtype, nranks, rank;
    size_t count;        /* elements of the whole buffer ("bytes" / element size) */
    size_t send_count;   /* this rank's send elements */
    size_t recv_count;   /* this rank's receive elements */
    uint64_t key[MAXR];  /* data key of each rank */
};

static void case_init(struct case_desc *c, int coll, int dtype, int nranks, int rank, size_t bytes, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->coll = coll;
    c->dtype = dtype;
    c->nranks = nranks;
    c->rank = rank;
    size_t n = bytes / esize(dtype);
    if (coll == AG || coll == RS || coll == A2A) n = n / (size_t)nranks * (size_t)nranks;
    c->count = n;
    c->send_count = coll == AG ? n / (size_t)nranks : n;
    c->recv_count = coll == RS ? n / (size_t)nranks : n;
    uint64_t base = mix64(seed ^ mix64(((uint64_t)coll + 1) * 0x100000001b3ULL) ^ mix64((uint64_t)bytes * 31 + (uint64_t)dtype));
    for (int r = 0; r < nranks; r++) c->key[r] = mix64(base + (uint64_t)r * 0x632be59bd9b4e019ULL);
}
static size_t case_bytes(const struct case_desc *c) { return c->count * esize(c->dtype); }

static int is_reduction(int coll) { return coll == AR || coll == RS; }

/* Relative error allowed against the host reference. The error of a sum is measured against
 * the sum of the magnitudes (so cancellation does not blow it up); NCCL may add in another
 * order and round partial sums to the type: at most N-1 roundings (unit roundoff 2^-8 for bf16,
 * 2^-24 for f32, each against at most that sum of magnitudes) plus ours. */
static double tolerance(const struct case_desc *c) {
    if (!is_reduction(c->coll)) return 0.0;
    double n = (double)c->nranks;
    return c->dtype == BF16 ? fmax(1e-2, n * ldexp(1, -8)) : fmax(1e-5, n * ldexp(1, -24));
}

/* Reference of this rank's output element j, and the scale its error is measured against. */
static inline float ref_elem(const struct case_desc *c, size_t j, float *scale) {
    size_t idx;
    switch (c->coll) {
    case AG: {
        size_t sc = c->count / (size_t)c->nranks;
        float v = val(c->dtype, c->key[j / sc], j % sc);
        *scale = fabsf(v);
        return v;
    }
    case BC: {
        float v = val(c->dtype, c->key[0], j);
        *scale = fabsf(v);
        return v;
    }
    case A2A: { /* part q of this rank's output = part `rank` of rank q's input */
        size_t sc = c->count / (size_t)c->nranks;
        float v = val(c->dtype, c->key[j / sc], (size_t)c->rank * sc + j % sc);
        *scale = fabsf(v);
        return v;
    }
    case RS:
        idx = (size_t)c->rank * (c->count / (size_t)c->nranks) + j;
        break;
    default:
        idx = j;
    }
    float s = 0, a = 0;
    for (int q = 0; q < c->nranks; q++) {
        float v = val(c->dtype, c->key[q], idx);
        s += v;
        a += fabsf(v);
    }
    *scale = a;
    return round_dtype(c->dtype, s);
}

/* This rank's send data. */
static void fill_send_range(const struct case_desc *c, void *dst, size_t lo, size_t hi) {
    uint64_t key = c->key[c->rank];
    int sh_ = c->dtype == BF16 ? 2 : 1;
    for (size_t i = lo; i < hi;) {
        uint64_t h = mix64(key + (uint64_t)(i >> sh_));
        size_t end = ((i >> sh_) + 1) << sh_;
        if (end > hi) end = hi;
        for (; i < end; i++) {
            uint32_t b = bits_from_hash(c->dtype, h, i);
            if (c->dtype == BF16) ((uint16_t *)dst)[i] = (uint16_t)b;
            else ((uint32_t *)dst)[i] = b;
        }
    }
}

/* Copies: out[lo, hi) must hold rank q's elements idx0, idx0 + 1, ... bit for bit. */
static double check_copy(const struct case_desc *c, const void *out, size_t lo, size_t hi, int q, size_t idx0, double m, size_t *worst) {
    int dt = c->dtype, sh_ = dt == BF16 ? 2 : 1;
    size_t idx = idx0;
    for (size_t j = lo; j < hi;) {
        size_t g = idx >> sh_;
        uint64_t h = mix64(c->key[q] + (uint64_t)g);
        size_t end = j + (((g + 1) << sh_) - idx);
        if (end > hi) end = hi;
        for (; j < end; j++, idx++) {
            uint32_t r = bits_from_hash(dt, h, idx);
            uint32_t o = dt == BF16 ? ((const uint16_t *)out)[j] : ((const uint32_t *)out)[j];
            if (o != r) {
                float fo = float_from_bits(dt, o), fr = float_from_bits(dt, r);
                double e = isfinite(fo) ? fabs((double)fo - (double)fr) / fabs((double)fr) : INFINITY;
                if (e == 0) e = INFINITY; /* -0 against 0 and the like */
                if (e > m) m = e, *worst = j;
            }
        }
    }
    return m;
}

/* The largest error of out[lo, hi) (INFINITY for a NaN, or for a copy that differs in its
 * bits); ref_elem's arithmetic, one hash per rank and group of elements. */
static double check_range(const struct case_desc *c, const void *out, size_t lo, size_t hi, size_t *worst) {
    double m = 0;
    int dt = c->dtype, n = c->nranks, sh_ = dt == BF16 ? 2 : 1;
    if (c->coll == BC) return check_copy(c, out, lo, hi, 0, lo, 0, worst);
    if (c->coll == AG || c->coll == A2A) {
        size_t sc = c->count / (size_t)n, at = c->coll == A2A ? (size_t)c->rank * sc : 0;
        for (size_t j = lo; j < hi;) {
            int q = (int)(j / sc);
            size_t end = (size_t)(q + 1) * sc < hi ? (size_t)(q + 1) * sc : hi;
            m = check_copy(c, out, j, end, q, at + j - (size_t)q * sc, m, worst);
            j = end;
        }
        return m;
    }
    size_t base = c->coll == RS ? (size_t)c->rank * (c->count / (size_t)n) : 0;
    uint64_t h[MAXR];
    for (size_t j = lo; j < hi;) {
        size_t idx = base + j, g = idx >> sh_;
        for (int q = 0; q < n; q++) h[q] = mix64(c->key[q] + (uint64_t)g);
        size_t end = ((g + 1) << sh_) - base;
        if (end > hi) end = hi;
        for (; j < end; j++, idx++) {
            float s = 0, a = 0;
            for (int q = 0; q < n; q++) {
                float v = float_from_bits(dt, bits_from_hash(dt, h[q], idx));
                s += v;
                a += fabsf(v);
            }
            float r = round_dtype(dt, s), o = load_elem(dt, out, j);
            double d = fabs((double)o - (double)r);
            if (!(d <= m * (double)a)) { /* a new largest error, or NaN */
                m = isfinite(o) ? d / (double)a : INFINITY;
                *worst = j;
            }
        }
    }
    return m;
}

/* Simple parallel for over [0, n) with O.threads threads. */
struct par_arg {
    void (*fn)(void *ctx, size_t lo, size_t hi, int t);
    void *ctx;
    size_t lo, hi;
    int t;
};
static void *par_thread(void *p) {
    struct par_arg *a = p;
    a->fn(a->ctx, a->lo, a->hi, a->t);
    return NULL;
}
static void par_for(size_t n, void (*fn)(void *, size_t, size_t, int), void *ctx) {
    int nt = O.threads < 1 ? 1 : O.threads > MAXT ? MAXT : O.threads;
    if (n < (1u << 18) || nt == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_t th[MAXT];
    struct par_arg a[MAXT];
    size_t per = (n + (size_t)nt - 1) / (size_t)nt;
    int started = 0;
    for (int t = 0; t < nt; t++) {
        size_t lo = (size_t)t * per, hi = lo + per > n ? n : lo + per;
        a[t] = (struct par_arg){fn, ctx, lo < n ? lo : n, hi, t};
        if (t == 0) continue;
        if (pthread_create(&th[t], NULL, par_thread, &a[t])) break;
        started = t;
    }
    fn(ctx, a[0].lo, a[0].hi, 0);
    for (int t = 1; t <= started; t++) pthread_join(th[t], NULL);
    for (int t = started + 1; t < nt; t++) fn(ctx, a[t].lo, a[t].hi, t); /* threads that did not start */
}

struct fill_ctx {
    const struct case_desc *c;
    void *dst;
};
static void fill_job(void *p, size_t lo, size_t hi, int t) {
    (void)t;
    struct fill_ctx *f = p;
    fill_send_range(f->c, f->dst, lo, hi);
}
static void fill_send(const struct case_desc *c, void *dst) {
    struct fill_ctx f = {c, dst};
    par_for(c->send_count, fill_job, &f);
}

struct check_ctx {
    const struct case_desc *c;
    const void *out;
    double err[MAXT];
    size_t worst[MAXT];
};
static void check_job(void *p, size_t lo, size_t hi, int t) {
    struct check_ctx *k = p;
    k->err[t] = check_range(k->c, k->out, lo, hi, &k->worst[t]);
}
/* Largest relative error of this rank's output; *worst = its element. */
static double check_output(const struct case_desc *c, const void *out, size_t *worst) {
    struct check_ctx *k = calloc(1, sizeof *k);
    if (!k) die("out of host memory");
    k->c = c;
    k->out = out;
    par_for(c->recv_count, check_job, k);
    double m = 0;
    *worst = 0;
    for (int t = 0; t < MAXT; t++)
        if (k->err[t] > m) m = k->err[t], *worst = k->worst[t];
    free(k);
    return m;
}

/* ------------------------------------------------------------------------------------------ */
/* Shared area: id file, barrier, exchange                                                    */

static void spin_pause(unsigned long spins) {
    if (spins < 20000) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else if (spins < 200000) {
        sched_yield();
    } else {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
}

/* Rank 0 creates the file (temporary name, then rename); the others wait for it. `id` is
 * rank 0's ncclUniqueId (128 bytes) or NULL. */
static void shared_open(const unsigned char *id) {
    const char *path = O.id_file;
    size_t sz = sizeof(struct shared);
    if (O.rank == 0) {
        char tmp[4096];
        if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp) die("id file path too long");
        if (unlink(path) && errno != ENOENT) die("cannot remove stale %s: %s", path, strerror(errno));
        int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0) die("cannot create %s: %s", tmp, strerror(errno));
        if (ftruncate(fd, (off_t)sz)) die("ftruncate %s: %s", tmp, strerror(errno));
        void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) die("mmap %s: %s", tmp, strerror(errno));
        close(fd);
        struct shared *s = p;
        s->nranks = O.nranks;
        s->version = 1;
        snprintf(s->token, sizeof s->token, "%s", O.token);
        if (id) memcpy(s->id, id, sizeof s->id);
        __atomic_store_n(&s->magic, SHM_MAGIC, __ATOMIC_RELEASE);
        if (msync(p, sz, MS_SYNC)) die("msync %s: %s", tmp, strerror(errno));
        if (rename(tmp, path)) die("rename %s -> %s: %s", tmp, path, strerror(errno));
        sh = s;
        return;
    }
    double t0 = now_s();
    for (int tries = 0;; tries++) {
        int fd = open(path, O_RDWR);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && (size_t)st.st_size == sz) {
                void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                close(fd);
                if (p == MAP_FAILED) die("mmap %s: %s", path, strerror(errno));
                struct shared *s = p;
                if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC && !strncmp(s->token, O.token, sizeof s->token)) {
                    if (s->nranks != O.nranks)
                        die("%s was written for %d ranks, this rank was started with --nranks %d", path, s->nranks, O.nranks);
                    sh = s;
                    return;
                }
                munmap(p, sz); /* a stale file of another run: wait for rank 0's */
            } else {
                close(fd);
            }
        } else if (errno != ENOENT) {
            die("cannot open %s: %s", path, strerror(errno));
        }
        if (now_s() - t0 > O.wait_s)
            die("rank 0 did not write the id file %s within %.0f s (is rank 0 running, with the same --id-file%s?)",
                path, O.wait_s, *O.token ? " and --token" : "");
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static int local_sense;

/* Sense-reversing barrier over every rank; bounded by --wait-s; leaves at once when a peer
 * has failed. */
static void barrier(const char *what) {
    local_sense ^= 1;
    if (__atomic_add_fetch(&sh->count, 1, __ATOMIC_ACQ_REL) == O.nranks) {
        __atomic_store_n(&sh->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&sh->sense, local_sense, __ATOMIC_RELEASE);
        return;
    }
    double t0 = 0;
    for (unsigned long spins = 0;; spins++) {
        if (__atomic_load_n(&sh->sense, __ATOMIC_ACQUIRE) == local_sense) return;
        if ((spins & 1023) == 1023) {
            double t = now_s();
            if (t0 == 0) t0 = t;
            peer_failed_check(what);
            if (t - t0 > O.wait_s) die("barrier (%s): the other ranks did not arrive within %.0f s", what, O.wait_s);
        }
        spin_pause(spins);
    }
}

static unsigned xgen;
/* Every rank contributes v; every rank gets the largest. */
static double exchange_max(double v, const char *what) {
    int p = (int)(xgen++ & 1);
    sh->slot[p][O.rank] = v;
    barrier(what);
    double m = -INFINITY;
    for (int r = 0; r < O.nranks; r++) {
        double x = sh->slot[p][r];
        if (x > m || isnan(x)) m = isnan(x) ? INFINITY : x;
        if (isinf(m) && m > 0) break;
    }
    return m;
}

/* ------------------------------------------------------------------------------------------ */
/* Plan: calls per graph, replays, warm-up, single repetitions                                */

struct plan {
    int K, R, W, S;
};

/* A rough per-call time (µs) to size the loops: ~6 µs latency plus 300 GB/s. */
static double est_us(size_t bytes) { return 6.0 + (double)bytes / 300e3; }

static struct plan plan_for(size_t bytes) {
    struct plan p;
    double t = est_us(bytes);
    p.K = O.graph_calls ? O.graph_calls : (int)fmin(100, fmax(2, floor((double)(64u << 20) / (double)bytes)));
    p.R = O.iters ? O.iters : (int)fmin(100, fmax(3, ceil(50e3 / (t * p.K)))); /* ~50 ms timed */
    p.W = O.warmup > 0 ? O.warmup : O.warmup < 0 ? 0 : (int)fmin(5, fmax(1, p.R / 4));
    p.S = O.single_reps ? O.single_reps : t < 1000 ? 50 : 10;
    return p;
}

static void print_plan(void) {
    printf("# plan: ranks %d, dtype %s, sizes %d, buffers%s%s, modes%s%s, %d host threads\n", O.nranks,
           dtype_name[O.dtype], O.nsizes, O.kinds & 1 ? " plain" : "", O.kinds & 2 ? " symmetric" : "",
           O.modes & 1 ? " pipelined" : "", O.modes & 2 ? " single" : "", O.threads);
    printf("# %-14s %12s %12s %12s %5s %5s %4s %4s %9s\n", "coll", "bytes", "send_bytes", "recv_bytes", "K", "R", "W", "S", "est_ms");
    double total = 0;
    for (int c = 0; c < NCOLL; c++) {
        if (!(O.colls & (1u << c))) continue;
        for (int s = 0; s < O.nsizes; s++) {
            struct case_desc d;
            case_init(&d, c, O.dtype, O.nranks, O.rank, O.sizes[s], O.seed);
            if (d.send_count == 0) continue;
            struct plan p = plan_for(case_bytes(&d));
            double t = est_us(case_bytes(&d));
            double ms = ((O.modes & 1) ? (p.K * (p.R + p.W) + 1) * t : 0) + ((O.modes & 2) ? (p.S + 2) * (t + 30) : 0);
            ms = ms * __builtin_popcount(O.kinds) / 1e3;
            total += ms;
            printf("# %-14s %12zu %12zu %12zu %5d %5d %4d %4d %9.1f\n", coll_name[c], case_bytes(&d),
                   d.send_count * esize(O.dtype), d.recv_count * esize(O.dtype), p.K, p.R, p.W, p.S, ms);
        }
    }
    printf("# estimated GPU time %.1f s (without NCCL setup, data generation and checks)\n", total / 1e3);
}

/* ------------------------------------------------------------------------------------------ */
/* The GPU part                                                                               */

#ifndef NCCL_REF_HOST_ONLY

#ifndef NCCL_WIN_COLL_SYMMETRIC
#define NCCL_WIN_COLL_SYMMETRIC 0x01
#endif

static ncclComm_t g_comm;
static cudaStream_t g_stream;

static void nccl_abort_hook(void) {
    if (g_comm) {
        ncclComm_t c = g_comm;
        g_comm = NULL;
        ncclCommAbort(c);
    }
}

#define CUDACHECK(call)                                                                              \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess)                                                                       \
            die("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call, cudaGetErrorName(e_),        \
                cudaGetErrorString(e_));                                                             \
    } while (0)
#define NCCLCHECK(call)                                                                              \
    do {                                                                                             \
        ncclResult_t r_ = (call);                                                                    \
        if (r_ != ncclSuccess)                                                                       \
            die("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call, ncclGetErrorString(r_),      \
                ncclGetLastError(g_comm));                                                           \
    } while (0)

/* Watchdog for host calls that block without a bound of their own (communicator creation,
 * window registration, teardown): past the deadline, or when a peer failed, exit. */
static volatile double watch_deadline;
static const char *volatile watch_what;
static void *watchdog(void *arg) {
    (void)arg;
    for (;;) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        double d = watch_deadline;
        if (d <= 0) continue;
        int32_t f = sh ? __atomic_load_n(&sh->failed, __ATOMIC_ACQUIRE) : 0;
        if (now_s() > d || (f && f != O.rank + 1)) {
            fprintf(stderr, "nccl_ref rank %d: ERROR: %s %s; exiting\n", O.rank, watch_what ? watch_what : "?",
                    now_s() > d ? "did not finish in time (--wait-s)" : "blocked after a peer failed");
            if (sh) {
                int32_t zero = 0;
                __atomic_compare_exchange_n(&sh->failed, &zero, O.rank + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            }
            _exit(3);
        }
    }
    return NULL;
}
static void watch(const char *what) {
    watch_what = what;
    watch_deadline = now_s() + O.wait_s;
}
static void unwatch(void) { watch_deadline = 0; }

/* Wait for the stream, bounded, watching for peers' failure and NCCL's asynchronous errors. */
static void sync_stream(const char *what) {
    double t0 = now_s(), last = t0;
    for (unsigned long spins = 0;; spins++) {
        cudaError_t e = cudaStreamQuery(g_stream);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) die("waiting for %s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
        if ((spins & 255) == 255) {
            double t = now_s();
            if (t - last > 0.01) {
                last = t;
                ncclResult_t ae = ncclSuccess;
                if (g_comm && ncclCommGetAsyncError(g_comm, &ae) == ncclSuccess && ae != ncclSuccess && ae != ncclInProgress)
                    die("NCCL asynchronous error while %s: %s (%s)", what, ncclGetErrorString(ae), ncclGetLastError(g_comm));
                peer_failed_check(what);
                if (t - t0 > O.wait_s) die("%s did not finish within %.0f s", what, O.wait_s);
            }
        }
        spin_pause(spins);
    }
}

/* Symmetric windows through dlsym, so an NCCL without them (< 2.27) still runs plain. */
typedef ncclResult_t (*mem_alloc_fn)(void **, size_t);
typedef ncclResult_t (*mem_free_fn)(void *);
typedef ncclResult_t (*win_reg_fn)(ncclComm_t, void *, size_t, void **, int);
typedef ncclResult_t (*win_dereg_fn)(ncclComm_t, void *);
static mem_alloc_fn p_mem_alloc;
static mem_free_fn p_mem_free;
static win_reg_fn p_win_reg;
static win_dereg_fn p_win_dereg;

static const char *symmetric_missing(int version) {
    static char why[160];
    if (version < 22700) {
        snprintf(why, sizeof why, "NCCL %d is older than 2.27", version);
        return why;
    }
    void *a = dlsym(RTLD_DEFAULT, "ncclMemAlloc"), *f = dlsym(RTLD_DEFAULT, "ncclMemFree");
    void *r = dlsym(RTLD_DEFAULT, "ncclCommWindowRegister"), *d = dlsym(RTLD_DEFAULT, "ncclCommWindowDeregister");
    if (!a || !f || !r || !d) {
        snprintf(why, sizeof why, "the NCCL library has no %s", !a ? "ncclMemAlloc" : !f ? "ncclMemFree" : !r ? "ncclCommWindowRegister" : "ncclCommWindowDeregister");
        return why;
    }
    memcpy(&p_mem_alloc, &a, sizeof a);
    memcpy(&p_mem_free, &f, sizeof f);
    memcpy(&p_win_reg, &r, sizeof r);
    memcpy(&p_win_dereg, &d, sizeof d);
    return NULL;
}

struct buffers {
    void *send, *recv;
    void *win_send, *win_recv;
    size_t bytes;
    int ok;
};

static ncclDataType_t nccl_dtype(int dtype) { return dtype == BF16 ? ncclBfloat16 : ncclFloat32; }

/* ncclAlltoAll (NCCL 2.28+) through dlsym, so an older NCCL (or header) still runs the exchange
 * as grouped ncclSend/ncclRecv. */
typedef ncclResult_t (*alltoall_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
static alltoall_fn p_alltoall;
static const char *a2a_form = "ncclAlltoAll";

static void alltoall_lookup(int version) {
    void *a = version >= 22800 ? dlsym(RTLD_DEFAULT, "ncclAlltoAll") : NULL;
    if (a) memcpy(&p_alltoall, &a, sizeof a);
    else a2a_form = "ncclGroupStart+ncclSend/ncclRecv";
}

/* Part k of this rank's send buffer to rank k, part k of its receive buffer from rank k. */
static ncclResult_t issue_alltoall(const struct case_desc *c, const struct buffers *b) {
    ncclDataType_t t = nccl_dtype(c->dtype);
    size_t part = c->count / (size_t)c->nranks, pb = part * esize(c->dtype);
    if (p_alltoall) return p_alltoall(b->send, b->recv, part, t, g_comm, g_stream);
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int k = 0; k < c->nranks && r == ncclSuccess; k++) {
        r = ncclSend((const char *)b->send + (size_t)k * pb, part, t, k, g_comm, g_stream);
        if (r == ncclSuccess) r = ncclRecv((char *)b->recv + (size_t)k * pb, part, t, k, g_comm, g_stream);
    }
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

static ncclResult_t issue(const struct case_desc *c, const struct buffers *b) {
    ncclDataType_t t = nccl_dtype(c->dtype);
    switch (c->coll) {
    case AR: return ncclAllReduce(b->send, b->recv, c->count, t, ncclSum, g_comm, g_stream);
    case AG: return ncclAllGather(b->send, b->recv, c->send_count, t, g_comm, g_stream);
    case RS: return ncclReduceScatter(b->send, b->recv, c->recv_count, t, ncclSum, g_comm, g_stream);
    case A2A: return issue_alltoall(c, b);
    default: return ncclBroadcast(b->send, b->recv, c->count, t, 0, g_comm, g_stream);
    }
}

static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double busbw_factor(int coll, int n) {
    if (coll == AR) return 2.0 * (n - 1) / n;
    if (coll == BC) return 1.0;
    return (double)(n - 1) / n;
}

static void print_result(const struct case_desc *c, int kind, int mode, double us, int correct) {
    if (O.rank != 0) return;
    double bytes = (double)case_bytes(c);
    if (!isfinite(us) || us < 0) us = 0, correct = 0;
    double alg = us > 0 ? bytes / (us * 1e-6) / 1e9 : 0;
    double bus = alg * busbw_factor(c->coll, c->nranks);
    char algo[96] = "";
    if (c->coll == A2A) snprintf(algo, sizeof algo, ",\"algorithm\":\"%s\"", a2a_form);
    printf("RESULT {\"bench\":\"%s\",\"impl\":\"%s\",\"operand\":\"-\",\"dtype\":\"%s\",\"op\":\"%s\",\"ranks\":%d,"
           "\"bytes\":%zu,\"mode\":\"%s\",\"time_us\":%.3f,\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f%s,\"correct\":%s}\n",
           coll_name[c->coll], kind_impl[kind], dtype_name[c->dtype], is_reduction(c->coll) ? "sum" : "-", c->nranks,
           case_bytes(c), mode_name[mode], us, alg, bus, algo, correct ? "true" : "false");
    fflush(stdout);
}

/* Results kept for the summary. */
struct cell {
    double us[NKIND][NMODE];
    int have[NKIND][NMODE];
    int correct[NKIND];
    size_t bytes;
};
static struct cell table[NCOLL][MAX_SIZES];

static void *h_send, *h_recv;
static cudaEvent_t ev0, ev1, es0, es1;

/* Copy this rank's output back, check it, agree over ranks. Returns the largest error. */
static double check_device(const struct case_desc *c, const struct buffers *b, const char *what) {
    size_t rb = c->recv_count * esize(c->dtype), worst = 0;
    CUDACHECK(cudaMemcpyAsync(h_recv, b->recv, rb, cudaMemcpyDeviceToHost, g_stream));
    sync_stream(what);
    double e = check_output(c, h_recv, &worst);
    if (!(e <= tolerance(c))) {
        float scale, r = ref_elem(c, worst, &scale);
        fprintf(stderr, "nccl_ref rank %d: %s %s: element %zu of %zu is %g, expected %g (error %g, tolerance %g)\n",
                O.rank, what, dtype_name[c->dtype], worst, c->recv_count, (double)load_elem(c->dtype, h_recv, worst),
                (double)r, e, tolerance(c));
    }
    return exchange_max(isnan(e) ? INFINITY : e, what);
}

static void run_case(const struct case_desc *c, int kind, const struct buffers *b, struct cell *cell) {
    size_t sb = c->send_count * esize(c->dtype), rb = c->recv_count * esize(c->dtype);
    struct plan p = plan_for(case_bytes(c));
    char what[160];
    snprintf(what, sizeof what, "%s %s %zu bytes", coll_name[c->coll], kind_impl[kind], case_bytes(c));

    /* 1. data, sentinel (all ones = NaN in bf16 and f32), one eager call, check */
    CUDACHECK(cudaMemcpyAsync(b->send, h_send, sb, cudaMemcpyHostToDevice, g_stream));
    CUDACHECK(cudaMemsetAsync(b->recv, 0xff, rb, g_stream));
    NCCLCHECK(issue(c, b));
    sync_stream(what);
    char cw[200];
    snprintf(cw, sizeof cw, "%s, check of one eager call", what);
    double err_eager = check_device(c, b, cw);

    /* 2. pipelined: K calls in one graph, R replays */
    double err_graph = 0;
    if (O.modes & (1u << PIPE)) {
        cudaGraph_t g;
        cudaGraphExec_t x;
        CUDACHECK(cudaMemsetAsync(b->recv, 0xff, rb, g_stream));
        sync_stream(what);
        CUDACHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
        for (int k = 0; k < p.K; k++) {
            ncclResult_t r = issue(c, b);
            if (r != ncclSuccess) {
                cudaGraph_t dummy;
                cudaStreamEndCapture(g_stream, &dummy);
                die("%s: NCCL call %d under stream capture failed: %s (%s)", what, k, ncclGetErrorString(r), ncclGetLastError(g_comm));
            }
        }
        CUDACHECK(cudaStreamEndCapture(g_stream, &g));
        CUDACHECK(cudaGraphInstantiate(&x, g, 0));
        CUDACHECK(cudaGraphUpload(x, g_stream));
        for (int w = 0; w < p.W; w++) CUDACHECK(cudaGraphLaunch(x, g_stream));
        sync_stream(what);
        barrier("before pipelined timing");
        CUDACHECK(cudaEventRecord(ev0, g_stream));
        for (int r = 0; r < p.R; r++) CUDACHECK(cudaGraphLaunch(x, g_stream));
        CUDACHECK(cudaEventRecord(ev1, g_stream));
        sync_stream(what);
        float ms = 0;
        CUDACHECK(cudaEventElapsedTime(&ms, ev0, ev1));
        double us = exchange_max((double)ms * 1e3 / ((double)p.K * p.R), "pipelined time");
        CUDACHECK(cudaGraphExecDestroy(x));
        CUDACHECK(cudaGraphDestroy(g));
        snprintf(cw, sizeof cw, "%s, check after the graph replays", what);
        err_graph = check_device(c, b, cw);
        cell->us[kind][PIPE] = us;
        cell->have[kind][PIPE] = 1;
    }

    double tol = tolerance(c), err = fmax(err_eager, err_graph);
    int correct = err <= tol;
    cell->correct[kind] = correct;
    cell->bytes = case_bytes(c);
    if (O.rank == 0) {
        if (isfinite(err))
            printf("CHECK {\"bench\":\"%s\",\"impl\":\"%s\",\"dtype\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"max_rel_err\":%.3g,\"tolerance\":%.3g,\"correct\":%s}\n",
                   coll_name[c->coll], kind_impl[kind], dtype_name[c->dtype], c->nranks, case_bytes(c), err, tol, correct ? "true" : "false");
        else
            printf("CHECK {\"bench\":\"%s\",\"impl\":\"%s\",\"dtype\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"max_rel_err\":null,\"tolerance\":%.3g,\"correct\":false}\n",
                   coll_name[c->coll], kind_impl[kind], dtype_name[c->dtype], c->nranks, case_bytes(c), tol);
    }
    if (O.modes & (1u << PIPE)) print_result(c, kind, PIPE, cell->us[kind][PIPE], correct);

    /* 3. single: one call between event-record nodes, launched right after a host barrier */
    if (O.modes & (1u << SINGLE)) {
        cudaGraph_t g;
        cudaGraphExec_t x;
        CUDACHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
        cudaError_t e = cudaEventRecordWithFlags(es0, g_stream, cudaEventRecordExternal);
        ncclResult_t r = e == cudaSuccess ? issue(c, b) : ncclSuccess;
        cudaError_t e2 = (e == cudaSuccess && r == ncclSuccess) ? cudaEventRecordWithFlags(es1, g_stream, cudaEventRecordExternal) : cudaSuccess;
        if (e != cudaSuccess || r != ncclSuccess || e2 != cudaSuccess) {
            cudaGraph_t dummy;
            cudaStreamEndCapture(g_stream, &dummy);
            if (r != ncclSuccess) die("%s: NCCL call under stream capture failed: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(g_comm));
            die("%s: cudaEventRecordWithFlags(cudaEventRecordExternal) under capture failed: %s", what,
                cudaGetErrorString(e != cudaSuccess ? e : e2));
        }
        CUDACHECK(cudaStreamEndCapture(g_stream, &g));
        CUDACHECK(cudaGraphInstantiate(&x, g, 0));
        CUDACHECK(cudaGraphUpload(x, g_stream));
        for (int w = 0; w < 2; w++) CUDACHECK(cudaGraphLaunch(x, g_stream));
        sync_stream(what);
        double *t = malloc(sizeof(double) * (size_t)p.S);
        if (!t) die("out of host memory");
        for (int s = 0; s < p.S; s++) {
            barrier("single call");
            CUDACHECK(cudaGraphLaunch(x, g_stream));
            sync_stream(what);
            float ms = 0;
            CUDACHECK(cudaEventElapsedTime(&ms, es0, es1));
            t[s] = (double)ms * 1e3;
        }
        double us = exchange_max(median(t, p.S), "single time");
        free(t);
        CUDACHECK(cudaGraphExecDestroy(x));
        CUDACHECK(cudaGraphDestroy(g));
        cell->us[kind][SINGLE] = us;
        cell->have[kind][SINGLE] = 1;
        print_result(c, kind, SINGLE, us, correct);
    }
}

/* The summary, last: per-call µs of both kinds, the faster one's bus bandwidth (~90 characters
 * a row, so 84 rows fit in a 12 kB output tail). */
static void print_summary(void) {
    if (O.rank != 0) return;
    printf("\n# NCCL %d ranks %s, per-call us: pipelined (graph of K calls) and single (one call after a host barrier);"
           " best = faster pipelined kind, its busbw in GB/s\n", O.nranks, dtype_name[O.dtype]);
    printf("%-14s %10s | %8s %8s | %5s %7s | %8s %8s | %s\n", "coll", "bytes", "plain", "symm", "best", "busbw",
           "1x plain", "1x symm", "check");
    for (int c = 0; c < NCOLL; c++) {
        if (!(O.colls & (1u << c))) continue;
        for (int s = 0; s < O.nsizes; s++) {
            struct cell *x = &table[c][s];
            if (!x->bytes) continue;
            char col[NKIND][NMODE][24];
            int best = -1;
            for (int k = 0; k < NKIND; k++) {
                for (int m = 0; m < NMODE; m++) {
                    if (x->have[k][m]) snprintf(col[k][m], sizeof col[k][m], "%.2f", x->us[k][m]);
                    else snprintf(col[k][m], sizeof col[k][m], "-");
                }
                if (x->have[k][PIPE] && x->correct[k] && (best < 0 || x->us[k][PIPE] < x->us[best][PIPE])) best = k;
            }
            double bus = 0;
            if (best >= 0) bus = (double)x->bytes / (x->us[best][PIPE] * 1e-6) / 1e9 * busbw_factor(c, O.nranks);
            const char *cor = (!(O.kinds & 1) || x->correct[PLAIN]) && (!(O.kinds & 2) || x->correct[SYMM]) ? "ok"
                              : (O.kinds & 1) && !x->correct[PLAIN] ? "PLAIN WRONG" : "SYMM WRONG";
            printf("%-14s %10zu | %8s %8s | %5s %7.1f | %8s %8s | %s\n", coll_name[c], x->bytes, col[PLAIN][PIPE],
                   col[SYMM][PIPE], best == PLAIN ? "plain" : best == SYMM ? "symm" : "-", bus, col[PLAIN][SINGLE],
                   col[SYMM][SINGLE], cor);
        }
    }
    fflush(stdout);
}

static int run_gpu(void) {
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    if (!nvls) setenv("NCCL_NVLS_ENABLE", "0", 1);
    else if (strcmp(nvls, "0")) {
        fprintf(stderr, "nccl_ref: NCCL_NVLS_ENABLE=%s: NVLink multicast must stay off on these machines; set it to 0\n", nvls);
        return 1;
    }
    abort_hook = nccl_abort_hook;
    pthread_t wd;
    if (pthread_create(&wd, NULL, watchdog, NULL)) die("cannot start the watchdog thread");
    pthread_detach(wd);

    int ndev = 0;
    CUDACHECK(cudaGetDeviceCount(&ndev));
    int dev = O.device >= 0 ? O.device : O.rank % (ndev > 0 ? ndev : 1);
    if (dev >= ndev) die("--device %d, but %d devices are visible", dev, ndev);
    CUDACHECK(cudaSetDevice(dev));
    char bus[32] = "?";
    CUDACHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, dev));
    struct cudaDeviceProp prop;
    CUDACHECK(cudaGetDeviceProperties(&prop, dev));
    int nccl_version = 0, rt = 0, drv = 0;
    NCCLCHECK(ncclGetVersion(&nccl_version));
    CUDACHECK(cudaRuntimeGetVersion(&rt));
    CUDACHECK(cudaDriverGetVersion(&drv));
    fprintf(stderr, "nccl_ref rank %d/%d: device %d (%s, %s), pid %d\n", O.rank, O.nranks, dev, prop.name, bus, (int)getpid());

    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (O.rank == 0) NCCLCHECK(ncclGetUniqueId(&id));
    shared_open(O.rank == 0 ? (const unsigned char *)&id : NULL);
    if (O.rank != 0) memcpy(&id, sh->id, sizeof id);
    barrier("start");
    if (O.rank == 0) unlink(O.id_file); /* every rank has it mapped */

    const char *why = symmetric_missing(nccl_version);
    alltoall_lookup(nccl_version);
    double sym_missing = exchange_max(why ? 1 : 0, "symmetric availability");
    if (O.rank == 0) {
        printf("# nccl_ref: NCCL %d (built with %d), CUDA runtime %d, driver %d, %d ranks, rank 0 on %s (%s), NCCL_NVLS_ENABLE=%s\n",
               nccl_version, NCCL_VERSION_CODE, rt, drv, O.nranks, prop.name, bus, getenv("NCCL_NVLS_ENABLE"));
        print_plan();
        if (O.colls & (1u << A2A)) printf("# alltoall through %s\n", a2a_form);
    }
    if ((O.kinds & (1u << SYMM)) && sym_missing > 0) {
        if (O.rank == 0) printf("# symmetric unavailable: %s; continuing with plain buffers\n", why ? why : "on another rank");
        O.kinds &= ~(1u << SYMM);
        if (!O.kinds) O.kinds = 1u << PLAIN;
    }
    fflush(stdout);

    watch("ncclCommInitRank");
    double t0 = now_s();
    NCCLCHECK(ncclCommInitRank(&g_comm, O.nranks, id, O.rank));
    unwatch();
    CUDACHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    CUDACHECK(cudaEventCreate(&ev0));
    CUDACHECK(cudaEventCreate(&ev1));
    CUDACHECK(cudaEventCreate(&es0));
    CUDACHECK(cudaEventCreate(&es1));

    size_t maxb = 0;
    for (int s = 0; s < O.nsizes; s++)
        if (O.sizes[s] > maxb) maxb = O.sizes[s];
    size_t alloc = (maxb + (2u << 20) - 1) / (2u << 20) * (2u << 20); /* VMM granularity */
    if (cudaMallocHost(&h_send, maxb) != cudaSuccess || cudaMallocHost(&h_recv, maxb) != cudaSuccess) {
        (void)cudaGetLastError();
        h_send = malloc(maxb);
        h_recv = malloc(maxb);
        if (!h_send || !h_recv) die("cannot allocate 2 x %zu bytes of host memory", maxb);
    }
    struct buffers buf[NKIND];
    memset(buf, 0, sizeof buf);
    if (O.kinds & (1u << PLAIN)) {
        CUDACHECK(cudaMalloc(&buf[PLAIN].send, alloc));
        CUDACHECK(cudaMalloc(&buf[PLAIN].recv, alloc));
        buf[PLAIN].bytes = alloc;
        buf[PLAIN].ok = 1;
    }
    if (O.kinds & (1u << SYMM)) {
        NCCLCHECK(p_mem_alloc(&buf[SYMM].send, alloc));
        NCCLCHECK(p_mem_alloc(&buf[SYMM].recv, alloc));
        watch("ncclCommWindowRegister");
        NCCLCHECK(p_win_reg(g_comm, buf[SYMM].send, alloc, &buf[SYMM].win_send, NCCL_WIN_COLL_SYMMETRIC));
        NCCLCHECK(p_win_reg(g_comm, buf[SYMM].recv, alloc, &buf[SYMM].win_recv, NCCL_WIN_COLL_SYMMETRIC));
        unwatch();
        buf[SYMM].bytes = alloc;
        buf[SYMM].ok = 1;
    }
    barrier("buffers ready");
    if (O.rank == 0) {
        printf("# setup %.2f s (communicator, %s buffers of %zu bytes)\n", now_s() - t0,
               O.kinds == 3 ? "plain and symmetric" : O.kinds == 1 ? "plain" : "symmetric", alloc);
        fflush(stdout);
    }

    double t_run = now_s();
    for (int c = 0; c < NCOLL; c++) {
        if (!(O.colls & (1u << c))) continue;
        double tc = now_s();
        for (int s = 0; s < O.nsizes; s++) {
            struct case_desc d;
            case_init(&d, c, O.dtype, O.nranks, O.rank, O.sizes[s], O.seed);
            if (d.send_count == 0) {
                if (O.rank == 0) printf("# %s: %zu bytes is too small for %d ranks; skipped\n", coll_name[c], O.sizes[s], O.nranks);
                continue;
            }
            fill_send(&d, h_send);
            for (int k = 0; k < NKIND; k++)
                if (buf[k].ok) run_case(&d, k, &buf[k], &table[c][s]);
        }
        if (O.rank == 0) printf("# %s done in %.1f s\n", coll_name[c], now_s() - tc);
    }
    barrier("end");
    if (O.rank == 0) printf("# all collectives in %.1f s\n", now_s() - t_run);
    print_summary();

    watch("teardown");
    if (buf[SYMM].ok) {
        NCCLCHECK(p_win_dereg(g_comm, buf[SYMM].win_send));
        NCCLCHECK(p_win_dereg(g_comm, buf[SYMM].win_recv));
        NCCLCHECK(p_mem_free(buf[SYMM].send));
        NCCLCHECK(p_mem_free(buf[SYMM].recv));
    }
    if (buf[PLAIN].ok) {
        CUDACHECK(cudaFree(buf[PLAIN].send));
        CUDACHECK(cudaFree(buf[PLAIN].recv));
    }
    NCCLCHECK(ncclCommFinalize(g_comm));
    NCCLCHECK(ncclCommDestroy(g_comm));
    g_comm = NULL;
    unwatch();
    barrier("teardown");
    int bad = 0;
    for (int c = 0; c < NCOLL; c++)
        for (int s = 0; s < O.nsizes; s++)
            for (int k = 0; k < NKIND; k++)
                if (buf[k].ok && table[c][s].bytes && !table[c][s].correct[k]) bad++;
    if (bad && O.rank == 0) fprintf(stderr, "nccl_ref: %d measurements were not correct\n", bad);
    return bad ? 2 : 0;
}
#endif /* !NCCL_REF_HOST_ONLY */

/* ------------------------------------------------------------------------------------------ */
/* Self-test: the host code paths, no CUDA call                                               */

static int st_pass, st_fail;
static void expect(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void expect(int ok, const char *fmt, ...) {
    if (ok) {
        st_pass++;
        return;
    }
    va_list ap;
    st_fail++;
    fprintf(stderr, "self-test FAILED: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* This rank's output as NCCL might produce it: sums in reverse rank order, each partial
 * rounded to the type (as a ring does); copies exact. */
static void emulate_output(const struct case_desc *c, void *out) {
    for (size_t j = 0; j < c->recv_count; j++) {
        float v;
        if (c->coll == AG) {
            size_t sc = c->count / (size_t)c->nranks;
            v = val(c->dtype, c->key[j / sc], j % sc);
        } else if (c->coll == A2A) {
            size_t sc = c->count / (size_t)c->nranks;
            v = val(c->dtype, c->key[j / sc], (size_t)c->rank * sc + j % sc);
        } else if (c->coll == BC) {
            v = val(c->dtype, c->key[0], j);
        } else {
            size_t idx = c->coll == RS ? (size_t)c->rank * (c->count / (size_t)c->nranks) + j : j;
            v = val(c->dtype, c->key[c->nranks - 1], idx);
            for (int q = c->nranks - 2; q >= 0; q--) v = round_dtype(c->dtype, v + val(c->dtype, c->key[q], idx));
        }
        if (c->dtype == BF16) ((uint16_t *)out)[j] = bf16_from_f32(v);
        else ((float *)out)[j] = v;
    }
}

static void self_test_numbers(void) {
    /* round to nearest even */
    struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 */
        {0x3f808000u, 0x3f80}, /* tie, even stays */
        {0x3f818000u, 0x3f82}, /* tie, odd rounds up */
        {0x3f808001u, 0x3f81}, /* above tie */
        {0x3f807fffu, 0x3f80}, /* below tie */
        {0xbf818000u, 0xbf82}, /* negative tie */
        {0x7f7fffffu, 0x7f80}, /* max float -> inf */
        {0x00000000u, 0x0000},
        {0x80000000u, 0x8000},
        {0x7f800000u, 0x7f80}, /* inf */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t b = bf16_from_f32(u2f(cases[i].in));
        expect(b == cases[i].out, "bf16(%08x) = %04x, expected %04x", cases[i].in, b, cases[i].out);
    }
    uint16_t nan = bf16_from_f32(u2f(0x7fc00001u));
    expect((nan & 0x7f80) == 0x7f80 && (nan & 0x7f), "NaN stays NaN (%04x)", nan);
    nan = bf16_from_f32(u2f(0x7f800001u)); /* signalling NaN whose payload is only in the low bits */
    expect((nan & 0x7f80) == 0x7f80 && (nan & 0x7f), "sNaN stays NaN (%04x)", nan);
    expect(bf16_to_f32(0x3f80) == 1.0f && bf16_to_f32(0xc000) == -2.0f, "bf16 -> f32");

    /* generated values: exact in their type, nonzero, in range, both signs, deterministic */
    for (int dt = 0; dt < 2; dt++) {
        int bad = 0, neg = 0;
        double sum = 0;
        for (size_t i = 0; i < 100000; i++) {
            float v = val(dt, 0x1234, i);
            if (round_dtype(dt, v) != v || !(fabsf(v) >= 1.0f / 16 && fabsf(v) < 16)) bad++;
            neg += v < 0;
            sum += v;
        }
        expect(!bad, "%s values: %d not exact or out of range", dtype_name[dt], bad);
        expect(neg > 45000 && neg < 55000, "%s values: %d of 100000 negative", dtype_name[dt], neg);
        expect(fabs(sum / 100000) < 0.1, "%s values: mean %g", dtype_name[dt], sum / 100000);
        expect(val(dt, 77, 12345) == val(dt, 77, 12345) && val(dt, 77, 12345) != val(dt, 78, 12345), "%s values deterministic, keyed", dtype_name[dt]);
    }
}

static void self_test_reference(int nmax) {
    size_t sizes[] = {1024, 4096 + 6 * 8, 65536, 1u << 20, 3u << 20};
    for (int n = 1; n <= nmax; n++) {
        for (int dt = 0; dt < 2; dt++) {
            for (int coll = 0; coll < NCOLL; coll++) {
                for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
                    for (int rank = 0; rank < n; rank += (n > 2 ? n - 1 : 1)) {
                        struct case_desc c;
                        case_init(&c, coll, dt, n, rank, sizes[si], 99);
                        size_t eb = esize(dt);
                        expect(c.count * eb <= sizes[si] && (coll == AR || coll == BC ? c.count * eb == sizes[si] : c.count % (size_t)n == 0),
                               "case sizes %s n=%d %zu", coll_name[coll], n, sizes[si]);
                        expect(c.send_count == (coll == AG ? c.count / (size_t)n : c.count) && c.recv_count == (coll == RS ? c.count / (size_t)n : c.count),
                               "send/recv counts %s", coll_name[coll]);
                        void *out = malloc(c.recv_count * eb + 16), *snd = malloc(c.send_count * eb + 16);
                        if (!out || !snd) die("out of host memory");
                        /* the send data of rank q is what the reference uses */
                        fill_send(&c, snd);
                        size_t w;
                        int same = 1;
                        for (size_t i = 0; i < c.send_count && same; i += 97) same = load_elem(dt, snd, i) == val(dt, c.key[rank], i);
                        expect(same, "send data = reference's values (%s)", coll_name[coll]);
                        emulate_output(&c, out);
                        double e = check_output(&c, out, &w), tol = tolerance(&c);
                        expect(e <= tol, "%s %s n=%d rank %d %zu B: emulated output error %g > tolerance %g", coll_name[coll], dtype_name[dt], n, rank, sizes[si], e, tol);
                        if (!is_reduction(coll)) expect(e == 0, "copy %s exact (error %g)", coll_name[coll], e);
                        if (n == 1 || dt == F32) expect(!is_reduction(coll) || e < 1e-6, "%s n=%d %s: error %g", coll_name[coll], n, dtype_name[dt], e);
                        /* a wrong element is caught, and reported where it is */
                        size_t j = c.recv_count / 2 + 1;
                        if (j >= c.recv_count) j = c.recv_count - 1;
                        float scale, r = ref_elem(&c, j, &scale);
                        float bad = r + scale * 0.25f;
                        if (dt == BF16) ((uint16_t *)out)[j] = bf16_from_f32(bad);
                        else ((float *)out)[j] = bad;
                        e = check_output(&c, out, &w);
                        expect(e > tol && w == j, "corrupted element %zu caught (%s %s n=%d: error %g at %zu)", j, coll_name[coll], dtype_name[dt], n, e, w);
                        /* the NaN sentinel (what NCCL did not write) is caught */
                        memset(out, 0xff, c.recv_count * eb);
                        e = check_output(&c, out, &w);
                        expect(!(e <= tol), "sentinel caught (%s %s: error %g)", coll_name[coll], dtype_name[dt], e);
                        /* data of another size or seed is caught (a stale output) */
                        struct case_desc other;
                        case_init(&other, coll, dt, n, rank, sizes[si], 100);
                        emulate_output(&other, out);
                        e = check_output(&c, out, &w);
                        expect(!(e <= tol), "stale output caught (%s %s n=%d: error %g)", coll_name[coll], dtype_name[dt], n, e);
                        free(out);
                        free(snd);
                    }
                }
            }
        }
    }
    /* broadcast: a wrong root is caught */
    struct case_desc c;
    case_init(&c, BC, BF16, 2, 1, 4096, 5);
    uint16_t out[2048];
    for (size_t j = 0; j < 2048; j++) out[j] = val_bf16_bits(c.key[1], j);
    size_t w;
    expect(check_output(&c, out, &w) > 0, "broadcast from the wrong root caught");
    /* tolerances */
    case_init(&c, AR, BF16, 2, 0, 4096, 5);
    expect(tolerance(&c) == 1e-2, "bf16 tolerance 1e-2 at 2 ranks");
    case_init(&c, AR, F32, 2, 0, 4096, 5);
    expect(tolerance(&c) == 1e-5, "f32 tolerance 1e-5 at 2 ranks");
}

/* Runs fn(rank) in n forked processes that share one id file; returns how many exited 0 and
 * the largest wall time. */
static int fork_ranks(int n, const char *dir, const char *name, double wait_s, int (*fn)(int), double *wall, int *codes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    pid_t pids[MAXR];
    double t0 = now_s();
    fflush(stdout);
    fflush(stderr);
    for (int r = n - 1; r >= 0; r--) { /* rank 0 last: the others must wait for its file */
        pid_t p = fork();
        if (p < 0) die("fork: %s", strerror(errno));
        if (p == 0) {
            O.rank = r;
            O.nranks = n;
            O.id_file = strdup(path);
            O.wait_s = wait_s;
            sh = NULL;
            local_sense = 0;
            xgen = 0;
            if (r == 0) {
                struct timespec ts = {0, 150 * 1000 * 1000};
                nanosleep(&ts, NULL);
            }
            _exit(fn(r));
        }
        pids[r] = p;
    }
    int ok = 0;
    for (int r = 0; r < n; r++) {
        int st = 0;
        if (waitpid(pids[r], &st, 0) < 0) die("waitpid: %s", strerror(errno));
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        ok += codes[r] == 0;
    }
    *wall = now_s() - t0;
    unlink(path);
    return ok;
}

#define ROUNDS 3000
static int child_barrier(int rank) {
    shared_open(NULL);
    barrier("start");
    for (int i = 1; i <= ROUNDS; i++) {
        __atomic_store_n(&sh->phase[rank], i, __ATOMIC_RELEASE);
        barrier("round");
        for (int q = 0; q < O.nranks; q++)
            if (__atomic_load_n(&sh->phase[q], __ATOMIC_ACQUIRE) < i) {
                fprintf(stderr, "rank %d passed barrier %d before rank %d arrived\n", rank, i, q);
                return 10;
            }
        double m = exchange_max((double)i * O.nranks + rank, "exchange");
        if (m != (double)i * O.nranks + O.nranks - 1) {
            fprintf(stderr, "rank %d: exchange %d gave %g\n", rank, i, m);
            return 11;
        }
        /* NaN from one rank poisons the maximum to +inf, as a failed check must */
        if (i % 500 == 0) {
            double x = exchange_max(rank == O.nranks - 1 ? NAN : 1.0, "nan");
            if (!isinf(x)) return 12;
        }
    }
    barrier("end");
    return 0;
}
static int child_missing_rank(int rank) {
    shared_open(NULL);
    barrier("start");
    if (rank == O.nranks - 1) return 0; /* leaves without the next barrier */
    barrier("second");                   /* the others must time out */
    return 0;
}
static int child_failing_rank(int rank) {
    shared_open(NULL);
    barrier("start");
    if (rank == 0) die("deliberate failure (self-test)");
    barrier("second"); /* the others must leave at once, well before --wait-s */
    return 0;
}
static int child_no_rank0(int rank) {
    if (rank == 0) return 0; /* never writes the file */
    shared_open(NULL);
    return 0;
}

static void self_test_processes(int n) {
    char dir[] = "/tmp/nccl_ref_selftest.XXXXXX";
    if (!mkdtemp(dir)) die("mkdtemp: %s", strerror(errno));
    int codes[MAXR];
    double wall;
    int ok = fork_ranks(n, dir, "barrier", 20, child_barrier, &wall, codes);
    expect(ok == n, "barrier and exchange, %d processes x %d rounds: %d exited 0 (codes %d %d)", n, ROUNDS, ok, codes[0], codes[n - 1]);
    printf("# self-test: %d processes, %d barrier rounds + exchanges in %.2f s\n", n, ROUNDS, wall);

    ok = fork_ranks(n, dir, "missing", 1.0, child_missing_rank, &wall, codes);
    expect(ok == 1 && codes[n - 1] == 0 && codes[0] == 1, "missing rank: the others fail (codes %d .. %d)", codes[0], codes[n - 1]);
    expect(wall < 6, "missing rank: bounded wait (%.1f s)", wall);

    ok = fork_ranks(n, dir, "failing", 30, child_failing_rank, &wall, codes);
    expect(ok == 0, "failing rank: every rank exits non-zero (%d exited 0)", ok);
    expect(wall < 5, "failing rank: peers leave at once (%.1f s with --wait-s 30)", wall);

    ok = fork_ranks(n, dir, "norank0", 1.0, child_no_rank0, &wall, codes);
    expect(codes[0] == 0 && (n == 1 || codes[n - 1] == 1), "no rank 0: the others fail (code %d)", codes[n - 1]);
    expect(wall < 6, "no rank 0: bounded wait (%.1f s)", wall);

    /* a stale id file of another run (other token) is ignored until rank 0 writes its own */
    if (n >= 2) {
        char path[4096];
        snprintf(path, sizeof path, "%s/stale", dir);
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        struct shared s;
        memset(&s, 0, sizeof s);
        s.magic = SHM_MAGIC;
        s.nranks = n;
        snprintf(s.token, sizeof s.token, "old-run");
        expect(fd >= 0 && write(fd, &s, sizeof s) == (ssize_t)sizeof s, "write stale file");
        if (fd >= 0) close(fd);
        const char *tok = O.token;
        O.token = "new-run";
        ok = fork_ranks(n, dir, "stale", 20, child_barrier, &wall, codes);
        O.token = tok;
        expect(ok == n, "stale id file ignored: %d of %d exited 0", ok, n);
    }
    rmdir(dir);
}

static void self_test_args(void) {
    struct opts save = O, o;
    char *a1[] = {"x", "--rank", "1", "--nranks", "2", "--id-file", "/tmp/x", "--coll", "all_gather,broadcast",
                  "--dtype=f32", "--min-bytes", "1K", "--max-bytes", "1M", "--buffers", "symmetric", "--graph-calls", "7"};
    int rc = parse_args((int)(sizeof a1 / sizeof a1[0]), a1, &o);
    expect(rc == 0 && o.rank == 1 && o.nranks == 2 && o.colls == ((1u << AG) | (1u << BC)) && o.dtype == F32 &&
               o.nsizes == 11 && o.sizes[0] == 1024 && o.sizes[10] == (1u << 20) && o.kinds == (1u << SYMM) && o.graph_calls == 7,
           "parse 1 (rc %d, nsizes %d)", rc, o.nsizes);
    char *a2[] = {"x", "--rank", "0", "--nranks", "4", "--id-file", "f", "--sizes", "1024,64K,1MiB,1G", "--coll", "all"};
    rc = parse_args((int)(sizeof a2 / sizeof a2[0]), a2, &o);
    expect(rc == 0 && o.nsizes == 4 && o.sizes[1] == 65536 && o.sizes[2] == (1u << 20) && o.sizes[3] == (1ull << 30) && o.colls == 15,
           "parse 2 (rc %d)", rc);
    char *a3[] = {"x", "--nranks", "2", "--id-file", "f"};
    expect(parse_args(5, a3, &o) != 0, "missing --rank rejected");
    char *a4[] = {"x", "--rank", "2", "--nranks", "2", "--id-file", "f"};
    expect(parse_args(7, a4, &o) != 0, "rank >= nranks rejected");
    char *a5[] = {"x", "--rank", "0", "--nranks", "2", "--id-file", "f", "--coll", "allsum"};
    expect(parse_args(9, a5, &o) != 0, "unknown collective rejected");
    char *a6[] = {"x", "--rank", "0", "--nranks", "2", "--id-file", "f", "--sizes", "12X"};
    expect(parse_args(9, a6, &o) != 0, "bad size rejected");
    char *a7[] = {"x", "--rank", "0", "--nranks", "2"};
    expect(parse_args(5, a7, &o) != 0, "missing --id-file rejected");
    char *a8[] = {"x", "--rank", "0", "--nranks", "2", "--id-file", "f", "--bogus"};
    expect(parse_args(8, a8, &o) != 0, "unknown option rejected");
    /* the default plan: 21 sizes, K and R within bounds, large sizes take few calls */
    char *a9[] = {"x", "--rank", "0", "--nranks", "2", "--id-file", "f"};
    rc = parse_args(7, a9, &o);
    expect(rc == 0 && o.nsizes == 21 && o.colls == 15 && o.kinds == 3 && o.modes == 3, "defaults (nsizes %d)", o.nsizes);
    O = o;
    struct plan p1 = plan_for(1024), p2 = plan_for(1u << 30);
    expect(p1.K == 100 && p1.R >= 3 && p1.R <= 100 && p1.S == 50 && p2.K == 2 && p2.R >= 3 && p2.R <= 10 && p2.S == 10,
           "plan K %d/%d R %d/%d", p1.K, p2.K, p1.R, p2.R);
    O = save;
    fprintf(stderr, "self-test: the 6 rejections above are expected\n");
}

/* How fast the host prepares and checks data (for the run-time estimate). */
static void self_test_speed(void) {
    size_t bytes = 256u << 20;
    void *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return;
    }
    struct case_desc c;
    case_init(&c, AR, BF16, O.nranks, 0, bytes, 1);
    double t0 = now_s();
    fill_send(&c, a);
    double t1 = now_s();
    memcpy(b, a, bytes);
    size_t w;
    double e = check_output(&c, b, &w);
    double t2 = now_s();
    (void)e;
    printf("# self-test: host data for 256 MiB allreduce bf16 (%d ranks, %d threads): fill %.0f ms, check %.0f ms\n", O.nranks,
           O.threads, (t1 - t0) * 1e3, (t2 - t1) * 1e3);
    free(a);
    free(b);
}

static int self_test(void) {
    if (!O.threads) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        O.threads = (int)(n < 1 ? 1 : n > 16 ? 16 : n);
    }
    int n = O.nranks < 2 ? 2 : O.nranks;
    self_test_numbers();
    self_test_reference(n > 4 ? n : 4);
    self_test_args();
    self_test_processes(n);
    self_test_speed();
    printf("self-test: %d passed, %d failed\n", st_pass, st_fail);
    return st_fail ? 1 : 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_args(argc, argv, &O)) {
        usage(stderr);
        return 2;
    }
    if (O.self_test) return self_test();
    if (O.dry_run) {
        print_plan();
        return 0;
    }
#ifdef NCCL_REF_HOST_ONLY
    fprintf(stderr, "nccl_ref: built with NCCL_REF_HOST_ONLY (no CUDA, no NCCL): only --self-test and --dry-run\n");
    return 2;
#else
    return run_gpu();
#endif
}
