/*
 * state.c - the simulated node: state file (or anonymous mapping), locking, clock, and the
 * capsim_* control API used by capctl/simgpu/node.py through ctypes.
 *
 * Control functions return 0 on success or an nvmlReturn_t code (> 0) on failure; the message
 * is then available from capsim_last_error() (thread-local).  Pointer-returning functions return
 * NULL on failure.
 */
#define _GNU_SOURCE
#include "simgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <nvml.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(capsim_header) <= CAPSIM_HEADER_BYTES, "header too large");
_Static_assert(sizeof(capsim_gpu) % 8 == 0, "gpu record must stay 8-byte aligned");
_Static_assert(sizeof(capsim_journal_header) == 64, "journal header is 64 bytes");
_Static_assert(sizeof(capsim_journal_record) == 32, "journal record is 32 bytes");
_Static_assert(offsetof(capsim_header, journal_errors) == 80, "capctl/simgpu/journal.py reads it at 80");

#define EXPORT __attribute__((visibility("default")))

static __thread char g_err[512];

static int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return code;
}

EXPORT const char *capsim_last_error(void) { return g_err; }
EXPORT unsigned capsim_abi_version(void) { return CAPSIM_ABI_VERSION; }

/* --- clock and lock ------------------------------------------------------------------------- */

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* one clock for all processes of the machine */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of time.monotonic_ns() in Python */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double capsim_clock_now(capsim_node *n)
{
    return n->hdr->manual_clock ? n->hdr->manual_now_s : monotonic_s();
}

int capsim_lock(capsim_node *n)
{
    int rc = pthread_mutex_lock(&n->hdr->lock);
    if (rc == EOWNERDEAD) { /* a process died holding the lock: state is consistent per call */
        pthread_mutex_consistent(&n->hdr->lock);
        rc = 0;
    }
    return rc;
}

/* Every locked operation ends here: changes of enforced limits are journaled before the lock goes. */
void capsim_unlock(capsim_node *n)
{
    if (!n->anonymous)
        capsim_journal_flush(n);
    pthread_mutex_unlock(&n->hdr->lock);
}

/* --- enforced-limit journal (format in simgpu.h) ------------------------------------------- */

static void journal_path(const char *state_path, char *out, size_t out_len)
{
    snprintf(out, out_len, "%s.journal", state_path);
}

/*
 * Append one record per GPU whose enforced limit differs from the last journaled value, all with
 * one timestamp (they changed under one lock hold, so no reader could tell them apart).  Caller
 * holds the node lock.  A change that cannot be written (no journal open, short write) counts in
 * hdr->journal_errors, which the checker reports: the journal is then known to be incomplete.
 */
static void journal_write(capsim_node *n, const capsim_journal_record *recs, size_t k)
{
    ssize_t want = (ssize_t)(k * sizeof recs[0]);
    if (k && (n->journal_fd < 0 || write(n->journal_fd, recs, (size_t)want) != want))
        n->hdr->journal_errors += k;
}

void capsim_journal_flush(capsim_node *n)
{
    enum { BATCH = 64 };
    capsim_journal_record recs[BATCH + 1];
    size_t k = 0;
    uint64_t t = 0;
    int foreign = 0;
    for (unsigned i = 0; i < n->hdr->gpu_count && !foreign; i++)
        foreign = (n->gpus[i].flags & CAPSIM_F_FOREIGN) != 0;
    if (foreign) { /* a foreign writer acts with time alone: surface its writes now */
        double now = capsim_clock_now(n);
        for (unsigned i = 0; i < n->hdr->gpu_count; i++)
            capsim_gpu_refresh(&n->gpus[i], now);
    }
    for (unsigned i = 0; i < n->hdr->gpu_count; i++) {
        capsim_gpu *g = &n->gpus[i];
        if (g->journal_event_s > 0.0) { /* a physics-made change, at its own time */
            if (g->journal_event_w != g->journal_w) {
                uint64_t te = n->hdr->manual_clock ? monotonic_ns()
                                                   : (uint64_t)llround(g->journal_event_s * 1e9);
                recs[k++] = (capsim_journal_record){.t_ns = te, .gpu = i, .enforced_w = g->journal_event_w,
                                                    .limit_w = g->journal_event_w,
                                                    .cause = CAPSIM_JOURNAL_CHANGED};
                g->journal_w = g->journal_event_w;
            }
            g->journal_event_s = 0.0;
        }
        if (g->enforced_w != g->journal_w) {
            if (!t)
                t = monotonic_ns();
            recs[k++] = (capsim_journal_record){
                .t_ns = t, .gpu = i, .enforced_w = g->enforced_w, .limit_w = g->limit_w,
                .cause = isnan(g->journal_w) ? CAPSIM_JOURNAL_CREATED : CAPSIM_JOURNAL_CHANGED};
            g->journal_w = g->enforced_w;
        }
        if (k >= BATCH) {
            journal_write(n, recs, k);
            k = 0;
        }
    }
    journal_write(n, recs, k);
}

