"""Keep secrets out of logs: bearer tokens and PEM private keys are masked in every record.

:func:`install` adds :class:`RedactingFilter` to the root logger's handlers (call it after
``logging.basicConfig``). The filter rewrites the formatted message of each record; it does not
stop a caller from printing a secret elsewhere, which capctl never does (tests check both).
"""

from __future__ import annotations

import logging
import re

MASK = "<redacted>"

_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[^\s'\",;]+"),
    re.compile(r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?(-----END \1PRIVATE KEY-----|$)", re.S),
    re.compile(r"(?i)((?:token|password|secret)\s*([=:])\s*)([^\s'\",;]+)"),
)
_SECRET_LIKE = re.compile(r"^(?=.{8,})(?=.*[^a-z]).*$|^.{16,}$")
"""A value after ``token:`` (not ``password:`` or ``secret:``, always masked) that looks like a secret: 8+ characters with one that is no lower-case
letter, or 16+ characters. ``token: found`` is YAML's "while scanning for the next token: found
character ..." (the policy's own error, masked in the log as ``token: <redacted>``; found by a
try-out); after ``=`` every value is masked."""


def _mask_value(m: re.Match) -> str:
    key, sep, value = m.group(1), m.group(2), m.group(3)
    if sep == ":" and key.lower().startswith("token") and not _SECRET_LIKE.match(value):
        return m.group(0)  # (only "token:" is YAML's word too; a password or secret is always masked)
    return key + MASK


def redact(text: str) -> str:
    """``text`` with bearer tokens, ``token=...``-style values (after ``token:`` those that look like
    a secret, :data:`_SECRET_LIKE`) and private keys replaced by ``<redacted>``."""
    text = _PATTERNS[0].sub(lambda m: m.group(1) + MASK, text)
    text = _PATTERNS[1].sub(MASK, text)
    return _PATTERNS[2].sub(_mask_value, text)


class RedactingFilter(logging.Filter):
    """Logging filter applying :func:`redact` to each record's message (args merged first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 — a broken record is left for logging to report
            return True
        clean = redact(message)
        if clean != message:
            record.msg = clean
            record.args = ()
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Attach a :class:`RedactingFilter` to every handler of ``logger`` (default: root), once."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
