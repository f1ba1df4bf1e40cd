/*
 * physics.c - the ONE implementation of simulated GPU physics (used by the NVML entry points, the
 * Python control API and the cluster simulator).  Every function works on capsim_gpu records so a
 * caller can step arrays of up to ~100k GPUs.  See docs/simulated-gpus.md for the equations.
 *
 * Model summary (per GPU, inputs held constant between events):
 *   DVFS      P(f) = P_static + (D - P_static) * (f / f_max)^3      (dynamic power ~ C V^2 f with
 *             V roughly proportional to f in the DVFS range -> ~f^3; e.g. Kim et al., "Power-aware
 *             GPU computing", and the cube law used by Zeus, Chung et al. NSDI'23 analysis)
 *             D = workload demand at f_max (W).  The SM clock is the largest 15 MHz step whose
 *             power fits under min(enforced limit, D); clock saturates at f_max.  With
 *             CAPSIM_F_CONTINUOUS_CLOCK (the continuous_clock "fault") it is not quantized: NVML
 *             then reports whole MHz off the 15 MHz grid (a plant for the pace loop's tests).
 *   step rate r(f) = speed / (m + (1 - m) * f_max / f)  - time per step is a memory-bound part m
 *             that does not scale with the SM clock plus a compute part scaling with 1/f
 *             (roofline reasoning; the same split underlies Zeus/Perseus power-vs-time curves).
 *             r is increasing and concave in the cap because f(cap) is concave and r(f) concave.
 *   power_factor  per-GPU power efficiency k_g (manufacturing variation as Sinha et al., "Not All
 *             GPUs Are Created Equal", SC'22, found it: same-SKU GPUs need different power for the
 *             same clock, so under a binding power limit they run at different clocks; 8 % average,
 *             up to 22 % performance variation).  The dynamic part of the power is scaled:
 *             P_g(f) = P_static + k_g * (D - P_static) * (f / f_max)^3, D being the workload's
 *             demand on a nominal part (k = 1).  Uncapped (at f_max) a part draws
 *             P_static + k_g (D - P_static); under a cap its clock is f_max ((cap - P_static) /
 *             (k_g (D - P_static)))^(1/3): lower for a less efficient part, visible through the
 *             NVML SM clock (and power at f_max).  A clock loss L at a binding cap means
 *             k = (1 - L)^-3 (cube law).
 *   speed     a pure step-rate multiplier (changes neither clock nor power; invisible to NVML).
 *             The standalone driver's seeded default variation still uses it (see state.c,
 *             capsim_create); the cluster simulator draws power_factor instead.
 *   thermal   first-order RC: tau dT/dt = T_inlet + R * P - T   (exact exponential solution).
 *   slowdown  at T >= slowdown threshold the SM clock drops to 70% (HW_SLOWDOWN, HW_THERMAL and
 *             SW_THERMAL reason bits) until T <= threshold - 5 C (hysteresis; estimate).
 *             At T >= shutdown threshold the GPU shuts down (falls off the bus: GPU_IS_LOST).
 *   power reading: 1 s moving average on Ampere+ except GA100 (nvml.h, nvmlDeviceGetPowerUsage),
 *             instantaneous on GA100 and older; the true instantaneous power drives the thermals.
 * Integration is event driven and exact for any dt: between events (threshold crossings,
 * foreign-writer writes) inputs are constant, so T, energy and progress have closed forms.
 */
#include "simgpu.h"

#include <math.h>
#include <nvml.h>
#include <string.h>

