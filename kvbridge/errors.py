"""Typed exception hierarchy shared by every kvbridge layer.

Input from a caller, a peer or the network raises one of these (or a
``ValueError`` subclass where the standard library convention is expected), with
the offending numbers in the message. ``assert`` only guards internal invariants.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """A size, shape or option given by a caller is invalid."""


class IntegrityError(KVBridgeError):
    """An internal structure failed its ``check_integrity()``: a kvbridge bug."""
