/*
 * simgpu.h - shared declarations of the capctl simulated GPU driver.
 *
 * One simulated node = one memory mapping (a file named by $CAPCTL_SIMGPU_NODE, or an anonymous
 * mapping for the in-process cluster simulator) holding a versioned header and an array of
 * capsim_gpu records.  All access goes through the robust process-shared mutex in the header.
 * The physics (physics.c) works on arrays of capsim_gpu so the cluster simulator can step up to
 * ~100k GPUs with the same code the NVML entry points use.
 *
 * Units: watts, degrees Celsius, MHz, seconds, joules everywhere in this file; milliwatts and
 * millijoules exist only at the NVML edge (nvml.c).
 */
#ifndef CAPCTL_SIMGPU_H
#define CAPCTL_SIMGPU_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define CAPSIM_MAGIC "CAPSIMv1"      /* 8 bytes, no terminator stored */
#define CAPSIM_ABI_VERSION 5u         /* bump on any layout change of the header or capsim_gpu */
#define CAPSIM_HEADER_BYTES 512u      /* the GPU array starts at this offset */
#define CAPSIM_POWER_WINDOW_S 1.0     /* NVML power reading window on Ampere+ (nvml.h, GetPowerUsage) */
#define CAPSIM_SEGMENTS 8             /* power history segments kept for the moving average */
#define CAPSIM_CLOCK_STEP_MHZ 15.0    /* SM clock step (nvidia-smi -q -d SUPPORTED_CLOCKS: 15 MHz grid) */
#define CAPSIM_THROTTLE_FACTOR 0.70   /* SM clock kept on thermal slowdown (~30% drop, see docs) */
#define CAPSIM_THERMAL_HYSTERESIS_C 5.0 /* slowdown released this far below the threshold (estimate) */

/* capsim_gpu.flags */
#define CAPSIM_F_LOST 0x1u             /* GPU fell off the bus: every NVML call -> GPU_IS_LOST */
#define CAPSIM_F_SET_NO_PERMISSION 0x2u
#define CAPSIM_F_SET_NOT_SUPPORTED 0x4u
#define CAPSIM_F_THROTTLED 0x8u        /* thermal slowdown engaged (internal state, hysteresis) */
#define CAPSIM_F_FOREIGN 0x10u         /* a foreign writer re-sets its own limit periodically */
#define CAPSIM_F_THERMAL_SHUTDOWN 0x20u /* lost because the shutdown temperature was reached */
#define CAPSIM_F_BAD_CONSTRAINTS 0x40u /* NVML reports bad_min/max_limit_w as the limit constraints */
#define CAPSIM_F_CONTINUOUS_CLOCK 0x80u /* the SM clock follows the cap continuously (no 15 MHz steps) */

/* Fault codes of capsim_inject / capsim_clear. */
enum capsim_fault {
    CAPSIM_FAULT_SET_NO_PERMISSION = 1,
    CAPSIM_FAULT_SET_NOT_SUPPORTED = 2,
    CAPSIM_FAULT_GPU_LOST = 3,
    CAPSIM_FAULT_OOB_LIMIT = 4,
    CAPSIM_FAULT_FOREIGN_WRITER = 5,
    CAPSIM_FAULT_BAD_CONSTRAINTS = 6, /* value: reported min W, period_s: reported max W (any) */
    CAPSIM_FAULT_STUCK_SLOWDOWN = 7,  /* value: SM clock held at this fraction (0, 1] of max, HW slowdown */
    CAPSIM_FAULT_NVML_STALL = 8,      /* value: every NVML call on the GPU sleeps this long (s, <= 60) */
    CAPSIM_FAULT_CONTINUOUS_CLOCK = 9, /* a plant, not a defect: the SM clock is not quantized to 15 MHz */
};