/*
 * Device profiles.  Limits are NVML limit constraints / default limit as nvidia-smi -q reports
 * them; clocks are max SM (boost) clocks from the datasheets; temperatures are the driver's
 * thresholds as nvidia-smi -q shows them.  "est." marks an engineering estimate.
 *  H100-SXM: H100 SXM5 datasheet (700 W max TDP, 1980 MHz max boost); limit constraints 200-700 W
 *            (nvidia-smi -q on DGX H100); idle ~75 W (est., DGX H100 idle readings); thresholds
 *            87/89/92 C max-operating/slowdown/shutdown from the H100 product brief (PCIe, assumed
 *            for SXM); HBM3 clock 2619 MHz; PCI id 0x2330.
 *  H200:     same Hopper GH100 die and 700 W limit range (H200 datasheet, SXM 700 W); HBM3e 3201 MHz;
 *            PCI id 0x2335; thresholds as H100 (est.).
 *  A100-SXM4: A100 datasheet (400 W TDP, 1410 MHz boost); constraints 100-400 W (nvidia-smi -q,
 *            DGX A100); thresholds 85/89/92 C (nvidia-smi -q, DGX A100, driver 525.60.13);
 *            idle ~55 W (est.); PCI id 0x20B2 (80 GB); GA100 reports instantaneous power.
 *  V100-SXM2: V100 datasheet (300 W, 1530 MHz boost); constraints 150-300 W (nvidia-smi -q);
 *            thresholds 83/87/90 C (est. from nvidia-smi -q captures); idle ~40 W (est.).
 *  A40:      A40 datasheet (300 W, 1740 MHz boost); constraints 100-300 W (est.); passive board,
 *            thresholds 88/95/98 C (est.); idle ~30 W (est.).
 * Thermal resistance / time constant are estimates chosen so that a GPU at its default limit
 * and 25 C inlet settles at ~65-70 C in ~20 s (typical air-cooled SXM behaviour); each GPU gets
 * its own values (seeded spread) and tests override them to make hot GPUs.
 * memory_bound_fraction 0.3 is an estimate for LLM training steps (mixed GEMM / memory phases).
 */
const capsim_profile capsim_profile_table[] = {
    {"H100-SXM", "NVIDIA H100 80GB HBM3", 200.0, 700.0, 700.0, 75.0, 1980.0, 345.0, 345.0, 2619.0,
     1755.0, 89.0, 92.0, 87.0, 95.0, 0.060, 20.0, 0.30, 0x233010DEu, NVML_DEVICE_ARCH_HOPPER, 1u, 0u},
    {"H200", "NVIDIA H200", 200.0, 700.0, 700.0, 75.0, 1980.0, 345.0, 345.0, 3201.0, 1755.0, 89.0,
     92.0, 87.0, 95.0, 0.060, 20.0, 0.30, 0x233510DEu, NVML_DEVICE_ARCH_HOPPER, 1u, 0u},
    {"A100-SXM4", "NVIDIA A100-SXM4-80GB", 100.0, 400.0, 400.0, 55.0, 1410.0, 210.0, 210.0, 1593.0,
     1290.0, 89.0, 92.0, 85.0, 95.0, 0.100, 20.0, 0.30, 0x20B210DEu, NVML_DEVICE_ARCH_AMPERE, 0u, 0u},
    {"V100-SXM2", "Tesla V100-SXM2-32GB", 150.0, 300.0, 300.0, 40.0, 1530.0, 135.0, 135.0, 877.0,
     1372.0, 87.0, 90.0, 83.0, 85.0, 0.130, 20.0, 0.30, 0x1DB510DEu, NVML_DEVICE_ARCH_VOLTA, 0u, 0u},
    {"A40", "NVIDIA A40", 100.0, 300.0, 300.0, 30.0, 1740.0, 210.0, 210.0, 7251.0, 1500.0, 95.0,
     98.0, 88.0, 95.0, 0.150, 25.0, 0.30, 0x223510DEu, NVML_DEVICE_ARCH_AMPERE, 1u, 0u},
};
const unsigned capsim_profile_table_len =
    (unsigned)(sizeof capsim_profile_table / sizeof capsim_profile_table[0]);

