"""Tunables of the transfer agent: ``AgentConfig``.

``AgentConfig`` holds every timeout and buffer size (all waits in the agent take
their deadline from here). ``TransferAgent`` (``agent.py``) takes one;
``AgentConfig.from_options`` builds it from a deployment's overrides
(``kvbridge serve --transfer-option``, the vLLM connector's ``agent`` setting).
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from kvbridge.errors import ConfigError

# msgspec has no "finite" constraint: the largest float as upper bound keeps out
# inf, and NaN fails every comparison.
_FINITE_MAX = sys.float_info.max
#: Seconds, finite and > 0.
_Seconds = Annotated[float, msgspec.Meta(gt=0, le=_FINITE_MAX)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_PositiveOrOff = Annotated[int, msgspec.Meta(ge=0)]
_UpTo64 = Annotated[int, msgspec.Meta(gt=0, le=64)]
_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
#: How a staged chunk's pack and unpack run (``transfer/blocks/launching.py``).
StagedLaunch = Literal["auto", "thread", "loop"]


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Timeouts (seconds) and sizes (bytes) of one transfer agent.

    Built by keyword (``AgentConfig(read_timeout_s=30)``) or with
    :meth:`from_options`; either way every field is checked against its
    annotation (type, finite, bounds) and a bad value raises ``ConfigError``
    naming the field and the value. Change one with ``msgspec.structs.replace``.

    Attributes:
        connect_timeout_s: UCX connect plus id swap.
        handshake_timeout_s: each handshake message.
        reply_timeout_s: a control reply (data header, lease renewal, pong).
        chunk_timeout_s: one data chunk, from credit to arrival.
        read_timeout_s: a whole request's read, all ranks together; as a server,
            the longest it serves one read (and so pins its grant).
        heartbeat_s: a reader pings an idle link this often; a link silent for
            ``3 * heartbeat_s`` is dead.
        server_idle_timeout_s: a server drops a connection silent this long.
        chunk_nbytes: target bytes per data chunk (at least one block).
        window_chunks: chunks a reader keeps posted per read (credit window); a
            chunk's buffer is posted again, and credited, as soon as its unpack ends.
        num_read_slots: reads staged at once (each holds ``window_chunks`` buffers).
        num_serve_buffers: chunk buffers shared by all reads this agent serves.
        max_frame_nbytes: largest control frame accepted.
        lease_s: lease asked for when renewing a grant during a long read (the
            server grants it up to that read's deadline on its side at most;
            as a server: the default lease of its grants, ten times it their
            longest life, renewals included).
        renew_every_s: how often a long read renews its grant (a read the
            server serves only: not a same-host copy on the grant board's word).
        expire_every_s: how often the server expires grants while it holds any
            (holding none, it sleeps until one is issued).
        grant_wait_s: how long the server waits for a grant it has not issued yet
            (the engine returns the grant to D before its workers issue it), before
            rejecting a read or dropping a done report naming it.
        direct_reads: read straight from the server's blocks into ours when both
            caches store them alike (no staging, pack or unpack); False forces
            the staged path (tests, or a transport that handles IOV messages badly).
        local_copy: when reader and server share a host, the reader copies a
            direct read's blocks out of the server's memory itself (one pass,
            ``reading/same_host.py``) instead of receiving them through UCX. Also off
            with ``KVBRIDGE_LOCAL_COPY=0`` or a ``UCX_TLS`` without shared memory.
        local_copy_min_nbytes: smaller direct reads go through UCX even on one
            host. 0 (default): copies at every size. A copy on the grant board's
            word beats UCX at every size; one that must ask first is as fast as
            UCX for small reads and faster for large ones (docs/benchmarks.md).
        copy_threads: threads one same-host copy is split over (large reads).
        inline_copy_max_nbytes: a same-host read up to this size that the server's
            grant board allows is copied by the thread calling ``start_read``
            before it returns (``reading/inline.py``: no hop to the agent's
            thread, no round trip; the caller waits for the copy). Any size,
            even below ``local_copy_min_nbytes``: without the
            round trip, one copy beats UCX's two. 0: never (every read goes to
            the agent's thread, and ``start_read`` returns at once).
        grant_board: when serving same-host copies, also publish live grants on
            the board same-host readers check themselves (``protocol/grant_board.py``), so
            they need not ask before they copy. False: every copy asks.
        listen_host: the address the agent's listener binds. The connector sets it
            to the address it advertises (``host``) unless the deployment names
            another (``listen_host`` in the vLLM settings, ``kvbridge serve
            --transfer-listen-host``); ``"0.0.0.0"`` (or ``"::"``) binds every
            interface, for an advertised address that is translated on the way
            (NAT, a container's published port). Default: loopback only.
        max_sessions: connections this agent serves at once (readers' links,
            one per reader rank and peer); a connection beyond it is refused
            with a typed ``busy`` reject, so a flood of connections cannot take
            the agent's memory or tasks.
        staged_launch: how a staged read's pack (server) and unpack (reader) run
            (``transfer/blocks/launching.py``). ``"thread"``: on the agent's copy
            thread, which waits for the device; ``"loop"``: launched on the agent's
            event loop, whose tasks go on while a CUDA event says when the kernel
            is done (on CPU caches the copy is done when the call returns, and
            blocks the loop meanwhile). ``"auto"`` (default): ``"loop"`` for CUDA
            caches, ``"thread"`` for CPU caches.
    """

    connect_timeout_s: _Seconds = 5.0
    handshake_timeout_s: _Seconds = 5.0
    reply_timeout_s: _Seconds = 10.0
    chunk_timeout_s: _Seconds = 10.0
    read_timeout_s: _Seconds = 120.0
    heartbeat_s: _Seconds = 2.0
    server_idle_timeout_s: _Seconds = 30.0
    chunk_nbytes: _Positive = 16 << 20
    window_chunks: _UpTo64 = 2
    num_read_slots: _Positive = 4
    num_serve_buffers: _Positive = 4
    max_frame_nbytes: _Positive = 1 << 20
    lease_s: _Seconds = 30.0
    renew_every_s: _Seconds = 10.0
    expire_every_s: _Seconds = 0.2
    grant_wait_s: _Seconds = 2.0
    direct_reads: bool = True
    local_copy: bool = True
    local_copy_min_nbytes: _PositiveOrOff = 0
    copy_threads: _UpTo64 = 2
    inline_copy_max_nbytes: _PositiveOrOff = 64 << 20
    grant_board: bool = True
    listen_host: _Host = "127.0.0.1"
    max_sessions: _Positive = 256
    staged_launch: StagedLaunch = "auto"

    def __post_init__(self) -> None:
        # msgspec checks types and bounds when it converts (from_options), not when
        # a caller constructs by keyword: check every field here for both.
        for name in self.__struct_fields__:
            _check_field(name, getattr(self, name), strict=True)

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, strict: bool = True) -> AgentConfig:
        """The defaults with ``options`` applied, converted by ``msgspec.convert``.

        Args:
            options: Field name -> value, e.g. ``{"read_timeout_s": 30}``.
            strict: False: also convert text, as given on a command line
                (``"2.5"`` -> 2.5, ``"true"``/``"1"`` -> True).

        Raises:
            ConfigError: an unknown field, or a value of the wrong type or out
                of bounds (the message names the field and the value).
        """
        unknown = sorted(set(options) - set(cls.__struct_fields__))
        if unknown:
            raise ConfigError(f"unknown AgentConfig field(s) {unknown}: known are "
                              f"{sorted(cls.__struct_fields__)}")
        for name, value in options.items():  # msgspec's own message names no value
            _check_field(name, value, strict)
        try:
            return msgspec.convert(dict(options), cls, strict=strict)
        except msgspec.ValidationError as exc:  # every field was checked: not expected
            raise ConfigError(f"AgentConfig: {exc}") from None


