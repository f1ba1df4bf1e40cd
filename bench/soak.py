"""Soak: a real coordinator process with many simulated lightweight agents for a long time.

Issue 7: "1,000 simulated agents for 10 minutes: RSS growth under 5%, no lost streams".

The coordinator is the real daemon (``capctl-coordinator``) on a unix socket with the example
policy ``examples/policies/cluster-1000node.yaml`` (1,000 nodes x 8 H100 in 10 rows of 25 racks;
interval and lease overridden for the soak). The agents are asyncio coroutines speaking the real
AgentLink protocol (docs/protocol.md) over grpc.aio, spread over ``--procs`` worker processes and
``--channels`` HTTP/2 connections per process: hello with 8 GPUs and one job, telemetry every
interval (power = min(demand, cap)), a ``CapAck`` with the read-back for every plan, and job churn
(each agent ends its job and starts a new one every ``--churn-s`` seconds, so per-job state must be
freed for memory to stay flat).

Measured:
* coordinator RSS (psutil) every ``--sample-s``; baseline = mean of the first 3 samples after the
  warm-up (``--warmup-s``, default 20% of the run, at least until every agent is welcomed), end =
  mean of the last 3 samples; growth = (end - baseline) / baseline (goal < 5 %). Give short runs a
  warm-up of at least ~150 s: the coordinator's bounded histories (60 s throttle windows, per-GPU
  model bins, ack/RTT rings) fill during the first minutes; a 60 s warm-up measures their filling
  (+8.6 % in 2 min), a 150 s one a flat line (-0.4 %);
* lost streams: streams that ended while the soak was not stopping (goal 0), and reconnects;
* plans, acks and telemetry messages exchanged; stale nodes seen in ``Status`` samples;
* the largest sum of enforced caps (read back by the agents) vs the budget.

Usage::

    .venv/bin/python bench/soak.py                       # 1,000 agents, 10 minutes
    .venv/bin/python bench/soak.py --duration-s 120 --warmup-s 150   # a short run
    .venv/bin/python bench/soak.py --agents 50 --duration-s 20

Prints progress to stderr and, as its last line on stdout, one JSON object with the figures.
Exit status 0 when the goals are met, 1 otherwise. Stops everything it starts. Network: one unix
socket in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from capctl import lifeline  # noqa: E402 (after the path insert)

POLICY_SRC = REPO / "examples" / "policies" / "cluster-1000node.yaml"
GPUS_PER_NODE = 8


# ----------------------------------------------------------------------------------------------
# worker: N lightweight agents in one process (asyncio + grpc.aio)

class AgentStats:
    def __init__(self) -> None:
        self.welcomed = 0
        self.lost = 0
        self.reconnects = 0
        self.plans = 0
        self.acks = 0
        self.telemetry = 0
        self.job_events = 0
        self.errors: list[str] = []


async def run_agent(idx: int, node: str, channel, stats: AgentStats, stop: asyncio.Event, interval_s: float,
                    churn_s: float, caps: dict, rng: random.Random) -> None:
    from capctl.v1 import capctl_pb2 as pb
    from capctl.v1 import capctl_pb2_grpc as pb_grpc

    stub = pb_grpc.AgentLinkStub(channel)
    gpus = [pb.GpuInfo(index=i, uuid=f"GPU-soak-{idx:04d}-{i}", name="NVIDIA H100 80GB HBM3", minor_number=i,
                       pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", min_cap_w=200.0, max_cap_w=700.0,
                       default_cap_w=700.0, slowdown_temp_c=87.0, shutdown_temp_c=92.0, max_sm_clock_mhz=1980)
            for i in range(GPUS_PER_NODE)]
    cap = {i: 400.0 for i in range(GPUS_PER_NODE)}
    demand = {i: 550.0 + 100.0 * rng.random() for i in range(GPUS_PER_NODE)}
    job_no = 0
    first = True
    while not stop.is_set():
        job_id = f"{idx * 100000 + job_no}"
        binding = pb.JobBinding(job_id=job_id, node=node, gpu_indices=list(range(GPUS_PER_NODE)), user="soak",
                                partition="train", start_time_s=time.time())
        hello = pb.AgentHello(protocol_version="capctl.v1", node=node, agent_version="soak", driver_version="soak",
                              simulated=True, gpus=gpus, jobs=[binding])
        call = stub.Connect()
        outq: asyncio.Queue = asyncio.Queue(maxsize=256)
        welcomed = asyncio.Event()

        def telemetry_msg(seq: int):
            return pb.AgentMessage(telemetry=pb.NodeTelemetry(node=node, timestamp_s=time.time(), seq=seq, gpus=[
                pb.GpuTelemetry(index=i, power_w=min(demand[i], cap[i]), cap_w=cap[i], enforced_w=cap[i],
                                temp_c=45.0 + 0.05 * min(demand[i], cap[i]),
                                sm_clock_mhz=1980 if cap[i] >= demand[i] else int(1980 * (cap[i] / demand[i]) ** 0.4),
                                clocks_event_reasons=[] if cap[i] >= demand[i] else ["SW_POWER_CAP"],
                                utilization_pct=95.0, energy_j=0.0, job_id=job_id, cap_state="OK")
                for i in range(GPUS_PER_NODE)]))

        async def writer():
            await call.write(pb.AgentMessage(hello=hello))
            while True:
                msg = await outq.get()
                if msg is None:
                    await call.done_writing()
                    return
                await call.write(msg)

        async def reader():
            async for msg in call:
                kind = msg.WhichOneof("body")
                if kind == "welcome":
                    stats.welcomed += 1 if first else 0
                    welcomed.set()
                elif kind == "plan":
                    stats.plans += 1
                    for c in msg.plan.caps:
                        if c.index in cap:
                            cap[c.index] = min(max(c.cap_w, 200.0), 700.0)
                            caps[(node, c.index)] = cap[c.index]
                    ack = pb.CapAck(seq=msg.plan.seq, ok=True, gpus=[
                        pb.GpuTelemetry(index=c.index, cap_w=cap[c.index], enforced_w=cap[c.index],
                                        power_w=min(demand[c.index], cap[c.index]), cap_state="OK", job_id=job_id)
                        for c in msg.plan.caps if c.index in cap])
                    stats.acks += 1
                    outq.put_nowait(pb.AgentMessage(ack=ack))

        async def ticker():
            nonlocal job_id, job_no
            await welcomed.wait()
            seq = 0
            next_churn = time.monotonic() + churn_s * (0.5 + rng.random())
            await asyncio.sleep(rng.random() * interval_s)
            while not stop.is_set():
                seq += 1
                if outq.qsize() < 200:
                    outq.put_nowait(telemetry_msg(seq))
                    stats.telemetry += 1
                if churn_s > 0 and time.monotonic() >= next_churn:
                    outq.put_nowait(pb.AgentMessage(job_ended=pb.JobEnded(job_id=job_id, node=node)))
                    job_no += 1
                    job_id = f"{idx * 100000 + job_no}"
                    b = pb.JobBinding(job_id=job_id, node=node, gpu_indices=list(range(GPUS_PER_NODE)), user="soak",
                                      partition="train", start_time_s=time.time())
                    outq.put_nowait(pb.AgentMessage(job_started=pb.JobStarted(binding=b)))
                    stats.job_events += 2
                    next_churn = time.monotonic() + churn_s
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except asyncio.TimeoutError:
                    pass
            outq.put_nowait(None)

        tasks = [asyncio.ensure_future(t()) for t in (writer, reader, ticker)]
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            outq.put_nowait(None)
            await asyncio.wait(tasks, timeout=5.0)
        ended_badly = not stop.is_set()
        for t in tasks:
            t.cancel()
        stopper.cancel()
        call.cancel()
        if ended_badly:
            stats.lost += 1
            err = next((t.exception() for t in done if t is not stopper and not t.cancelled() and t.exception()), None)
            if len(stats.errors) < 10:
                stats.errors.append(f"{node}: {type(err).__name__ if err else 'stream ended'}: {str(err)[:200]}")
            stats.reconnects += 1
            first = False
            await asyncio.sleep(0.5 + rng.random())


async def worker_main(args) -> dict:
    import grpc

    stats = AgentStats()
    stop = asyncio.Event()
    caps: dict = {}
    rng = random.Random(args.seed + args.worker_index)
    channels = [grpc.aio.insecure_channel(args.address, options=[("grpc.max_receive_message_length", 8 << 20)])
                for _ in range(args.channels)]
    indices = list(range(args.worker_index, args.agents, args.procs))
    tasks = [asyncio.ensure_future(run_agent(i, f"gpu{i + 1:04d}", channels[k % len(channels)], stats, stop,
                                             args.interval_s, args.churn_s, caps, rng))
             for k, i in enumerate(indices)]
    deadline = time.monotonic() + args.duration_s
    max_sum = 0.0
    while time.monotonic() < deadline:
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        max_sum = max(max_sum, sum(caps.values()))
    stop.set()
    await asyncio.wait(tasks, timeout=15.0)
    for ch in channels:
        await ch.close()
    return {"agents": len(indices), "welcomed": stats.welcomed, "lost": stats.lost, "reconnects": stats.reconnects,
            "plans": stats.plans, "acks": stats.acks, "telemetry": stats.telemetry, "job_events": stats.job_events,
            "errors": stats.errors, "caps": {f"{k[0]}/{k[1]}": v for k, v in caps.items()}, "max_sum_w": max_sum}


# ----------------------------------------------------------------------------------------------
# driver

def soak_policy(path: Path, interval_s: float, lease_s: float) -> dict:
    """Write the 1,000-node example policy with the soak's interval and lease; returns its limits."""
    import yaml

    text = POLICY_SRC.read_text()
    text = re.sub(r"^interval_s: .*$", f"interval_s: {interval_s:g}", text, flags=re.M)
    text = re.sub(r"^failsafe: .*$", f"failsafe: {{lease_s: {lease_s:g}, safe_cap_w: null}}", text, flags=re.M)
    text = re.sub(r"^prolog: .*$", "prolog: {on_unreachable: fail-open, timeout_s: 5}", text, flags=re.M)
    path.write_text(text)
    data = yaml.safe_load(text)
    return {"budget_w": float(data["budget_w"])}


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=1000, help="simulated agents (nodes gpu0001..; at most 1000)")
    p.add_argument("--duration-s", type=float, default=600.0, help="soak duration in seconds (default 600)")
    p.add_argument("--warmup-s", type=float, default=None, help="seconds before the RSS baseline (default 20%%)")
    p.add_argument("--interval-s", type=float, default=2.0, help="coordinator interval for the soak (s)")
    p.add_argument("--lease-s", type=float, default=20.0, help="lease (s)")
    p.add_argument("--churn-s", type=float, default=60.0, help="each agent replaces its job this often (s; 0 = never)")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS / status sampling period (s)")
    p.add_argument("--procs", type=int, default=2, help="agent worker processes")
    p.add_argument("--channels", type=int, default=25, help="gRPC connections per worker process")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    # internal: worker mode
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_index is not None:
        lifeline.watch_parent()  # a killed bench leaves no worker behind
        out = asyncio.run(worker_main(args))
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    if not 1 <= args.agents <= 1000:
        p.error("--agents: 1..1000 (the example policy has 1,000 nodes)")
    return drive(args)