#define R_IDLE nvmlClocksEventReasonGpuIdle
#define R_SW_POWER_CAP nvmlClocksEventReasonSwPowerCap
#define R_HW_SLOWDOWN nvmlClocksThrottleReasonHwSlowdown
#define R_SW_THERMAL nvmlClocksEventReasonSwThermalSlowdown
#define R_HW_THERMAL nvmlClocksThrottleReasonHwThermalSlowdown

double capsim_gpu_enforced_w(const capsim_gpu *g)
{
    double e = g->limit_w;
    if (g->oob_limit_w > 0.0 && g->oob_limit_w < e)
        e = g->oob_limit_w;
    return e;
}

typedef struct op {
    double clock_mhz, power_w, rate;
    uint64_t reasons;
} op_t;

static double quantize_down(double f_mhz)
{
    return floor(f_mhz / CAPSIM_CLOCK_STEP_MHZ + 1e-9) * CAPSIM_CLOCK_STEP_MHZ;
}

/* Operating point for constant inputs: the DVFS and step-rate model described at the top. */
static op_t operating_point(const capsim_gpu *g, double enforced_w, int throttled, int lost,
                            int quantized)
{
    op_t o = {0.0, 0.0, 0.0, 0};
    if (lost)
        return o;
    double fmax = g->max_sm_clock_mhz, fmin = g->min_sm_clock_mhz, ps = g->idle_w;
    if (g->demand_w <= 0.0) {
        o.clock_mhz = g->idle_sm_clock_mhz;
        o.power_w = ps;
        o.reasons = R_IDLE;
        if (throttled)
            o.reasons |= R_HW_SLOWDOWN | R_HW_THERMAL | R_SW_THERMAL;
        return o;
    }
    double dyn = (g->demand_w - ps) * g->power_factor; /* this part's dynamic power at f_max */
    if (dyn < 0.0)
        dyn = 0.0;
    double demand = ps + dyn;                          /* this part's uncapped draw */
    double f = fmax;
    if (demand > enforced_w && dyn > 0.0) {
        double x = (enforced_w - ps) / dyn;
        f = x > 0.0 ? fmax * cbrt(x) : fmin;
        if (quantized)
            f = quantize_down(f);
        if (f < fmin)
            f = fmin;
        if (f > fmax)
            f = fmax;
        o.reasons |= R_SW_POWER_CAP;
    }
    if (throttled) {
        f = CAPSIM_THROTTLE_FACTOR * f;
        if (quantized)
            f = quantize_down(f);
        if (f < fmin)
            f = fmin;
        o.reasons |= R_HW_SLOWDOWN | R_HW_THERMAL | R_SW_THERMAL;
    }
    if (g->stuck_clock_fraction > 0.0) { /* fault: held in slowdown whatever the cap */
        double fs = g->stuck_clock_fraction * fmax;
        if (quantized)
            fs = quantize_down(fs);
        if (fs < fmin)
            fs = fmin;
        if (fs < f) { /* the slowdown holds the clock, not the power limit: only it is reported */
            f = fs;
            o.reasons &= ~(uint64_t)R_SW_POWER_CAP;
        }
        o.reasons |= R_HW_SLOWDOWN;
    }
    double r = f / fmax;
    o.clock_mhz = f;
    o.power_w = ps + dyn * r * r * r;
    double m = g->memory_bound_fraction;
    o.rate = g->speed / (m + (1.0 - m) / r);
    return o;
}

/* --- 1 s moving average over a short history of constant-power segments ------------------ */

