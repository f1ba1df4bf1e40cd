"""One vocabulary: cap states (the protocol's CapState enum, :mod:`capctl.capstates`) and clocks
event reasons (:mod:`capctl.reasons`) are defined once, and mixed versions still agree."""

from __future__ import annotations

from capctl import capstates, reasons
from capctl.v1 import capctl_pb2 as pb


def test_every_cap_state_is_a_protocol_enum_value_and_round_trips():
    names = [n for n in pb.CapState.keys() if n != "CAP_STATE_UNSPECIFIED"]
    assert set(names) == {capstates.OK, capstates.OOB_LIMITED, capstates.FOREIGN_WRITER, capstates.RESTORE_FAILED,
                          capstates.SAFE_CAP, capstates.LOST, capstates.SET_FAILED, capstates.ERROR,
                          capstates.UNCONFIRMED, capstates.NO_READING, capstates.UNSUPPORTED_CONSTRAINTS,
                          capstates.STALLED}
    for n in names:
        assert capstates.from_wire(capstates.to_wire(n)) == n
    assert capstates.to_wire("") == 0 and capstates.from_wire(0) == "" and capstates.from_wire(999) == "UNKNOWN_999"


def test_peers_from_before_the_enum_are_understood_both_ways():
    old = pb.GpuTelemetry(index=0, cap_state_name="SET_FAILED")  # what an agent before the enum sends
    assert capstates.of(old) == "SET_FAILED"
    new = pb.GpuTelemetry(index=0, **capstates.wire_fields("FOREIGN_WRITER"))
    assert new.cap_state == pb.CapState.Value("FOREIGN_WRITER") and new.cap_state_name == "FOREIGN_WRITER"
    assert capstates.of(new) == "FOREIGN_WRITER"
    status = pb.GpuStatus(**capstates.wire_fields("SAFE_CAP"))
    assert capstates.of(status) == "SAFE_CAP" and status.cap_state_name == "SAFE_CAP"


def test_reason_classes_are_defined_once_over_nvml_bits():
    assert reasons.decode(0x20 | 0x4) == ("SW_POWER_CAP", "SW_THERMAL_SLOWDOWN")
    assert reasons.classify(("HW_THERMAL_SLOWDOWN",)) == (True, False)
    assert reasons.classify(("SW_POWER_CAP", "GPU_IDLE")) == (False, True)
    assert reasons.classify(("HW_SLOWDOWN",)) == (False, False)
    assert {n for _, n in reasons.REASON_BITS} >= reasons.THERMAL_SLOWDOWN | reasons.POWER_CAPPED