def drive(args) -> int:
    import psutil

    from capctl.demo.processes import ProcessGroup, start_coordinator, wait_until

    warmup_s = args.warmup_s if args.warmup_s is not None else 0.2 * args.duration_s
    work = Path(tempfile.mkdtemp(prefix="capctl-soak-"))
    limits = soak_policy(work / "policy.yaml", args.interval_s, args.lease_s)
    group = ProcessGroup()
    workers: list[subprocess.Popen] = []
    result: dict = {}
    try:
        coord = group.add(start_coordinator(work, work / "policy.yaml", metrics_port=-1,
                                            extra_args=["--log-level", "WARNING"]))
        coord.wait_serving(60.0)
        cproc = psutil.Process(coord.pid)
        log(f"coordinator pid {coord.pid} on {coord.address}; starting {args.agents} agents in {args.procs} processes")
        t_start = time.monotonic()
        total_s = warmup_s + args.duration_s
        for w in range(args.procs):
            argv = [sys.executable, __file__, "--worker-index", str(w), "--address", coord.address,
                    "--agents", str(args.agents), "--procs", str(args.procs), "--channels", str(args.channels),
                    "--duration-s", str(total_s), "--interval-s", str(args.interval_s), "--churn-s", str(args.churn_s),
                    "--seed", str(args.seed)]
            workers.append(lifeline.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                            cwd=str(REPO), start_new_session=True))

        def live_nodes() -> int:
            st = coord.status(timeout_s=10.0)
            return sum(1 for n in st.nodes if not n.stale)

        wait_until(lambda: live_nodes() >= args.agents, max(60.0, warmup_s), 1.0,
                   f"all {args.agents} agents connected", proc=coord)
        t_connected = time.monotonic() - t_start
        log(f"all agents connected after {t_connected:.1f} s")
        samples: list[tuple[float, int]] = []
        stale_seen = 0
        min_live = args.agents
        solve_s: list[float] = []
        baseline_t = t_start + max(warmup_s, t_connected + 2 * args.interval_s)
        end_t = t_start + total_s - 1.0
        next_sample = time.monotonic()
        while time.monotonic() < end_t:
            if any(w.poll() is not None for w in workers):
                raise RuntimeError("an agent worker process exited early")
            if coord.poll() is not None:
                raise RuntimeError(f"coordinator exited: {coord.log_tail()}")
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + args.sample_s
                try:
                    st = coord.status(timeout_s=10.0)
                    live = sum(1 for n in st.nodes if not n.stale)
                    min_live = min(min_live, live)
                    stale_seen = max(stale_seen, args.agents - live)
                    solve_s.append(st.last_solve_s)
                except Exception as exc:  # noqa: BLE001 — a slow status is recorded, not fatal
                    log(f"status failed: {exc}")
                if now >= baseline_t:
                    samples.append((now - t_start, cproc.memory_info().rss))
                    if len(samples) % 6 == 1:
                        log(f"t={now - t_start:5.0f} s RSS {samples[-1][1] / 2**20:.1f} MiB, live {live}")
            time.sleep(0.2)
        outs = []
        for w in workers:
            try:
                stdout, _ = w.communicate(timeout=total_s + 60)
            except subprocess.TimeoutExpired:
                w.kill()
                stdout, _ = w.communicate()
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            outs.append(json.loads(line[7:]) if line else {"errors": ["worker gave no result"], "lost": 1})
        if len(samples) < 6:
            raise RuntimeError(f"only {len(samples)} RSS samples after the warm-up; run longer")
        base = sum(s[1] for s in samples[:3]) / 3
        end = sum(s[1] for s in samples[-3:]) / 3
        growth = 100.0 * (end - base) / base
        caps: dict = {}
        for o in outs:
            caps.update(o.get("caps", {}))
        lost = sum(o.get("lost", 0) for o in outs)
        result = {
            "agents": args.agents, "gpus": args.agents * GPUS_PER_NODE, "duration_s": args.duration_s,
            "warmup_s": round(baseline_t - t_start, 1), "interval_s": args.interval_s,
            "connect_all_s": round(t_connected, 1),
            "rss_baseline_mib": round(base / 2**20, 2), "rss_end_mib": round(end / 2**20, 2),
            "rss_max_mib": round(max(s[1] for s in samples) / 2**20, 2), "rss_growth_pct": round(growth, 2),
            "rss_samples": len(samples),
            "lost_streams": lost, "reconnects": sum(o.get("reconnects", 0) for o in outs),
            "max_stale_nodes": stale_seen, "min_live_nodes": min_live,
            "plans": sum(o.get("plans", 0) for o in outs), "acks": sum(o.get("acks", 0) for o in outs),
            "telemetry": sum(o.get("telemetry", 0) for o in outs), "job_events": sum(o.get("job_events", 0) for o in outs),
            "budget_w": limits["budget_w"], "final_sum_caps_w": round(sum(caps.values()), 1),
            "median_solve_s": round(sorted(solve_s)[len(solve_s) // 2], 4) if solve_s else None,
            "errors": [e for o in outs for e in o.get("errors", [])][:5],
        }
        result["ok"] = bool(growth < args.max_growth_pct and lost == 0 and stale_seen == 0)
    except Exception as exc:  # noqa: BLE001 — the last line is always the JSON result
        log(f"soak failed: {exc}")
        result = {"ok": False, "error": str(exc)[:2000], "agents": args.agents, "duration_s": args.duration_s}
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=10)
        group.stop_all()
        try:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        except OSError:
            pass
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