/* Create the journal of a new node at tmp_path (renamed into place with the state file). */
static int journal_create(capsim_node *n, const char *tmp_path)
{
    int fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return fail(NVML_ERROR_NO_PERMISSION, "cannot create %s: %s", tmp_path, strerror(errno));
    capsim_journal_header jh;
    memset(&jh, 0, sizeof jh);
    memcpy(jh.magic, CAPSIM_JOURNAL_MAGIC, 8);
    jh.version = CAPSIM_JOURNAL_VERSION;
    jh.header_bytes = sizeof jh;
    jh.record_bytes = sizeof(capsim_journal_record);
    jh.gpu_count = n->hdr->gpu_count;
    memcpy(jh.node_id, n->hdr->node_id, sizeof jh.node_id);
    jh.created_ns = monotonic_ns();
    if (write(fd, &jh, sizeof jh) != (ssize_t)sizeof jh) {
        close(fd);
        return fail(NVML_ERROR_MEMORY, "cannot write %s: %s", tmp_path, strerror(errno));
    }
    n->journal_fd = fd;
    return 0;
}

/* --- mapping -------------------------------------------------------------------------------- */

static size_t node_bytes(unsigned gpu_count)
{
    return CAPSIM_HEADER_BYTES + (size_t)gpu_count * sizeof(capsim_gpu);
}

static int init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
}

/* Open the journal of the node mapped at h for appending; -1 when it is missing or belongs to
 * another node (a node recreated at the same path between the two renames of create_files):
 * changes then count as journal errors instead of landing in the wrong journal. */
static int journal_open(const char *state_path, const capsim_header *h)
{
    char jpath[4096];
    journal_path(state_path, jpath, sizeof jpath);
    int fd = open(jpath, O_RDWR | O_APPEND | O_CLOEXEC);
    if (fd < 0)
        return -1;
    capsim_journal_header jh;
    if (pread(fd, &jh, sizeof jh, 0) != (ssize_t)sizeof jh || memcmp(jh.magic, CAPSIM_JOURNAL_MAGIC, 8) != 0 ||
        memcmp(jh.node_id, h->node_id, sizeof jh.node_id) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Map an existing state file; returns an NVML code and a message in err. */
int capsim_map_file(const char *path, capsim_node *out, char *err, size_t err_len)
{
    memset(out, 0, sizeof *out);
    out->journal_fd = -1;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, err_len, "cannot open simulated node state file %s: %s", path, strerror(errno));
        return errno == EACCES ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_DRIVER_NOT_LOADED;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < CAPSIM_HEADER_BYTES) {
        close(fd);
        snprintf(err, err_len, "%s is not a simulated node state file (too small: %lld bytes)",
                 path, (long long)st.st_size);
        return NVML_ERROR_CORRUPTED_INFOROM;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, err_len, "cannot map %s: %s", path, strerror(errno));
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    capsim_header *h = p;
    const char *why = NULL;
    int code = NVML_ERROR_CORRUPTED_INFOROM;
    if (memcmp(h->magic, CAPSIM_MAGIC, 8) != 0)
        why = "bad magic (not a capctl simulated node state file)";
    else if (h->abi_version != CAPSIM_ABI_VERSION || h->gpu_bytes != sizeof(capsim_gpu) ||
             h->header_bytes != CAPSIM_HEADER_BYTES) {
        why = "state file written by a different simulated driver version; recreate it with "
              "'capctl-simgpu init'";
        code = NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    } else if (h->total_bytes != (uint64_t)st.st_size || node_bytes(h->gpu_count) != h->total_bytes)
        why = "size does not match its header (truncated or corrupt)";
    if (why) {
        snprintf(err, err_len, "%s: %s", path, why);
        munmap(p, (size_t)st.st_size);
        return code;
    }
    out->hdr = h;
    out->gpus = (capsim_gpu *)((char *)p + CAPSIM_HEADER_BYTES);
    out->map_bytes = (size_t)st.st_size;
    out->journal_fd = journal_open(path, h);
    return NVML_SUCCESS;
}

void capsim_unmap(capsim_node *n)
{
    if (n->hdr) {
        munmap(n->hdr, n->map_bytes);
        if (n->journal_fd >= 0)
            close(n->journal_fd);
    }
    n->journal_fd = -1;
    n->hdr = NULL;
    n->gpus = NULL;
}

/* --- seeded variation ------------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double gauss(uint64_t *s)
{
    double u1 = ((double)(splitmix64(s) >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(splitmix64(s) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static int find_profile(const char *model)
{
    for (unsigned i = 0; i < capsim_profile_table_len; i++)
        if (strcasecmp(model, capsim_profile_table[i].name) == 0)
            return (int)i;
    return -1;
}

EXPORT int capsim_profile_index(const char *model) { return model ? find_profile(model) : -1; }

EXPORT void capsim_close(capsim_node *n);

/* Write a new node's journal (initial values) and move journal and state file into place, the
 * journal first, so a state file never appears without its journal. */