/* A device profile (constants of one GPU model; sources in physics.c). */
typedef struct capsim_profile {
    char name[32];              /* capctl model key, e.g. "H100-SXM" */
    char nvml_name[64];         /* what nvmlDeviceGetName returns */
    double min_limit_w, max_limit_w, default_limit_w;
    double idle_w;              /* static / idle board power */
    double max_sm_clock_mhz, min_sm_clock_mhz, idle_sm_clock_mhz;
    double mem_clock_mhz, max_video_clock_mhz;
    double slowdown_temp_c, shutdown_temp_c, max_operating_temp_c, mem_max_temp_c;
    double thermal_resistance_c_per_w; /* nominal (see physics.c) */
    double tau_s;                      /* nominal thermal time constant */
    double memory_bound_fraction;      /* default m of the step-time model */
    uint32_t pci_device_id;     /* (device id << 16) | vendor id 0x10DE */
    uint32_t architecture;      /* NVML_DEVICE_ARCH_* */
    uint32_t averaged_power;    /* 1: GetPowerUsage is a 1 s average (Ampere+ except GA100) */
    uint32_t pad;
} capsim_profile;

/* One simulated GPU.  Layout is part of the state-file ABI (CAPSIM_ABI_VERSION). */
typedef struct capsim_gpu {
    int32_t profile;            /* index into capsim_profiles */
    uint32_t flags;             /* CAPSIM_F_* */
    double t_s;                 /* simulated time this record is integrated up to */
    /* limits (W) */
    double min_limit_w, max_limit_w, default_limit_w;
    double limit_w;             /* requested power limit (persistent driver setting) */
    double oob_limit_w;         /* out-of-band limit; 0 = none */
    double foreign_limit_w, foreign_period_s, foreign_next_s;
    /* workload */
    double demand_w;            /* uncapped demand at max SM clock; 0 = idle */
    double utilization_pct;
    double memory_bound_fraction;
    /* per-GPU physical parameters */
    double inlet_c, thermal_resistance_c_per_w, tau_s, speed;
    double power_factor;        /* dynamic power at a given clock relative to a nominal part (>= 0.2) */
    double slowdown_temp_c, shutdown_temp_c, max_operating_temp_c;
    /* state / outputs */
    double temp_c;              /* die temperature */
    double power_w;             /* true instantaneous power */
    double power_avg_w;         /* 1 s moving average (what Ampere+ NVML reports) */
    double sm_clock_mhz;
    double enforced_w;          /* min(limit_w, oob_limit_w) */
    double rate;                /* current step rate (1.0 = max clock, speed 1) */
    double energy_j;            /* since the last driver load */
    double progress;            /* integral of rate over time (work units) */
    uint64_t reasons;           /* NVML clocks event reason bits */
    uint32_t set_count;         /* successful limit sets (NVML + control API + foreign) */
    int32_t seg_n;              /* valid power history segments */
    double seg_t[CAPSIM_SEGMENTS];
    double seg_p[CAPSIM_SEGMENTS];
    double journal_w;           /* enforced limit last written to the journal (NaN: none yet) */
    double journal_event_s;     /* node-clock time of a change made by the physics (foreign
                                   writer) not yet journaled; 0 = none */
    double journal_event_w;     /* the enforced limit that change produced */
    /* faults of ABI 4 */
    double bad_min_limit_w, bad_max_limit_w; /* reported constraints under CAPSIM_F_BAD_CONSTRAINTS */
    double stuck_clock_fraction;             /* > 0: SM clock held at this fraction of max (HW slowdown) */
    double stall_s;                          /* > 0: every NVML call on this GPU sleeps this long */
    /* ABI 5: the device constants the physics uses, copied from the node's profile at creation
     * (so the physics never looks a profile up and a node may hold a device from a custom one) */
    double idle_w;                           /* static / idle board power */
    double max_sm_clock_mhz, min_sm_clock_mhz, idle_sm_clock_mhz;
    uint32_t averaged_power;                 /* 1: GetPowerUsage is a 1 s average */
    uint32_t pad5;
} capsim_gpu;

/* The node header at offset 0 of the mapping. */
typedef struct capsim_header {
    char magic[8];
    uint32_t abi_version;
    uint32_t header_bytes;
    uint32_t gpu_bytes;          /* sizeof(capsim_gpu) */
    uint32_t gpu_count;
    uint32_t manual_clock;       /* 1: time only moves via capsim_advance */
    uint32_t driver_generation;  /* incremented on every simulated driver reload */
    uint64_t seed;
    uint64_t total_bytes;
    double manual_now_s;         /* the manual clock */
    double created_s;
    uint8_t node_id[16];         /* random; the GPU UUIDs derive from it */
    uint64_t journal_errors;     /* enforced-limit changes that could not be journaled (see state.c) */
    pthread_mutex_t lock;        /* robust, PTHREAD_PROCESS_SHARED */
    capsim_profile profile;      /* ABI 5: the node's device profile (built-in or custom): NVML name,
                                    PCI id, architecture, memory/video clocks come from here */
} capsim_header;