static void seg_push(capsim_gpu *g, double t, double p)
{
    const double w = CAPSIM_POWER_WINDOW_S;
    int n = g->seg_n;
    if (n > 0 && g->seg_p[n - 1] == p)
        return;
    if (n > 0 && g->seg_t[n - 1] >= t) { /* same instant: replace */
        g->seg_p[n - 1] = p;
        return;
    }
    while (n >= 2 && g->seg_t[1] <= t - w) { /* oldest segment left the window */
        memmove(&g->seg_t[0], &g->seg_t[1], (size_t)(n - 1) * sizeof(double));
        memmove(&g->seg_p[0], &g->seg_p[1], (size_t)(n - 1) * sizeof(double));
        n--;
    }
    if (n == CAPSIM_SEGMENTS) { /* merge the two oldest (energy preserving within the window) */
        double t0 = g->seg_t[0] > t - w ? g->seg_t[0] : t - w;
        double t1 = g->seg_t[1], t2 = g->seg_t[2];
        double pm = t2 > t0 ? (g->seg_p[0] * (t1 - t0) + g->seg_p[1] * (t2 - t1)) / (t2 - t0)
                            : g->seg_p[1];
        g->seg_t[0] = t0;
        g->seg_p[0] = pm;
        memmove(&g->seg_t[1], &g->seg_t[2], (size_t)(n - 2) * sizeof(double));
        memmove(&g->seg_p[1], &g->seg_p[2], (size_t)(n - 2) * sizeof(double));
        n--;
    }
    g->seg_t[n] = t;
    g->seg_p[n] = p;
    g->seg_n = n + 1;
}

double capsim_power_average_w(const capsim_gpu *g, double now_s)
{
    const double w = CAPSIM_POWER_WINDOW_S;
    int n = g->seg_n;
    if (n <= 0)
        return g->power_w;
    double lo = now_s - w, sum = 0.0;
    for (int i = n - 1; i >= 0; i--) {
        double start = i == 0 ? lo : g->seg_t[i];
        double end = i == n - 1 ? now_s : g->seg_t[i + 1];
        if (start < lo)
            start = lo;
        if (end > now_s)
            end = now_s;
        if (end > start)
            sum += g->seg_p[i] * (end - start);
        if (g->seg_t[i] <= lo)
            break;
    }
    return sum / w;
}

/* --- integration ---------------------------------------------------------------------------- */

static void store_outputs(capsim_gpu *g, const op_t *o, double enforced)
{
    g->sm_clock_mhz = o->clock_mhz;
    g->power_w = o->power_w;
    g->rate = o->rate;
    g->reasons = o->reasons;
    g->enforced_w = enforced;
}

enum { EV_NONE, EV_HOT, EV_COOL, EV_SHUTDOWN, EV_FOREIGN };