static int create_files(capsim_node *n, const char *path, const char *tmp)
{
    char jpath[4096], jtmp[4200];
    journal_path(path, jpath, sizeof jpath);
    snprintf(jtmp, sizeof jtmp, "%s.tmp.%ld", jpath, (long)getpid());
    if (journal_create(n, jtmp) != 0)
        return -1;
    capsim_journal_flush(n);
    if (n->hdr->journal_errors) {
        unlink(jtmp);
        return fail(NVML_ERROR_MEMORY, "cannot write the journal %s: %s", jtmp, strerror(errno));
    }
    msync(n->hdr, n->map_bytes, MS_SYNC);
    if (rename(jtmp, jpath) != 0 || rename(tmp, path) != 0) {
        unlink(jtmp);
        return fail(NVML_ERROR_NO_PERMISSION, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    }
    return 0;
}

/*
 * Create a node of gpu_count GPUs of `model`.  path NULL: anonymous in-memory node (cluster
 * simulator); otherwise the file is written under a temporary name and renamed into place, so a
 * reader never sees a half-written node.  Per-GPU variation (seeded): speed factor
 * 1 - min(0.22, |N(0, 0.1)|) (mean ~0.08: Sinha et al. SC'22), thermal resistance x exp(N(0,0.1))
 * and time constant x exp(N(0,0.2)) around the profile's nominal values.
 */
EXPORT capsim_node *capsim_create_profile(const char *path, unsigned gpu_count, const capsim_profile *pr,
                                          int manual_clock, uint64_t seed, double inlet_c);

EXPORT capsim_node *capsim_create(const char *path, unsigned gpu_count, const char *model,
                                  int manual_clock, uint64_t seed, double inlet_c)
{
    int prof = model ? find_profile(model) : -1;
    if (prof < 0) {
        char names[256] = "";
        for (unsigned i = 0; i < capsim_profile_table_len; i++) {
            strncat(names, capsim_profile_table[i].name, sizeof names - strlen(names) - 1);
            if (i + 1 < capsim_profile_table_len)
                strncat(names, ", ", sizeof names - strlen(names) - 1);
        }
        fail(NVML_ERROR_INVALID_ARGUMENT, "model %s is unknown; allowed: %s",
             model ? model : "(null)", names);
        return NULL;
    }
    return capsim_create_profile(path, gpu_count, &capsim_profile_table[prof], manual_clock, seed, inlet_c);
}

/* Index of the built-in profile equal to *p in every field, -1 for a custom profile. */
static int builtin_index(const capsim_profile *p)
{
    for (unsigned i = 0; i < capsim_profile_table_len; i++)
        if (memcmp(p, &capsim_profile_table[i], sizeof *p) == 0)
            return (int)i;
    return -1;
}

/*
 * As capsim_create, with the device described by *pr (a built-in profile or a custom one, e.g. a
 * model the table does not hold); the profile is validated (capsim_profile_problem) and stored in
 * the node header, so every process that maps the node sees the same device.
 */
EXPORT capsim_node *capsim_create_profile(const char *path, unsigned gpu_count, const capsim_profile *pr,
                                          int manual_clock, uint64_t seed, double inlet_c)
{
    const char *problem = capsim_profile_problem(pr);
    if (*problem) {
        fail(NVML_ERROR_INVALID_ARGUMENT, "device profile is invalid: %s", problem);
        return NULL;
    }
    int prof = builtin_index(pr);
    if (gpu_count < 1 || gpu_count > 10000000u) {
        fail(NVML_ERROR_INVALID_ARGUMENT, "gpus %u is out of range; allowed: 1..10000000", gpu_count);
        return NULL;
    }
    if (!isfinite(inlet_c) || inlet_c < -20.0 || inlet_c > 80.0) {
        fail(NVML_ERROR_INVALID_ARGUMENT, "inlet_c %g is out of range; allowed: -20..80", inlet_c);
        return NULL;
    }
    size_t bytes = node_bytes(gpu_count);
    void *p;
    char tmp[4096] = "";
    int fd = -1;
    if (path) {
        if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
            fail(NVML_ERROR_INVALID_ARGUMENT, "path %s is too long", path);
            return NULL;
        }
        fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) {
            fail(NVML_ERROR_NO_PERMISSION, "cannot create %s: %s", tmp, strerror(errno));
            return NULL;
        }
        if (ftruncate(fd, (off_t)bytes) != 0) {
            fail(NVML_ERROR_MEMORY, "cannot size %s to %zu bytes: %s", tmp, bytes, strerror(errno));
            close(fd);
            unlink(tmp);
            return NULL;
        }
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    } else {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED) {
        fail(NVML_ERROR_MEMORY, "cannot map %zu bytes: %s", bytes, strerror(errno));
        if (path)
            unlink(tmp);
        return NULL;
    }
    capsim_node *n = calloc(1, sizeof *n);
    if (!n) {
        munmap(p, bytes);
        fail(NVML_ERROR_MEMORY, "out of memory");
        return NULL;
    }
    n->hdr = p;
    n->gpus = (capsim_gpu *)((char *)p + CAPSIM_HEADER_BYTES);
    n->map_bytes = bytes;
    n->anonymous = path == NULL;
    n->journal_fd = -1;
    capsim_header *h = n->hdr;
    memset(h, 0, CAPSIM_HEADER_BYTES);
    h->abi_version = CAPSIM_ABI_VERSION;
    h->header_bytes = CAPSIM_HEADER_BYTES;
    h->gpu_bytes = sizeof(capsim_gpu);
    h->gpu_count = gpu_count;
    h->manual_clock = manual_clock ? 1u : 0u;
    h->seed = seed;
    h->total_bytes = bytes;
    h->manual_now_s = 0.0;
    if (getrandom(h->node_id, sizeof h->node_id, 0) != (ssize_t)sizeof h->node_id) {
        uint64_t s = seed ^ (uint64_t)getpid() ^ (uint64_t)(monotonic_s() * 1e9);
        for (int i = 0; i < 16; i++)
            h->node_id[i] = (uint8_t)splitmix64(&s);
    }
    init_mutex(&h->lock);
    double now = capsim_clock_now(n);
    h->created_s = now;
    h->profile = *pr;
    for (unsigned i = 0; i < gpu_count; i++) {
        uint64_t s = seed * 0x100000001B3ull + i;
        double z1 = gauss(&s), z2 = gauss(&s), z3 = gauss(&s);
        double slow = fabs(z1) * 0.1003;
        double speed = 1.0 - (slow > 0.22 ? 0.22 : slow);
        double r = pr->thermal_resistance_c_per_w * exp(0.1 * z2);
        double tau = pr->tau_s * exp(0.2 * z3);
        capsim_gpu_init(&n->gpus[i], pr, prof, now, inlet_c, speed, r, tau);
        n->gpus[i].journal_w = NAN; /* the first flush writes every GPU's initial value */
    }
    memcpy(h->magic, CAPSIM_MAGIC, 8); /* written last: a valid magic means a complete node */
    if (path && create_files(n, path, tmp) != 0) {
        capsim_close(n);
        unlink(tmp);
        return NULL;
    }
    return n;
}

