/*
 * nvml.c - the NVML entry points of the simulated libnvidia-ml.so.1.
 *
 * Prototypes come from NVIDIA's real nvml.h (PyPI nvidia-nvml-dev), so a wrong signature fails
 * to compile.  Semantics follow the NVML API reference (the doc comments in nvml.h): units are
 * milliwatts for power, millijoules for energy, degrees C, MHz; return codes UNINITIALIZED before
 * nvmlInit, INVALID_ARGUMENT for NULL pointers / bad handles / out-of-range values,
 * INSUFFICIENT_SIZE for short buffers, NOT_SUPPORTED, NO_PERMISSION and GPU_IS_LOST as injected.
 * nvmlInit/nvmlShutdown are reference counted like the real library.
 *
 * The node is the state file named by $CAPCTL_SIMGPU_NODE (mapped on the first nvmlInit).
 */
#define _GNU_SOURCE
#include "simgpu.h"

#include <math.h>
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SIM_MAX_HANDLES 4096u /* GPUs visible through NVML per node */

struct nvmlDevice_st {
    unsigned magic;
    unsigned index;
};
#define HANDLE_MAGIC 0x53494d47u

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_refcount;
static capsim_node g_node;
static struct nvmlDevice_st g_handles[SIM_MAX_HANDLES];

static const char DRIVER_VERSION[] = "580.65.06";
static const char NVML_VERSION[] = "13.580.65.06";
static const int CUDA_DRIVER_VERSION = 13000;

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NVML_INIT_FLAG_NO_GPUS / NO_ATTACH: accepted, nothing to attach */
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_refcount == 0) {
        const char *path = getenv("CAPCTL_SIMGPU_NODE");
        char err[512];
        if (!path || !*path) {
            fprintf(stderr, "simnvml: CAPCTL_SIMGPU_NODE is not set; create a node with "
                            "'capctl-simgpu init DIR' and export the printed variables\n");
            rc = NVML_ERROR_DRIVER_NOT_LOADED;
        } else {
            rc = (nvmlReturn_t)capsim_map_file(path, &g_node, err, sizeof err);
            if (rc != NVML_SUCCESS)
                fprintf(stderr, "simnvml: %s\n", err);
        }
        if (rc == NVML_SUCCESS) {
            for (unsigned i = 0; i < SIM_MAX_HANDLES; i++) {
                g_handles[i].magic = HANDLE_MAGIC;
                g_handles[i].index = i;
            }
        }
    }
    if (rc == NVML_SUCCESS)
        g_refcount++;
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_refcount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else if (--g_refcount == 0)
        capsim_unmap(&g_node);
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_str(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(src) + 1;
    if (length < need)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

static int initialized(void) { return __atomic_load_n(&g_refcount, __ATOMIC_ACQUIRE) > 0; }

/* A NULL out-pointer: like NVML, report UNINITIALIZED before INVALID_ARGUMENT. */
static nvmlReturn_t bad_arg(void) { return initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED; }

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return copy_str(version, length, NVML_VERSION); /* works without nvmlInit, like NVML */
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

static unsigned visible_count(void)
{
    unsigned n = g_node.hdr->gpu_count;
    return n > SIM_MAX_HANDLES ? SIM_MAX_HANDLES : n;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = visible_count();
    return NVML_SUCCESS;
}

/*
 * Device access: validate, lock the node, bring the GPU's physics up to now, and hand the
 * record to the caller (which must call done()).  GPU_IS_LOST for a lost GPU.
 */
static nvmlReturn_t enter(nvmlDevice_t device, capsim_gpu **out)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || device < g_handles || device >= g_handles + SIM_MAX_HANDLES ||
        device->magic != HANDLE_MAGIC || device->index >= visible_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    if (capsim_lock(&g_node))
        return NVML_ERROR_UNKNOWN;
    capsim_gpu *g = &g_node.gpus[device->index];
    double stall_s = g->stall_s;
    if (stall_s > 0.0) { /* fault: the call stalls (outside the node lock, like a hung driver call) */
        capsim_unlock(&g_node);
        struct timespec ts = {(time_t)stall_s, (long)((stall_s - (double)(time_t)stall_s) * 1e9)};
        nanosleep(&ts, NULL);
        if (capsim_lock(&g_node))
            return NVML_ERROR_UNKNOWN;
    }
    capsim_gpu_refresh(g, capsim_clock_now(&g_node));
    if (g->flags & CAPSIM_F_LOST) {
        capsim_unlock(&g_node);
        return NVML_ERROR_GPU_IS_LOST;
    }
    *out = g;
    return NVML_SUCCESS;
}

static void done(void) { capsim_unlock(&g_node); }

/* Declares `capsim_gpu *g` for `device` through enter() (node locked, g refreshed); on failure
 * returns enter()'s NVML error from the calling function. Pair with done(). */
#define ENTER_OR_RETURN(device, g)                        \
    capsim_gpu *g;                                        \
    do {                                                  \
        nvmlReturn_t enter_rc_ = enter((device), &g);     \
        if (enter_rc_ != NVML_SUCCESS)                    \
            return enter_rc_;                             \
    } while (0)

