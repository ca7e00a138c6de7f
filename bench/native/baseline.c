/* Native baselines for `cargo xtask bench-hw memory`: the same driver sequences as the safe API,
 * as plain C calls through the same driver entry points (resolved by the loader and passed in),
 * timed with CLOCK_MONOTONIC. No CUDA headers are needed: handles and pointers are 64-bit integers
 * and the property/descriptor structs are prepared by the caller and passed as opaque pointers. */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long u64;

struct vmm_fns {
    CUresult (*create)(u64 *handle, size_t size, const void *prop, u64 flags);
    CUresult (*release)(u64 handle);
    CUresult (*reserve)(u64 *ptr, size_t size, size_t alignment, u64 addr, u64 flags);
    CUresult (*free_va)(u64 ptr, size_t size);
    CUresult (*map)(u64 ptr, size_t size, size_t offset, u64 handle, u64 flags);
    CUresult (*unmap)(u64 ptr, size_t size);
    CUresult (*set_access)(u64 ptr, size_t size, const void *desc, size_t count);
};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* One VMM cycle: create, reserve, map, set access, unmap, free VA, release. Writes the total and
 * the seven steps' times (µs) into out[0..8]. Returns 0 or the first failing status. */
int native_vmm_cycle(const struct vmm_fns *f, const void *prop, const void *desc, size_t size, double *out) {
    u64 h = 0, p = 0;
    CUresult rc;
    double t0 = now_us(), t;
    if ((rc = f->create(&h, size, prop, 0))) return rc;
    t = now_us(); out[1] = t - t0; t0 = t;
    if ((rc = f->reserve(&p, size, 0, 0, 0))) return rc;
    t = now_us(); out[2] = t - t0; t0 = t;
    if ((rc = f->map(p, size, 0, h, 0))) return rc;
    t = now_us(); out[3] = t - t0; t0 = t;
    if ((rc = f->set_access(p, size, desc, 1))) return rc;
    t = now_us(); out[4] = t - t0; t0 = t;
    if ((rc = f->unmap(p, size))) return rc;
    t = now_us(); out[5] = t - t0; t0 = t;
    if ((rc = f->free_va(p, size))) return rc;
    t = now_us(); out[6] = t - t0; t0 = t;
    if ((rc = f->release(h))) return rc;
    t = now_us(); out[7] = t - t0;
    out[0] = out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
    return 0;
}