EXPORT capsim_node *capsim_open(const char *path)
{
    if (!path) {
        fail(NVML_ERROR_INVALID_ARGUMENT, "path is NULL");
        return NULL;
    }
    capsim_node *n = calloc(1, sizeof *n);
    if (!n) {
        fail(NVML_ERROR_MEMORY, "out of memory");
        return NULL;
    }
    int rc = capsim_map_file(path, n, g_err, sizeof g_err);
    if (rc != NVML_SUCCESS) {
        free(n);
        return NULL;
    }
    return n;
}

EXPORT void capsim_close(capsim_node *n)
{
    if (!n)
        return;
    capsim_unmap(n);
    free(n);
}

EXPORT unsigned capsim_gpu_count(capsim_node *n) { return n ? n->hdr->gpu_count : 0; }
EXPORT const capsim_profile *capsim_node_profile(capsim_node *n) { return n ? &n->hdr->profile : NULL; }
EXPORT capsim_gpu *capsim_gpus(capsim_node *n) { return n ? n->gpus : NULL; }
EXPORT int capsim_manual_clock(capsim_node *n) { return n ? (int)n->hdr->manual_clock : 0; }
EXPORT unsigned capsim_driver_generation(capsim_node *n) { return n ? n->hdr->driver_generation : 0; }
EXPORT uint64_t capsim_journal_errors(capsim_node *n) { return n ? n->hdr->journal_errors : 0; }

#define CHECK_NODE(n)                                                                            \
    do {                                                                                         \
        if (!(n) || !(n)->hdr)                                                                   \
            return fail(NVML_ERROR_UNINITIALIZED, "node is closed");                             \
    } while (0)
#define CHECK_INDEX(n, i)                                                                        \
    do {                                                                                         \
        if ((i) >= (n)->hdr->gpu_count)                                                          \
            return fail(NVML_ERROR_INVALID_ARGUMENT, "gpu index %u is out of range; allowed: 0..%u", \
                        (unsigned)(i), (n)->hdr->gpu_count - 1);                                 \
    } while (0)
#define LOCK_NODE(n)                                                                             \
    do {                                                                                         \
        if (capsim_lock(n))                                                                      \
            return fail(NVML_ERROR_UNKNOWN, "cannot lock node");                                 \
    } while (0)

EXPORT int capsim_now(capsim_node *n, double *out_s)
{
    CHECK_NODE(n);
    if (!out_s)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "out_s is NULL");
    LOCK_NODE(n);
    *out_s = capsim_clock_now(n);
    capsim_unlock(n);
    return 0;
}

EXPORT int capsim_sync(capsim_node *n)
{
    CHECK_NODE(n);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    for (unsigned i = 0; i < n->hdr->gpu_count; i++)
        capsim_gpu_refresh(&n->gpus[i], now);
    capsim_unlock(n);
    return 0;
}

EXPORT int capsim_read(capsim_node *n, unsigned index, capsim_gpu *out)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    if (!out)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "out is NULL");
    LOCK_NODE(n);
    capsim_gpu_refresh(&n->gpus[index], capsim_clock_now(n));
    *out = n->gpus[index];
    capsim_unlock(n);
    return 0;
}

