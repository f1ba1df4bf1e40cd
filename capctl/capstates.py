"""Cap states of a GPU: the one vocabulary, defined by the ``CapState`` enum of the protocol
(protos/capctl/v1/capctl.proto, one doc line per value) and named here for the Python code.

Inside capctl a state is its name (a ``str``: what status JSON, tables, logs and alerts show); on the
wire it is the enum value. :func:`wire_fields` / :func:`of` convert at the protocol's edge. Until
every peer speaks the enum, messages also carry the name in the deprecated ``cap_state_name``
field (peers from before the enum send and read only that), so a rolling upgrade keeps agreeing.
"""

from __future__ import annotations

from capctl.v1 import capctl_pb2 as _pb

_ENUM = _pb.CapState


def _name(name: str) -> str:
    _ENUM.Value(name)  # a name the protocol does not define fails at import
    return name


OK = _name("OK")
OOB_LIMITED = _name("OOB_LIMITED")
FOREIGN_WRITER = _name("FOREIGN_WRITER")
RESTORE_FAILED = _name("RESTORE_FAILED")
SAFE_CAP = _name("SAFE_CAP")
LOST = _name("LOST")
SET_FAILED = _name("SET_FAILED")
ERROR = _name("ERROR")
UNCONFIRMED = _name("UNCONFIRMED")
NO_READING = _name("NO_READING")
UNSUPPORTED_CONSTRAINTS = _name("UNSUPPORTED_CONSTRAINTS")
STALLED = _name("STALLED")

UNCONTROLLABLE = frozenset({SET_FAILED, ERROR, LOST, FOREIGN_WRITER, UNSUPPORTED_CONSTRAINTS, STALLED})
"""States in which the coordinator holds a GPU at its accounted cap instead of optimizing it."""
NORMAL = frozenset({OK, SAFE_CAP})
"""States that raise no alert."""


def to_wire(name: str) -> int:
    """The ``CapState`` value of ``name`` ("" = unspecified).

    Raises:
        ValueError: a name the protocol does not define.
    """
    return 0 if not name else _ENUM.Value(name)


def wire_fields(name: str) -> dict:
    """Keyword arguments setting a message's cap state (``GpuTelemetry``, ``GpuStatus``): the enum
    and, for peers from before it, the name. A name the protocol does not define (a newer agent's
    value, ``UNKNOWN_<n>``, or an older one's text) goes as the name alone, the enum unspecified:
    :func:`of` reads it back as it was (found by a review: one GPU reporting cap state 200 made
    every status, explain and metrics read of the coordinator raise)."""
    return {"cap_state": wire_of_name(name), "cap_state_name": name}


def of(msg) -> str:
    """The cap state name of a ``GpuTelemetry`` / ``GpuStatus``: the enum, else the name a peer
    from before the enum sent ("" when neither is set)."""
    if msg.cap_state:
        return from_wire(msg.cap_state)
    return msg.cap_state_name


def from_wire(value: int) -> str:
    """The name of a ``CapState`` value ("" = unspecified; a value from a newer peer shows as
    ``UNKNOWN_<n>``)."""
    if not value:
        return ""
    try:
        return _ENUM.Name(value)
    except ValueError:
        return f"UNKNOWN_{int(value)}"


class _WireNames(dict):
    """``CapState`` value -> name (:func:`from_wire`), filled on first use and bounded (256
    values; a value from a newer peer shows as ``UNKNOWN_<n>``). A dict so that the decoders of
    every GPU of every report look a state up with one subscript."""

    def __missing__(self, value: int) -> str:
        name = from_wire(value)
        if len(self) < 256:
            self[value] = name
        return name


WIRE_NAMES = _WireNames()
"""The one memo of :func:`from_wire` (:func:`name_of_wire`, :mod:`capctl.readings`)."""


def name_of_wire(value: int, name: str) -> str:
    """:func:`of` of a message whose ``cap_state`` is ``value`` and ``cap_state_name`` is ``name``:
    the enum's name through :data:`WIRE_NAMES` when ``value`` is set (``name`` not read), else
    ``name`` (nothing of a peer's text is kept)."""
    return WIRE_NAMES[value] if value else name


def wire_of_name(name: str) -> int:
    """The ``CapState`` value of ``name``; 0 (unspecified) for "" or a name the protocol does not define."""
    try:
        return to_wire(name)
    except ValueError:
        return 0