def _field_rules() -> dict[str, tuple[type, object, str]]:
    """Per ``AgentConfig`` field: its plain type, its annotated type, and its bounds in words."""
    rules: dict[str, tuple[type, object, str]] = {}
    for info in msgspec.structs.fields(AgentConfig):
        if typing.get_origin(info.type) is Literal:  # a choice among strings
            choices = ", ".join(repr(choice) for choice in typing.get_args(info.type))
            rules[info.name] = (str, info.type, f"one of {choices}")
            continue
        kind, *metas = typing.get_args(info.type) or (info.type,)
        words = ["finite"] if kind is float else []
        for meta in metas:
            assert isinstance(meta, msgspec.Meta)
            for op, bound in ((">", meta.gt), (">=", meta.ge), ("<=", meta.le)):
                if bound is not None and bound != _FINITE_MAX:
                    words.append(f"{op} {bound}")
            if meta.max_length is not None:
                words.append(f"{meta.min_length}..{meta.max_length} characters long")
        rules[info.name] = (kind, info.type, " and ".join(words))
    return rules


_KIND_WORDS = {float: "a number", int: "an integer", bool: "a bool (true or false)",
               str: "a string"}


def _check_field(name: str, value: object, strict: bool) -> None:
    """Raise ``ConfigError`` unless ``value`` converts to field ``name``'s type and bounds."""
    kind, annotated, bounds = _RULES[name]
    try:
        typed: object = msgspec.convert(value, kind, strict=strict)
    except msgspec.ValidationError:
        raise ConfigError(f"AgentConfig.{name}: {value!r} is not {_KIND_WORDS[kind]}") from None
    try:
        msgspec.convert(typed, annotated)
    except msgspec.ValidationError:
        raise ConfigError(f"AgentConfig.{name} must be {bounds}, got {value!r}") from None


_RULES = _field_rules()