EXPORT int capsim_advance(capsim_node *n, double dt_s)
{
    CHECK_NODE(n);
    if (!n->hdr->manual_clock)
        return fail(NVML_ERROR_NOT_SUPPORTED,
                    "advance needs a node created with the manual clock (this node follows the "
                    "real clock)");
    if (!isfinite(dt_s) || dt_s < 0.0)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "dt_s %g is invalid; allowed: a finite value >= 0",
                    dt_s);
    LOCK_NODE(n);
    n->hdr->manual_now_s += dt_s;
    double now = n->hdr->manual_now_s;
    for (unsigned i = 0; i < n->hdr->gpu_count; i++)
        capsim_gpu_refresh(&n->gpus[i], now);
    capsim_unlock(n);
    return 0;
}

/* Shared validation of a limit set (NVML and control API). Caller holds the lock. */
int capsim_set_limit_locked(capsim_gpu *g, double limit_w)
{
    if (g->flags & CAPSIM_F_LOST)
        return fail(NVML_ERROR_GPU_IS_LOST, "GPU is lost");
    if (g->flags & CAPSIM_F_SET_NOT_SUPPORTED)
        return fail(NVML_ERROR_NOT_SUPPORTED, "device does not support setting the power limit");
    if (g->flags & CAPSIM_F_SET_NO_PERMISSION)
        return fail(NVML_ERROR_NO_PERMISSION, "setting the power limit needs root");
    if (!isfinite(limit_w) || limit_w < g->min_limit_w - 1e-9 || limit_w > g->max_limit_w + 1e-9)
        return fail(NVML_ERROR_INVALID_ARGUMENT,
                    "power limit %.3f W is outside the limit constraints %.3f..%.3f W", limit_w,
                    g->min_limit_w, g->max_limit_w);
    g->limit_w = limit_w;
    g->set_count++;
    return 0;
}

EXPORT int capsim_set_limit(capsim_node *n, unsigned index, double limit_w)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    capsim_gpu *g = &n->gpus[index];
    capsim_gpu_refresh(g, now);
    int rc = capsim_set_limit_locked(g, limit_w);
    capsim_gpu_refresh(g, now);
    capsim_unlock(n);
    return rc;
}

/* Set many limits at once: limits_w[k] for GPU indices[k] (indices NULL: GPU k).  codes[k]
 * receives each result (0 or an NVML code).  Returns 0 when all succeeded, else the first error. */
EXPORT int capsim_set_limits(capsim_node *n, const double *limits_w, const int64_t *indices,
                             size_t count, int32_t *codes)
{
    CHECK_NODE(n);
    if (!limits_w || !codes)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "limits_w or codes is NULL");
    unsigned gc = n->hdr->gpu_count;
    for (size_t k = 0; k < count; k++) {
        int64_t i = indices ? indices[k] : (int64_t)k;
        if (i < 0 || i >= (int64_t)gc)
            return fail(NVML_ERROR_INVALID_ARGUMENT, "gpu index %lld is out of range; allowed: 0..%u",
                        (long long)i, gc - 1);
    }
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    int first = 0;
    char first_msg[512] = "";
    for (size_t k = 0; k < count; k++) {
        capsim_gpu *g = &n->gpus[indices ? indices[k] : (int64_t)k];
        capsim_gpu_refresh(g, now);
        codes[k] = capsim_set_limit_locked(g, limits_w[k]);
        capsim_gpu_refresh(g, now);
        if (codes[k] && !first) {
            first = codes[k];
            snprintf(first_msg, sizeof first_msg, "gpu %lld: %.400s",
                     (long long)(indices ? indices[k] : (int64_t)k), g_err);
        }
    }
    capsim_unlock(n);
    if (first)
        return fail(first, "%s", first_msg);
    return 0;
}

EXPORT int capsim_set_load(capsim_node *n, unsigned index, double demand_w, double utilization_pct,
                           double memory_bound_fraction)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    if (!isfinite(demand_w) || demand_w < 0.0 || demand_w > 5000.0)
        return fail(NVML_ERROR_INVALID_ARGUMENT,
                    "demand_w %g is invalid; allowed: 0 (idle) .. 5000 W", demand_w);
    if (!isfinite(utilization_pct) || utilization_pct < 0.0 || utilization_pct > 100.0)
        return fail(NVML_ERROR_INVALID_ARGUMENT,
                    "utilization_pct %g is invalid; allowed: 0..100", utilization_pct);
    if (!isnan(memory_bound_fraction) &&
        (memory_bound_fraction < 0.0 || memory_bound_fraction >= 1.0))
        return fail(NVML_ERROR_INVALID_ARGUMENT,
                    "memory_bound_fraction %g is invalid; allowed: 0 <= m < 1", memory_bound_fraction);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    capsim_gpu *g = &n->gpus[index];
    capsim_gpu_refresh(g, now);
    g->demand_w = demand_w;
    g->utilization_pct = demand_w > 0.0 ? utilization_pct : 0.0;
    if (!isnan(memory_bound_fraction))
        g->memory_bound_fraction = memory_bound_fraction;
    capsim_gpu_refresh(g, now);
    capsim_unlock(n);
    return 0;
}

