"""bench/control_loop.py's stand-in agents refill one set of protobuf messages per agent
(``Readings``) instead of building 8 ``GpuTelemetry`` afresh per report and ack: the bytes they send
must be those of messages built afresh from the same values (what the coordinator receives, and so
what the bench measures, is unchanged). Not timed."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def _fresh(pb, kind, node, job, seq, ts, enforced, demand, temp, rng):
    """The messages as the bench built them before Readings (reference)."""
    def gpu_tele(i):
        p = min(enforced[i], demand[i] + rng.uniform(-20, 20))
        reasons = ["SW_POWER_CAP"] if p >= enforced[i] - 1 else []
        return pb.GpuTelemetry(index=i, power_w=p, cap_w=enforced[i], enforced_w=enforced[i], temp_c=temp[i],
                               sm_clock_mhz=int(1980 * min(1.0, (max(p - 75, 1) / 625) ** (1 / 3))),
                               clocks_event_reasons=reasons, utilization_pct=100.0, energy_j=0.0, job_id=job)
    gpus = [gpu_tele(i) for i in range(8)]
    if kind == "report":
        return pb.AgentMessage(telemetry=pb.NodeTelemetry(node=node, timestamp_s=ts, seq=seq, gpus=gpus))
    return pb.AgentMessage(ack=pb.CapAck(seq=seq, ok=True, gpus=gpus))


def test_refilled_readings_serialize_as_fresh_messages_on_random_data():
    import control_loop as cl

    from capctl.v1 import capctl_pb2 as pb

    assert cl.GPUS == 8
    data = random.Random(7)
    readings = cl.Readings(pb, "bn00042", "job6")
    ours, ref = random.Random(11), random.Random(11)  # the same draws for both
    at_cap = not_at_cap = 0
    for seq in range(1, 400):
        enforced = [data.choice([200.0, 700.0, data.uniform(200, 700)]) for _ in range(8)]
        demand = [data.choice([cl.HEAVY_W, cl.LIGHT_W]) for _ in range(8)]
        temp = [data.uniform(35, 86) for _ in range(8)]
        ts = 1.7e9 + seq
        kind = "report" if seq % 2 else "ack"
        got = (readings.report(seq, ts, enforced, demand, temp, ours) if kind == "report"
               else readings.ack(seq, enforced, demand, temp, ours))
        want = _fresh(pb, kind, "bn00042", "job6", seq, ts, enforced, demand, temp, ref)
        assert got == want.SerializeToString(), (seq, kind)
        body = want.telemetry if kind == "report" else want.ack
        at_cap += sum(1 for g in body.gpus if g.clocks_event_reasons)
        not_at_cap += sum(1 for g in body.gpus if not g.clocks_event_reasons)
    assert at_cap > 100 and not_at_cap > 100  # both ways of the throttle reason, and back, were exercised
    assert ours.random() == ref.random()  # one draw per GPU, as before


def test_packed_readings_carry_what_the_plain_ones_do():
    """Welcomed with packed_readings, the stand-in agents send the same readings packed
    (GpuReadings, as nodeagent; rows written from the values, not through capctl.readings.pack):
    every decoded row equals the plain message's, and the rng draws stay the same."""
    import control_loop as cl

    from capctl import readings as rd
    from capctl.v1 import capctl_pb2 as pb

    data = random.Random(3)
    plain, packed = cl.Readings(pb, "bn00007", "job2"), cl.Readings(pb, "bn00007", "job2")
    packed.packed = True
    ours, ref = random.Random(5), random.Random(5)
    for seq in range(1, 60):
        enforced = [data.uniform(200, 700) for _ in range(8)]
        demand = [data.choice([cl.HEAVY_W, cl.LIGHT_W]) for _ in range(8)]
        temp = [data.uniform(35, 86) for _ in range(8)]
        if seq % 2:
            got = pb.AgentMessage.FromString(packed.report(seq, 1.7e9, enforced, demand, temp, ours)).telemetry
            want = pb.AgentMessage.FromString(plain.report(seq, 1.7e9, enforced, demand, temp, ref)).telemetry
            assert (got.node, got.seq, got.timestamp_s) == (want.node, want.seq, want.timestamp_s)
        else:
            got = pb.AgentMessage.FromString(packed.ack(seq, enforced, demand, temp, ours)).ack
            want = pb.AgentMessage.FromString(plain.ack(seq, enforced, demand, temp, ref)).ack
            assert (got.seq, got.ok) == (want.seq, want.ok)
        assert not got.gpus and got.HasField("readings") and len(want.gpus) == 8
        facts = [repr(r[:rd.R_WIRE_REASONS] + r[rd.R_STATE:]) for r in rd.rows_of(got)]  # (NaN: as text)
        assert facts == [repr(r[:rd.R_WIRE_REASONS] + r[rd.R_STATE:]) for r in rd.rows_of(want)]
    assert ours.random() == ref.random()