void capsim_gpu_advance(capsim_gpu *g, double to_s)
{
    double t = g->t_s;
    for (int iter = 0; iter < 1000000; iter++) {
        int lost = (g->flags & CAPSIM_F_LOST) != 0;
        double slow = g->slowdown_temp_c, rel = slow - CAPSIM_THERMAL_HYSTERESIS_C;
        if (!lost) {
            if (!(g->flags & CAPSIM_F_THROTTLED) && g->temp_c >= slow)
                g->flags |= CAPSIM_F_THROTTLED;
            else if ((g->flags & CAPSIM_F_THROTTLED) && g->temp_c <= rel)
                g->flags &= ~CAPSIM_F_THROTTLED;
            if ((g->flags & CAPSIM_F_THROTTLED) && g->temp_c >= g->shutdown_temp_c) {
                g->flags |= CAPSIM_F_LOST | CAPSIM_F_THERMAL_SHUTDOWN;
                g->flags &= ~CAPSIM_F_THROTTLED;
                lost = 1;
            }
        } else {
            g->flags &= ~CAPSIM_F_THROTTLED;
        }
        int thr = (g->flags & CAPSIM_F_THROTTLED) != 0;
        double enforced = capsim_gpu_enforced_w(g);
        op_t o = operating_point(g, enforced, thr, lost, !(g->flags & CAPSIM_F_CONTINUOUS_CLOCK));
        store_outputs(g, &o, enforced);
        seg_push(g, t, o.power_w);
        if (!(t < to_s))
            break;
        double tss = g->inlet_c + g->thermal_resistance_c_per_w * o.power_w;
        double tau = g->tau_s > 1e-6 ? g->tau_s : 1e-6;
        double tn = to_s;
        int ev = EV_NONE;
        if ((g->flags & CAPSIM_F_FOREIGN) && g->foreign_next_s < tn) {
            tn = g->foreign_next_s > t ? g->foreign_next_s : t;
            ev = EV_FOREIGN;
        }
        if (!lost) {
            double x = 0.0;
            int e = EV_NONE;
            if (!thr && tss > slow) {
                x = slow;
                e = EV_HOT;
            } else if (thr && tss < rel) {
                x = rel;
                e = EV_COOL;
            } else if (thr && tss > g->shutdown_temp_c) {
                x = g->shutdown_temp_c;
                e = EV_SHUTDOWN;
            }
            if (e != EV_NONE) {
                double tc = t + tau * log((g->temp_c - tss) / (x - tss));
                if (tc < tn) {
                    tn = tc > t ? tc : t;
                    ev = e;
                }
            }
        }
        double dt = tn - t;
        g->temp_c = tss + (g->temp_c - tss) * exp(-dt / tau);
        g->energy_j += o.power_w * dt;
        g->progress += o.rate * dt;
        t = tn;
        switch (ev) {
        case EV_HOT:
            g->temp_c = slow;
            break;
        case EV_COOL:
            g->temp_c = rel;
            break;
        case EV_SHUTDOWN:
            g->temp_c = g->shutdown_temp_c;
            break;
        case EV_FOREIGN:
            if (g->journal_event_s <= 0.0 && g->foreign_limit_w != g->limit_w) {
                g->journal_event_s = t; /* journaled with its own time (state.c) */
                g->limit_w = g->foreign_limit_w;
                g->journal_event_w = capsim_gpu_enforced_w(g);
            }
            g->limit_w = g->foreign_limit_w;
            g->set_count++;
            if (g->foreign_period_s > 0.0) {
                double k = floor((to_s - g->foreign_next_s) / g->foreign_period_s);
                g->foreign_next_s += g->foreign_period_s * (k > 1.0 ? k : 1.0);
            } else {
                g->flags &= ~CAPSIM_F_FOREIGN;
            }
            break;
        default:
            break;
        }
    }
    if (to_s > g->t_s)
        g->t_s = to_s;
}

void capsim_gpu_refresh(capsim_gpu *g, double now_s)
{
    if (now_s < g->t_s) /* a clock that went backwards (reboot with a real clock): re-base */
        g->t_s = now_s;
    capsim_gpu_advance(g, now_s);
    g->power_avg_w = g->averaged_power ? capsim_power_average_w(g, now_s) : g->power_w;
}

/* Initialise *g as a GPU of profile *p (`profile`: its index in the built-in table, -1 for a custom
 * profile; informational only, the physics reads the constants copied here). */
void capsim_gpu_init(capsim_gpu *g, const capsim_profile *p, int profile, double now_s, double inlet_c,
                     double speed, double thermal_resistance_c_per_w, double tau_s)
{
    memset(g, 0, sizeof *g);
    g->profile = profile;
    g->idle_w = p->idle_w;
    g->max_sm_clock_mhz = p->max_sm_clock_mhz;
    g->min_sm_clock_mhz = p->min_sm_clock_mhz;
    g->idle_sm_clock_mhz = p->idle_sm_clock_mhz;
    g->averaged_power = p->averaged_power ? 1u : 0u;
    g->t_s = now_s;
    g->min_limit_w = p->min_limit_w;
    g->max_limit_w = p->max_limit_w;
    g->default_limit_w = p->default_limit_w;
    g->limit_w = p->default_limit_w;
    g->memory_bound_fraction = p->memory_bound_fraction;
    g->inlet_c = inlet_c;
    g->thermal_resistance_c_per_w = thermal_resistance_c_per_w > 0.0 ? thermal_resistance_c_per_w
                                                                     : p->thermal_resistance_c_per_w;
    g->tau_s = tau_s > 0.0 ? tau_s : p->tau_s;
    g->speed = speed > 0.0 ? speed : 1.0;
    g->power_factor = 1.0;
    g->slowdown_temp_c = p->slowdown_temp_c;
    g->shutdown_temp_c = p->shutdown_temp_c;
    g->max_operating_temp_c = p->max_operating_temp_c;
    g->temp_c = inlet_c + g->thermal_resistance_c_per_w * p->idle_w; /* idle steady state */
    capsim_gpu_refresh(g, now_s);
}