/* Vectorized set_load for the cluster simulator: demand_w[k], utilization_pct[k] (NULL: 100),
 * memory_bound_fraction[k] (NULL or NaN: keep) for GPU indices[k] (NULL: GPU k).  All inputs are
 * validated before anything changes. */
EXPORT int capsim_set_loads(capsim_node *n, const double *demand_w, const double *utilization_pct,
                            const double *memory_bound_fraction, const int64_t *indices, size_t count)
{
    CHECK_NODE(n);
    if (!demand_w)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "demand_w is NULL");
    unsigned gc = n->hdr->gpu_count;
    for (size_t k = 0; k < count; k++) {
        int64_t i = indices ? indices[k] : (int64_t)k;
        double u = utilization_pct ? utilization_pct[k] : 100.0;
        double m = memory_bound_fraction ? memory_bound_fraction[k] : NAN;
        if (i < 0 || i >= (int64_t)gc)
            return fail(NVML_ERROR_INVALID_ARGUMENT, "gpu index %lld is out of range; allowed: 0..%u",
                        (long long)i, gc - 1);
        if (!isfinite(demand_w[k]) || demand_w[k] < 0.0 || demand_w[k] > 5000.0)
            return fail(NVML_ERROR_INVALID_ARGUMENT,
                        "demand_w %g (gpu %lld) is invalid; allowed: 0 (idle) .. 5000 W",
                        demand_w[k], (long long)i);
        if (!isfinite(u) || u < 0.0 || u > 100.0)
            return fail(NVML_ERROR_INVALID_ARGUMENT,
                        "utilization_pct %g (gpu %lld) is invalid; allowed: 0..100", u, (long long)i);
        if (!isnan(m) && (m < 0.0 || m >= 1.0))
            return fail(NVML_ERROR_INVALID_ARGUMENT,
                        "memory_bound_fraction %g (gpu %lld) is invalid; allowed: 0 <= m < 1", m,
                        (long long)i);
    }
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    for (size_t k = 0; k < count; k++) {
        capsim_gpu *g = &n->gpus[indices ? indices[k] : (int64_t)k];
        double m = memory_bound_fraction ? memory_bound_fraction[k] : NAN;
        capsim_gpu_refresh(g, now);
        g->demand_w = demand_w[k];
        g->utilization_pct = demand_w[k] > 0.0 ? (utilization_pct ? utilization_pct[k] : 100.0) : 0.0;
        if (!isnan(m))
            g->memory_bound_fraction = m;
        capsim_gpu_refresh(g, now);
    }
    capsim_unlock(n);
    return 0;
}

/*
 * Set one per-GPU parameter by name (validated).  Names: inlet_c, thermal_resistance_c_per_w,
 * tau_s, speed, power_factor, memory_bound_fraction, min_limit_w, max_limit_w, default_limit_w, limit_w
 * (pre-job/site limit: within the constraints), slowdown_temp_c, shutdown_temp_c,
 * max_operating_temp_c, temp_c.
 */
EXPORT int capsim_set_param(capsim_node *n, unsigned index, const char *name, double v)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    if (!name)
        return fail(NVML_ERROR_INVALID_ARGUMENT, "parameter name is NULL");
    if (!isfinite(v))
        return fail(NVML_ERROR_INVALID_ARGUMENT, "%s %g is invalid; allowed: a finite number", name, v);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    capsim_gpu *g = &n->gpus[index];
    capsim_gpu_refresh(g, now);
    int rc = 0;
#define RANGE(lo, hi, field)                                                                     \
    if (v < (lo) || v > (hi))                                                                    \
        rc = fail(NVML_ERROR_INVALID_ARGUMENT, "%s %g is out of range; allowed: %g..%g", name, v,  \
                  (double)(lo), (double)(hi));                                                   \
    else                                                                                         \
        g->field = v;
    if (!strcmp(name, "inlet_c")) {
        RANGE(-20.0, 80.0, inlet_c)
    } else if (!strcmp(name, "thermal_resistance_c_per_w")) {
        RANGE(0.001, 1.0, thermal_resistance_c_per_w)
    } else if (!strcmp(name, "tau_s")) {
        RANGE(0.01, 3600.0, tau_s)
    } else if (!strcmp(name, "speed")) {
        RANGE(0.05, 2.0, speed)
    } else if (!strcmp(name, "power_factor")) {
        RANGE(0.2, 5.0, power_factor)
    } else if (!strcmp(name, "memory_bound_fraction")) {
        RANGE(0.0, 0.99, memory_bound_fraction)
    } else if (!strcmp(name, "temp_c")) {
        RANGE(-20.0, 150.0, temp_c)
    } else if (!strcmp(name, "slowdown_temp_c")) {
        RANGE(30.0, g->shutdown_temp_c - 0.5, slowdown_temp_c)
    } else if (!strcmp(name, "shutdown_temp_c")) {
        RANGE(g->slowdown_temp_c + 0.5, 150.0, shutdown_temp_c)
    } else if (!strcmp(name, "max_operating_temp_c")) {
        RANGE(20.0, 150.0, max_operating_temp_c)
    } else if (!strcmp(name, "min_limit_w")) {
        RANGE(1.0, g->default_limit_w, min_limit_w)
    } else if (!strcmp(name, "max_limit_w")) {
        RANGE(g->default_limit_w, 5000.0, max_limit_w)
    } else if (!strcmp(name, "default_limit_w")) {
        RANGE(g->min_limit_w, g->max_limit_w, default_limit_w)
    } else if (!strcmp(name, "limit_w")) {
        RANGE(g->min_limit_w, g->max_limit_w, limit_w)
    } else {
        rc = fail(NVML_ERROR_INVALID_ARGUMENT, "parameter %s is unknown", name);
    }
