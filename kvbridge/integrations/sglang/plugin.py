"""The SGLang plugin: ``--disaggregation-transfer-backend kvbridge`` without patching SGLang.

SGLang calls every ``sglang.srt.plugins`` entry point in each of its processes
before it parses arguments (``sglang/srt/plugins/__init__.py``). ``register``
then

1. adds ``kvbridge`` to the backend choices argparse accepts;
2. gives ``TransferBackend`` (an ``Enum`` the scheduler builds from the flag) a
   ``KVBRIDGE`` member, added in place so every module's binding sees it;
3. wraps ``get_kv_class`` (an ``if``/``elif`` per backend, no registry) with an
   AROUND hook that answers for ``KVBRIDGE`` and passes everything else on.

Nothing of kvbridge's backend is imported until a scheduler asks for a class.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

__all__ = ["BACKEND", "register"]

logger = logging.getLogger(__name__)

BACKEND = "kvbridge"


def _add_member(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """``enum_cls(value)``, first adding member ``name`` if the enum lacks it."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _classes() -> dict[str, type]:
    from kvbridge.integrations.sglang.conn import (
        KVBridgeKVBootstrapServer,
        KVBridgeKVReceiver,
        KVBridgeKVSender,
    )
    from kvbridge.integrations.sglang.manager import KVBridgeKVManager

    return {"manager": KVBridgeKVManager, "sender": KVBridgeKVSender,
            "receiver": KVBridgeKVReceiver, "bootstrap_server": KVBridgeKVBootstrapServer}


def _get_kv_class(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``get_kv_class(transfer_backend, class_type)``: ours for ``KVBRIDGE``."""
    named = dict(zip(("transfer_backend", "class_type"), args, strict=False), **kwargs)
    backend, class_type = named.get("transfer_backend"), named.get("class_type")
    kind = getattr(class_type, "value", None)
    if getattr(backend, "value", None) != BACKEND or kind == "kvargs":
        return original(*args, **kwargs)
    return _classes()[str(kind)]


def register() -> None:
    """Entry point (``sglang.srt.plugins``): make the ``kvbridge`` backend known."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_disagg_transfer_backend_choices

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_member(TransferBackend, BACKEND.upper(), BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class,
                          HookType.AROUND)