void capsim_gpu_driver_reload(capsim_gpu *g, double now_s)
{
    capsim_gpu_refresh(g, now_s);
    g->limit_w = g->default_limit_w; /* a reload loses the runtime limit setting */
    g->energy_j = 0.0;               /* the energy counter counts since the driver was loaded */
    capsim_gpu_refresh(g, now_s);
}

/* --- exported pure functions ------------------------------------------------------------------ */

/*
 * Steady-state step rate, power and SM clock of the GPU described by *params (profile, demand,
 * memory-bound fraction, speed, inlet, thermal resistance, thresholds; its limits are ignored)
 * for each cap_w[i] (W; the enforced limit).  thermal != 0 includes thermal slowdown: a GPU whose
 * steady temperature reaches the slowdown threshold cycles between full and throttled clocks; the
 * result is the exact time average over that limit cycle.  quantized != 0 uses the 15 MHz clock
 * grid (what the simulator does); 0 gives the continuous curve.  Returns 0, or -1 on bad input.
 */
int capsim_steady_state(const capsim_gpu *params, const double *cap_w, size_t n, int thermal,
                        int quantized, double *rate, double *power_w, double *clock_mhz)
{
    if (!params || !cap_w || !rate || !power_w || !clock_mhz)
        return -1;
    capsim_gpu g = *params;
    double slow = g.slowdown_temp_c, rel = slow - CAPSIM_THERMAL_HYSTERESIS_C;
    for (size_t i = 0; i < n; i++) {
        op_t a = operating_point(&g, cap_w[i], 0, 0, quantized);
        double ta = g.inlet_c + g.thermal_resistance_c_per_w * a.power_w;
        op_t res = a;
        if (thermal && ta >= slow) {
            op_t b = operating_point(&g, cap_w[i], 1, 0, quantized);
            double tb = g.inlet_c + g.thermal_resistance_c_per_w * b.power_w;
            if (tb >= g.shutdown_temp_c) {
                res.clock_mhz = res.power_w = res.rate = 0.0;
            } else if (tb >= rel || ta <= slow) {
                res = b;
            } else {
                double t_heat = log((ta - rel) / (ta - slow));
                double t_cool = log((slow - tb) / (rel - tb));
                double s = t_heat + t_cool;
                res.rate = (a.rate * t_heat + b.rate * t_cool) / s;
                res.power_w = (a.power_w * t_heat + b.power_w * t_cool) / s;
                res.clock_mhz = (a.clock_mhz * t_heat + b.clock_mhz * t_cool) / s;
            }
        }
        rate[i] = res.rate;
        power_w[i] = res.power_w;
        clock_mhz[i] = res.clock_mhz;
    }
    return 0;
}

/* Fill *out with the defaults of profile `profile` (for steady_state parameters). */
int capsim_default_gpu(int profile, capsim_gpu *out)
{
    if (!out || profile < 0 || (unsigned)profile >= capsim_profile_table_len)
        return -1;
    capsim_gpu_init(out, &capsim_profile_table[profile], profile, 0.0, 25.0, 1.0, 0.0, 0.0);
    return 0;
}