typedef struct capsim_node {
    capsim_header *hdr;
    capsim_gpu *gpus;
    size_t map_bytes;
    int anonymous;
    int journal_fd;              /* this process's O_APPEND descriptor of the journal; -1: none */
} capsim_node;

/*
 * The enforced-limit journal: "<state file>.journal", beside the state file of a file-backed node.
 * Every change of a GPU's enforced limit is appended as one record, stamped with CLOCK_MONOTONIC
 * (ns) under the node lock, so the file is in time order and the exact sum of enforced limits of
 * any set of GPUs (also across nodes: one clock per machine) is known at every instant
 * (capctl/simgpu/journal.py).  The first records (cause CREATED) hold every GPU's initial value.
 */
#define CAPSIM_JOURNAL_MAGIC "CAPJRNL1" /* 8 bytes, no terminator stored */
#define CAPSIM_JOURNAL_VERSION 1u
enum capsim_journal_cause { CAPSIM_JOURNAL_CREATED = 0, CAPSIM_JOURNAL_CHANGED = 1 };

typedef struct capsim_journal_header {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;       /* sizeof(capsim_journal_header): records start here */
    uint32_t record_bytes;       /* sizeof(capsim_journal_record) */
    uint32_t gpu_count;
    uint8_t node_id[16];         /* the node's (capsim_header.node_id) */
    uint64_t created_ns;         /* CLOCK_MONOTONIC at creation */
    uint64_t pad[2];
} capsim_journal_header;

typedef struct capsim_journal_record {
    uint64_t t_ns;               /* CLOCK_MONOTONIC, taken under the node lock */
    uint32_t gpu;                /* index on the node */
    uint32_t cause;              /* capsim_journal_cause */
    double enforced_w;           /* the new enforced limit */
    double limit_w;              /* the requested limit at that instant (for diagnosis) */
} capsim_journal_record;

/* Field descriptor used to export the layout to Python (numpy dtypes are built from it). */
typedef struct capsim_field {
    const char *name;
    size_t offset;
    const char *dtype;           /* numpy dtype string: "<f8", "<i4", "<u4", "<u8", "S32" ... */
} capsim_field;

/* Internal (not exported from the .so): the public control API is the EXPORT'ed capsim_* set. */
#define CAPSIM_INTERNAL __attribute__((visibility("hidden")))

/* physics.c */
CAPSIM_INTERNAL extern const capsim_profile capsim_profile_table[];
CAPSIM_INTERNAL extern const unsigned capsim_profile_table_len;
CAPSIM_INTERNAL void capsim_gpu_init(capsim_gpu *g, const capsim_profile *p, int profile, double now_s,
                     double inlet_c, double speed, double thermal_resistance_c_per_w, double tau_s);
CAPSIM_INTERNAL const char *capsim_profile_problem(const capsim_profile *p);
CAPSIM_INTERNAL void capsim_gpu_advance(capsim_gpu *g, double to_s);
CAPSIM_INTERNAL void capsim_gpu_refresh(capsim_gpu *g, double now_s);
CAPSIM_INTERNAL double capsim_gpu_enforced_w(const capsim_gpu *g);
CAPSIM_INTERNAL void capsim_gpu_driver_reload(capsim_gpu *g, double now_s);
CAPSIM_INTERNAL double capsim_power_average_w(const capsim_gpu *g, double now_s);

/* state.c */
CAPSIM_INTERNAL int capsim_lock(capsim_node *n);
CAPSIM_INTERNAL void capsim_unlock(capsim_node *n);
CAPSIM_INTERNAL double capsim_clock_now(capsim_node *n);
CAPSIM_INTERNAL int capsim_map_file(const char *path, capsim_node *out, char *err, size_t err_len);
CAPSIM_INTERNAL void capsim_unmap(capsim_node *n);
CAPSIM_INTERNAL int capsim_set_limit_locked(capsim_gpu *g, double limit_w);
CAPSIM_INTERNAL void capsim_journal_flush(capsim_node *n);

#endif