/* The node's device profile (stored in its header: a built-in one or a custom one). */
static const capsim_profile *profile_of(const capsim_gpu *g)
{
    (void)g; /* one device profile per node */
    return &g_node.hdr->profile;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= visible_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    ENTER_OR_RETURN(&g_handles[index], g);
    done();
    *device = &g_handles[index];
    return NVML_SUCCESS;
}

static void format_uuid(unsigned index, char *buf, size_t len)
{
    uint8_t b[16];
    memcpy(b, g_node.hdr->node_id, 16);
    b[12] ^= (uint8_t)(index >> 24);
    b[13] ^= (uint8_t)(index >> 16);
    b[14] ^= (uint8_t)(index >> 8);
    b[15] ^= (uint8_t)index;
    snprintf(buf, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
}

static void pci_bus(unsigned index, unsigned *domain, unsigned *bus)
{
    /* DGX H100 layout of the 8 SXM GPUs (lspci), then a simple continuation */
    static const unsigned dgx[8] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};
    *domain = index / 256u;
    *bus = index < 8 ? dgx[index] : (index % 256u);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER_OR_RETURN(device, g);
    nvmlReturn_t rc = copy_str(name, length, profile_of(g)->nvml_name);
    done();
    return rc;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER_OR_RETURN(device, g);
    char buf[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    format_uuid(device->index, buf, sizeof buf);
    nvmlReturn_t rc = copy_str(uuid, length, buf);
    done();
    return rc;
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    ENTER_OR_RETURN(device, g);
    char buf[NVML_DEVICE_SERIAL_BUFFER_SIZE];
    snprintf(buf, sizeof buf, "16%02x%02x%08u", g_node.hdr->node_id[0], g_node.hdr->node_id[1],
             device->index);
    nvmlReturn_t rc = copy_str(serial, length, buf);
    done();
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    char buf[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    for (unsigned i = 0; i < visible_count(); i++) {
        format_uuid(i, buf, sizeof buf);
        if (strcmp(buf, uuid) == 0)
            return nvmlDeviceGetHandleByIndex_v2(i, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    if (!index)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *index = device->index;
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    if (!minorNumber)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *minorNumber = device->index; /* /dev/nvidiaN */
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    if (!pci)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    memset(pci, 0, sizeof *pci);
    unsigned domain, bus;
    pci_bus(device->index, &domain, &bus);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = 0;
    pci->pciDeviceId = profile_of(g)->pci_device_id;
    pci->pciSubSystemId = 0x16C110DEu;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:00.0", domain, bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:00.0", domain & 0xffffu, bus);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!pciBusId || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < visible_count(); i++) {
        unsigned domain, bus;
        char a[32], b[32];
        pci_bus(i, &domain, &bus);
        snprintf(a, sizeof a, "%08X:%02X:00.0", domain, bus);
        snprintf(b, sizeof b, "%04X:%02X:00.0", domain & 0xffffu, bus);
        if (strcasecmp(pciBusId, a) == 0 || strcasecmp(pciBusId, b) == 0)
            return nvmlDeviceGetHandleByIndex_v2(i, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
    if (!arch)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *arch = profile_of(g)->architecture;
    done();
    return NVML_SUCCESS;
}

static unsigned int to_mw(double w) { return (unsigned int)llround(w * 1000.0); }

/* Power draw in mW: 1 s average on Ampere+ except GA100, instantaneous otherwise (nvml.h). */
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    if (!power)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *power = to_mw(g->power_avg_w);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    if (!limit)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *limit = to_mw(g->limit_w);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                          unsigned int *maxLimit)
{
    if (!minLimit || !maxLimit)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    int bad = (g->flags & CAPSIM_F_BAD_CONSTRAINTS) != 0; /* fault: garbage constraints */
    *minLimit = to_mw(bad ? g->bad_min_limit_w : g->min_limit_w);
    *maxLimit = to_mw(bad ? g->bad_max_limit_w : g->max_limit_w);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *defaultLimit)
{
    if (!defaultLimit)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *defaultLimit = to_mw(g->default_limit_w);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    if (!limit)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *limit = to_mw(capsim_gpu_enforced_w(g));
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    if (!mode)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *mode = NVML_FEATURE_ENABLED;
    done();
    return NVML_SUCCESS;
}

/* Set the power limit (mW).  INVALID_ARGUMENT outside the limit constraints (nvml.h). */
nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t device, unsigned int limit)
{
    ENTER_OR_RETURN(device, g);
    nvmlReturn_t rc;
    if (!(g->flags & (CAPSIM_F_SET_NOT_SUPPORTED | CAPSIM_F_SET_NO_PERMISSION)) &&
        (limit < to_mw(g->min_limit_w) || limit > to_mw(g->max_limit_w)))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else {
        double now = capsim_clock_now(&g_node);
        rc = (nvmlReturn_t)capsim_set_limit_locked(g, (double)limit / 1000.0);
        capsim_gpu_refresh(g, now);
    }
    done();
    return rc;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit_v2(nvmlDevice_t device, nvmlPowerValue_v2_t *powerValue)
{
    if (!powerValue)
        return bad_arg();
    if (powerValue->version != nvmlPowerValue_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (powerValue->powerScope != NVML_POWER_SCOPE_GPU)
        return initialized() ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_UNINITIALIZED;
    return nvmlDeviceSetPowerManagementLimit(device, powerValue->powerValueMw);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    if (!temp || sensorType != NVML_TEMPERATURE_GPU)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    double t = g->temp_c;
    *temp = t <= 0.0 ? 0u : (unsigned int)floor(t); /* integer degrees, like the sensor */
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    if (!temperature)
        return bad_arg();
    if (temperature->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != NVML_TEMPERATURE_GPU)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    temperature->temperature = (int)floor(g->temp_c);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device,
                                               nvmlTemperatureThresholds_t thresholdType,
                                               unsigned int *temp)
{
    if (!temp || (unsigned)thresholdType >= NVML_TEMPERATURE_THRESHOLD_COUNT)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    nvmlReturn_t rc = NVML_SUCCESS;
    switch (thresholdType) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        *temp = (unsigned)lround(g->shutdown_temp_c);
        break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        *temp = (unsigned)lround(g->slowdown_temp_c);
        break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX:
        *temp = (unsigned)lround(g->max_operating_temp_c);
        break;
    case NVML_TEMPERATURE_THRESHOLD_MEM_MAX:
        *temp = (unsigned)lround(profile_of(g)->mem_max_temp_c);
        break;
    default:
        rc = NVML_ERROR_NOT_SUPPORTED; /* acoustic / GPS thresholds: not on data-center parts */
    }
    done();
    return rc;
}

static nvmlReturn_t clock_value(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock, int max)
{
    if (!clock || (unsigned)type >= NVML_CLOCK_COUNT)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    const capsim_profile *p = profile_of(g);
    double v;
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM:
        v = max ? p->max_sm_clock_mhz : g->sm_clock_mhz;
        break;
    case NVML_CLOCK_MEM:
        v = p->mem_clock_mhz;
        break;
    default: /* NVML_CLOCK_VIDEO: scales with the SM clock */
        v = max ? p->max_video_clock_mhz
                : p->max_video_clock_mhz * g->sm_clock_mhz / p->max_sm_clock_mhz;
    }
    *clock = (unsigned int)lround(v);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    return clock_value(device, type, clock, 0);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    return clock_value(device, type, clock, 1);
}

nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t device, nvmlClockType_t clockType, nvmlClockId_t clockId,
                                unsigned int *clockMHz)
{
    if ((unsigned)clockId >= NVML_CLOCK_ID_COUNT)
        return bad_arg();
    return clock_value(device, clockType, clockMHz, clockId == NVML_CLOCK_ID_CUSTOMER_BOOST_MAX);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *clocksEventReasons)
{
    if (!clocksEventReasons)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *clocksEventReasons = g->reasons;
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *clocksThrottleReasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, clocksThrottleReasons);
}

nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device,
                                                      unsigned long long *supportedClocksEventReasons)
{
    if (!supportedClocksEventReasons)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *supportedClocksEventReasons = nvmlClocksEventReasonGpuIdle | nvmlClocksEventReasonSwPowerCap |
                                   nvmlClocksThrottleReasonHwSlowdown |
                                   nvmlClocksEventReasonSwThermalSlowdown |
                                   nvmlClocksThrottleReasonHwThermalSlowdown;
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t device,
                                                         unsigned long long *supportedClocksThrottleReasons)
{
    return nvmlDeviceGetSupportedClocksEventReasons(device, supportedClocksThrottleReasons);
}

/* Energy since the driver was last loaded, in mJ (Volta+; nvml.h). */
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    if (!energy)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *energy = (unsigned long long)llround(g->energy_j * 1000.0);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    if (!utilization)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    /* memory: the share of the period device memory is busy.  The step-time model (physics.c)
     * spends m of a step (at max clock) on memory, which does not scale with the SM clock, and
     * (1 - m) / r on compute at clock ratio r: memory is busy m / (m + (1 - m) / r) of the time
     * (m at max clock, less when the clock is capped lower: compute takes longer). */
    double r = g->max_sm_clock_mhz > 0.0 ? g->sm_clock_mhz / g->max_sm_clock_mhz : 1.0;
    double m = g->memory_bound_fraction;
    double share = r > 0.0 ? m / (m + (1.0 - m) / r) : 0.0;
    utilization->gpu = (unsigned)lround(g->utilization_pct);
    utilization->memory = (unsigned)lround(g->utilization_pct * share);
    done();
    return NVML_SUCCESS;
}

static nvmlPstates_t pstate(const capsim_gpu *g) { return g->demand_w > 0.0 ? NVML_PSTATE_0 : NVML_PSTATE_8; }

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, nvmlPstates_t *pState)
{
    if (!pState)
        return bad_arg();
    ENTER_OR_RETURN(device, g);
    *pState = pstate(g);
    done();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t device, nvmlPstates_t *pState)
{
    return nvmlDeviceGetPerformanceState(device, pState);
}
