"""Checking the gRPC addresses a person types (``--listen``, ``--coordinator``, ``--socket`` ...).

gRPC accepts many target forms and silently wraps an out-of-range port modulo 65536 (``:99999`` became
port 34463), so every address from a flag, the environment or a file goes through :func:`check_address`
first. Accepted forms (the ones docs/cli.md documents):

* ``unix:PATH`` / ``unix://PATH`` (non-empty path; ``unix:///abs`` is gRPC's absolute form);
* ``HOST:PORT`` / ``[IPV6]:PORT`` with PORT in 1..65535 (0 as well where ``allow_port_zero``: "any port"
  for a server's listen address).

Shared by the coordinator, the node agent and the CLI (it imports nothing of theirs).
"""

from __future__ import annotations

from capctl.errors import UserInputError

MAX_PORT = 65535
UNIX_PATH_MAX_BYTES = 107
"""``sun_path`` holds 108 bytes including the terminating NUL (unix(7))."""


def _expected(allow_port_zero: bool) -> str:
    low = 0 if allow_port_zero else 1
    return f"expected HOST:PORT (port {low}..{MAX_PORT}) or unix:/PATH"


def check_address(value: str | None, what: str, *, allow_port_zero: bool = False) -> str:
    """Return ``value`` unchanged when it is a usable gRPC address, else raise.

    Args:
        value: the address as given.
        what: the flag, variable or field it came from (``--listen``, ``$CAPCTL_COORDINATOR``), for the message.
        allow_port_zero: accept port 0 (a server binding "any free port").

    Raises:
        UserInputError: empty, ``unix:`` without a path, a unix path over 107 bytes, no ``:PORT``, a
            non-numeric port or a port outside 1..65535 (0..65535 with ``allow_port_zero``). The message
            names ``what``, the value and the accepted forms.
    """
    text = "" if value is None else str(value)
    if not text.strip():
        raise UserInputError(f"{what} {text!r}: empty address; {_expected(allow_port_zero)}")
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise UserInputError(f"{what} {text!r}: no socket path after 'unix:'; expected unix:/PATH")
        if len(path.encode()) > UNIX_PATH_MAX_BYTES:
            raise UserInputError(f"{what} {text!r}: socket path longer than {UNIX_PATH_MAX_BYTES} bytes (unix socket limit)")
        return text
    if text.startswith("unix-abstract:"):
        if not text[len("unix-abstract:"):]:
            raise UserInputError(f"{what} {text!r}: no name after 'unix-abstract:'")
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise UserInputError(f"{what} {text!r}: {_expected(allow_port_zero)}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise UserInputError(f"{what} {text!r}: malformed [IPv6] host; {_expected(allow_port_zero)}")
    elif ":" in host or "/" in host or any(c.isspace() for c in host):
        raise UserInputError(f"{what} {text!r}: malformed host {host!r}; {_expected(allow_port_zero)}")
    if not port.isdigit() or not port.isascii():
        raise UserInputError(f"{what} {text!r}: port {port!r} is not a number; {_expected(allow_port_zero)}")
    low = 0 if allow_port_zero else 1
    if not low <= int(port) <= MAX_PORT:
        raise UserInputError(f"{what} {text!r}: port {int(port)} out of range; allowed {low}..{MAX_PORT}")
    return text


def check_socket_path(value: str | None, what: str) -> str:
    """Return a unix socket path given without ``unix:`` (``--admin-socket``, agent ``--socket``).

    Raises:
        UserInputError: empty, or longer than 107 bytes.
    """
    text = "" if value is None else str(value)
    if text.startswith("unix:"):
        return check_address(text, what)[len("unix:"):]
    if not text.strip():
        raise UserInputError(f"{what} {text!r}: empty path; expected the path of a unix socket")
    if len(text.encode()) > UNIX_PATH_MAX_BYTES:
        raise UserInputError(f"{what} {text}: path longer than {UNIX_PATH_MAX_BYTES} bytes (unix socket limit)")
    return text
