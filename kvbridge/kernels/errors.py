"""The typed error every kernel launcher raises: ``KernelInputError``."""

from __future__ import annotations

from kvbridge.errors import ConfigError

__all__ = ["KernelInputError"]


class KernelInputError(ConfigError):
    """A kernel launcher got tensors, ids or ranges it cannot work with.

    The message names the offending values; nothing has been written when it is raised.
    """