#undef RANGE
    capsim_gpu_refresh(g, now);
    capsim_unlock(n);
    return rc;
}

EXPORT int capsim_inject(capsim_node *n, unsigned index, int fault, double value, double period_s)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    capsim_gpu *g = &n->gpus[index];
    capsim_gpu_refresh(g, now);
    int rc = 0;
    switch (fault) {
    case CAPSIM_FAULT_SET_NO_PERMISSION:
        g->flags |= CAPSIM_F_SET_NO_PERMISSION;
        break;
    case CAPSIM_FAULT_SET_NOT_SUPPORTED:
        g->flags |= CAPSIM_F_SET_NOT_SUPPORTED;
        break;
    case CAPSIM_FAULT_GPU_LOST:
        g->flags |= CAPSIM_F_LOST;
        break;
    case CAPSIM_FAULT_OOB_LIMIT:
        if (!isfinite(value) || value <= 0.0 || value > 5000.0)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "oob_limit value %g W is invalid; allowed: 0 < W <= 5000", value);
        else
            g->oob_limit_w = value;
        break;
    case CAPSIM_FAULT_FOREIGN_WRITER:
        if (!isfinite(value) || value < g->min_limit_w || value > g->max_limit_w)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "foreign_writer value %g W is outside the limit constraints %g..%g W", value,
                      g->min_limit_w, g->max_limit_w);
        else if (!isfinite(period_s) || period_s <= 0.0)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "foreign_writer period_s %g is invalid; allowed: > 0", period_s);
        else {
            g->flags |= CAPSIM_F_FOREIGN;
            g->foreign_limit_w = value;
            g->foreign_period_s = period_s;
            g->limit_w = value; /* writes now, then every period_s */
            g->set_count++;
            g->foreign_next_s = now + period_s;
        }
        break;
    case CAPSIM_FAULT_BAD_CONSTRAINTS: /* garbage on purpose: only finite and >= 0 is required */
        if (!isfinite(value) || !isfinite(period_s) || value < 0.0 || period_s < 0.0 || value > 1e6 ||
            period_s > 1e6)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "bad_constraints min %g W / max %g W is invalid; allowed: 0..1e6 W each", value,
                      period_s);
        else {
            g->flags |= CAPSIM_F_BAD_CONSTRAINTS;
            g->bad_min_limit_w = value;
            g->bad_max_limit_w = period_s;
        }
        break;
    case CAPSIM_FAULT_STUCK_SLOWDOWN:
        if (!isfinite(value) || value <= 0.0 || value > 1.0)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "stuck_slowdown clock fraction %g is invalid; allowed: 0 < fraction <= 1", value);
        else
            g->stuck_clock_fraction = value;
        break;
    case CAPSIM_FAULT_CONTINUOUS_CLOCK:
        g->flags |= CAPSIM_F_CONTINUOUS_CLOCK;
        break;
    case CAPSIM_FAULT_NVML_STALL:
        if (!isfinite(value) || value <= 0.0 || value > 60.0)
            rc = fail(NVML_ERROR_INVALID_ARGUMENT,
                      "nvml_stall %g s is invalid; allowed: 0 < s <= 60", value);
        else
            g->stall_s = value;
        break;
    default:
        rc = fail(NVML_ERROR_INVALID_ARGUMENT, "fault code %d is unknown", fault);
    }
    capsim_gpu_refresh(g, now);
    capsim_unlock(n);
    return rc;
}

EXPORT int capsim_clear(capsim_node *n, unsigned index, int fault)
{
    CHECK_NODE(n);
    CHECK_INDEX(n, index);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    capsim_gpu *g = &n->gpus[index];
    capsim_gpu_refresh(g, now);
    int rc = 0;
    switch (fault) {
    case CAPSIM_FAULT_SET_NO_PERMISSION:
        g->flags &= ~CAPSIM_F_SET_NO_PERMISSION;
        break;
    case CAPSIM_FAULT_SET_NOT_SUPPORTED:
        g->flags &= ~CAPSIM_F_SET_NOT_SUPPORTED;
        break;
    case CAPSIM_FAULT_GPU_LOST:
        g->flags &= ~(CAPSIM_F_LOST | CAPSIM_F_THERMAL_SHUTDOWN);
        break;
    case CAPSIM_FAULT_OOB_LIMIT:
        g->oob_limit_w = 0.0;
        break;
    case CAPSIM_FAULT_FOREIGN_WRITER:
        g->flags &= ~CAPSIM_F_FOREIGN;
        break;
    case CAPSIM_FAULT_BAD_CONSTRAINTS:
        g->flags &= ~CAPSIM_F_BAD_CONSTRAINTS;
        break;
    case CAPSIM_FAULT_STUCK_SLOWDOWN:
        g->stuck_clock_fraction = 0.0;
        break;
    case CAPSIM_FAULT_NVML_STALL:
        g->stall_s = 0.0;
        break;
    case CAPSIM_FAULT_CONTINUOUS_CLOCK:
        g->flags &= ~CAPSIM_F_CONTINUOUS_CLOCK;
        break;
    default:
        rc = fail(NVML_ERROR_INVALID_ARGUMENT, "fault code %d is unknown", fault);
    }
    capsim_gpu_refresh(g, now);
    capsim_unlock(n);
    return rc;
}