/* What is wrong with profile *p ("" when a node may be built from it).  The Python front end
 * (capctl/simgpu/profiles.py) checks the same ranges first and names the file:line or option;
 * this is the driver's own guard.  Ranges: see docs/simulated-gpus.md, "Custom profiles". */
const char *capsim_profile_problem(const capsim_profile *p)
{
    if (!p)
        return "profile is NULL";
    if (!memchr(p->name, 0, sizeof p->name) || !p->name[0])
        return "name must be 1..31 characters";
    if (!memchr(p->nvml_name, 0, sizeof p->nvml_name) || !p->nvml_name[0])
        return "nvml_name must be 1..63 characters";
    const double v[] = {p->min_limit_w, p->max_limit_w, p->default_limit_w, p->idle_w,
                        p->max_sm_clock_mhz, p->min_sm_clock_mhz, p->idle_sm_clock_mhz,
                        p->mem_clock_mhz, p->max_video_clock_mhz, p->slowdown_temp_c,
                        p->shutdown_temp_c, p->max_operating_temp_c, p->mem_max_temp_c,
                        p->thermal_resistance_c_per_w, p->tau_s, p->memory_bound_fraction};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (!isfinite(v[i]))
            return "every number must be finite";
    if (p->min_limit_w < 1.0 || p->max_limit_w > 5000.0 || p->min_limit_w > p->max_limit_w)
        return "limit constraints need 1 <= min_limit_w <= max_limit_w <= 5000 W";
    if (p->default_limit_w < p->min_limit_w || p->default_limit_w > p->max_limit_w)
        return "default_limit_w must lie within the limit constraints";
    if (p->idle_w <= 0.0 || p->idle_w >= p->min_limit_w)
        return "idle_w must be > 0 and below min_limit_w";
    if (p->max_sm_clock_mhz < 100.0 || p->max_sm_clock_mhz > 5000.0 || p->min_sm_clock_mhz < 15.0 ||
        p->min_sm_clock_mhz > p->max_sm_clock_mhz || p->idle_sm_clock_mhz < 0.0 ||
        p->idle_sm_clock_mhz > p->max_sm_clock_mhz)
        return "clocks need 15 <= min_sm_clock_mhz <= max_sm_clock_mhz <= 5000 (max >= 100), "
               "0 <= idle_sm_clock_mhz <= max_sm_clock_mhz";
    if (p->slowdown_temp_c < 30.0 || p->shutdown_temp_c > 150.0 ||
        p->slowdown_temp_c > p->shutdown_temp_c - 0.5 || p->max_operating_temp_c < 20.0 ||
        p->max_operating_temp_c > 150.0 || p->mem_max_temp_c < 20.0 || p->mem_max_temp_c > 150.0)
        return "thresholds need 30 <= slowdown_temp_c <= shutdown_temp_c - 0.5, shutdown_temp_c <= 150, "
               "max_operating_temp_c and mem_max_temp_c in 20..150 C";
    if (p->thermal_resistance_c_per_w < 0.001 || p->thermal_resistance_c_per_w > 1.0 || p->tau_s < 0.01 ||
        p->tau_s > 3600.0 || p->memory_bound_fraction < 0.0 || p->memory_bound_fraction > 0.99)
        return "thermal_resistance_c_per_w 0.001..1, tau_s 0.01..3600, memory_bound_fraction 0..0.99";
    if (p->mem_clock_mhz < 0.0 || p->mem_clock_mhz > 50000.0 || p->max_video_clock_mhz < 0.0 ||
        p->max_video_clock_mhz > 5000.0)
        return "mem_clock_mhz 0..50000, max_video_clock_mhz 0..5000";
    return "";
}

/* Advance an array of GPU records to time to_s (cluster simulator; no locking). */
void capsim_step_array(capsim_gpu *gpus, size_t n, double to_s)
{
    for (size_t i = 0; i < n; i++)
        capsim_gpu_refresh(&gpus[i], to_s);
}