/* Simulated driver reload: every GPU's limit back to its default, energy counters restart. */
EXPORT int capsim_driver_reload(capsim_node *n)
{
    CHECK_NODE(n);
    LOCK_NODE(n);
    double now = capsim_clock_now(n);
    for (unsigned i = 0; i < n->hdr->gpu_count; i++)
        capsim_gpu_driver_reload(&n->gpus[i], now);
    n->hdr->driver_generation++;
    capsim_unlock(n);
    return 0;
}

/* --- layout export (numpy dtypes are built from these tables, not duplicated) --------------- */

#define GF(name, type) {#name, offsetof(capsim_gpu, name), type}
static const capsim_field gpu_fields[] = {
    GF(profile, "<i4"), GF(flags, "<u4"), GF(t_s, "<f8"), GF(min_limit_w, "<f8"),
    GF(max_limit_w, "<f8"), GF(default_limit_w, "<f8"), GF(limit_w, "<f8"),
    GF(oob_limit_w, "<f8"), GF(foreign_limit_w, "<f8"), GF(foreign_period_s, "<f8"),
    GF(foreign_next_s, "<f8"), GF(demand_w, "<f8"), GF(utilization_pct, "<f8"),
    GF(memory_bound_fraction, "<f8"), GF(inlet_c, "<f8"), GF(thermal_resistance_c_per_w, "<f8"),
    GF(tau_s, "<f8"), GF(speed, "<f8"), GF(power_factor, "<f8"), GF(slowdown_temp_c, "<f8"), GF(shutdown_temp_c, "<f8"),
    GF(max_operating_temp_c, "<f8"), GF(temp_c, "<f8"), GF(power_w, "<f8"),
    GF(power_avg_w, "<f8"), GF(sm_clock_mhz, "<f8"), GF(enforced_w, "<f8"), GF(rate, "<f8"),
    GF(energy_j, "<f8"), GF(progress, "<f8"), GF(reasons, "<u8"), GF(set_count, "<u4"),
    GF(bad_min_limit_w, "<f8"), GF(bad_max_limit_w, "<f8"), GF(stuck_clock_fraction, "<f8"),
    GF(stall_s, "<f8"), GF(idle_w, "<f8"), GF(max_sm_clock_mhz, "<f8"), GF(min_sm_clock_mhz, "<f8"),
    GF(idle_sm_clock_mhz, "<f8"), GF(averaged_power, "<u4"),
};
#undef GF
#define PF(name, type) {#name, offsetof(capsim_profile, name), type}
static const capsim_field profile_fields[] = {
    PF(name, "S32"), PF(nvml_name, "S64"), PF(min_limit_w, "<f8"), PF(max_limit_w, "<f8"),
    PF(default_limit_w, "<f8"), PF(idle_w, "<f8"), PF(max_sm_clock_mhz, "<f8"),
    PF(min_sm_clock_mhz, "<f8"), PF(idle_sm_clock_mhz, "<f8"), PF(mem_clock_mhz, "<f8"),
    PF(max_video_clock_mhz, "<f8"), PF(slowdown_temp_c, "<f8"), PF(shutdown_temp_c, "<f8"),
    PF(max_operating_temp_c, "<f8"), PF(mem_max_temp_c, "<f8"),
    PF(thermal_resistance_c_per_w, "<f8"), PF(tau_s, "<f8"), PF(memory_bound_fraction, "<f8"),
    PF(pci_device_id, "<u4"), PF(architecture, "<u4"), PF(averaged_power, "<u4"),
};
#undef PF

/* which: 0 = capsim_gpu, 1 = capsim_profile.  Returns the field table and its length/record size. */
EXPORT const capsim_field *capsim_fields(int which, size_t *count, size_t *record_bytes)
{
    if (which == 0) {
        *count = sizeof gpu_fields / sizeof gpu_fields[0];
        *record_bytes = sizeof(capsim_gpu);
        return gpu_fields;
    }
    *count = sizeof profile_fields / sizeof profile_fields[0];
    *record_bytes = sizeof(capsim_profile);
    return profile_fields;
}

EXPORT const capsim_profile *capsim_profiles(unsigned *count)
{
    *count = capsim_profile_table_len;
    return capsim_profile_table;
}
