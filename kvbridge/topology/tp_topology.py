"""``TpKVTopology``: one worker's view of its own engine and of every peer engine.

Owned by one worker's transfer agent. Peers are registered (after a successful
handshake) with :meth:`TpKVTopology.add_remote`, which rejects an engine that
cannot pair with this one, so every later question about a registered peer
succeeds. All answers are pure arithmetic over :class:`EngineTopology` values.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbridge.errors import KVBridgeError
from kvbridge.topology.engine_topology import EngineTopology
from kvbridge.topology.ratios import (
    BlockSizeRatio,
    IncompatibleTopologyError,
    block_size_ratio,
    check_compatible,
    signed_ratio,
)
from kvbridge.topology.read_plan import ReadPlan, build_read_plan
from kvbridge.topology.targets import RemoteRank, num_expected_readers, target_remote_ranks


class UnknownEngineError(KVBridgeError, LookupError):
    """An engine id was asked about before it was registered."""


class TpKVTopology:
    """KV placement questions for one local worker ``(tp_rank, pp_rank)``.

    Args:
        local: This worker's engine.
        tp_rank: This worker's TP rank.
        pp_rank: This worker's PP rank.
        remotes: Peer engines to register now, by engine id.
        engine_id: This engine's own id, if questions should accept it too.

    Raises:
        ConfigError: a rank is out of range, or a peer in ``remotes`` cannot
            pair (:class:`IncompatibleTopologyError`).
    """

    def __init__(
        self,
        local: EngineTopology,
        tp_rank: int,
        pp_rank: int,
        remotes: Mapping[str, EngineTopology] | None = None,
        *,
        engine_id: str | None = None,
    ) -> None:
        self._global_rank = local.global_rank(tp_rank, pp_rank)  # validates both ranks
        self._local = local
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._engine_id = engine_id
        self._remotes: dict[str, EngineTopology] = {}
        for remote_id, remote in (remotes or {}).items():
            self.add_remote(remote_id, remote)

    @property
    def local(self) -> EngineTopology:
        """This worker's engine."""
        return self._local

    @property
    def tp_rank(self) -> int:
        """This worker's TP rank."""
        return self._tp_rank

    @property
    def pp_rank(self) -> int:
        """This worker's PP rank."""
        return self._pp_rank

    @property
    def global_rank(self) -> int:
        """This worker's global rank, ``pp_rank * tp_size + tp_rank``."""
        return self._global_rank

    @property
    def engine_id(self) -> str | None:
        """This engine's own id, if given."""
        return self._engine_id

    @property
    def remote_engine_ids(self) -> tuple[str, ...]:
        """Registered peer engine ids, in registration order."""
        return tuple(self._remotes)

    def add_remote(self, engine_id: str, topology: EngineTopology) -> None:
        """Register a peer engine. Registering an equal topology again is a no-op.

        Raises:
            IncompatibleTopologyError: the peer cannot pair with this engine, uses
                this engine's own id, or was registered with a different topology.
                Nothing is registered then.
        """
        if engine_id == self._engine_id:
            raise IncompatibleTopologyError(f"engine id {engine_id!r} is the local engine's id")
        known = self._remotes.get(engine_id)
        if known is not None and known != topology:
            raise IncompatibleTopologyError(
                f"engine {engine_id!r} already registered as {known}, now {topology}"
            )
        check_compatible(self._local, topology)
        self._remotes[engine_id] = topology

    def remove_remote(self, engine_id: str) -> None:
        """Forget a peer engine (e.g. it restarted). Unknown ids are ignored."""
        self._remotes.pop(engine_id, None)

    def topology_of(self, engine_id: str) -> EngineTopology:
        """The registered topology of ``engine_id`` (or the local one for its own id).

        Raises:
            UnknownEngineError: ``engine_id`` is not registered.
        """
        if engine_id == self._engine_id:
            return self._local
        try:
            return self._remotes[engine_id]
        except KeyError:
            raise UnknownEngineError(
                f"engine {engine_id!r} not registered; known: {sorted(self._remotes)}"
            ) from None

    def tp_ratio(self, remote_tp_size: int) -> int:
        """Local ranks per remote rank (> 0), or minus remote ranks per local rank (< 0).

        Raises:
            IncompatibleTopologyError: neither TP size divides the other.
        """
        return signed_ratio("tensor parallel size", self._local.tp_size, remote_tp_size)

    def pp_ratio(self, remote_pp_size: int) -> int:
        """Same convention as :meth:`tp_ratio`, for PP sizes.

        Raises:
            IncompatibleTopologyError: neither PP size divides the other.
        """
        return signed_ratio("pipeline parallel size", self._local.pp_size, remote_pp_size)

    def block_size_ratio(self, remote_block_size: int) -> BlockSizeRatio:
        """How local and remote blocks tile tokens, in either direction.

        Raises:
            IncompatibleTopologyError: neither block size divides the other.
        """
        return block_size_ratio(self._local.block_size, remote_block_size)

    def tp_ratio_from_engine_id(self, engine_id: str) -> int:
        """:meth:`tp_ratio` for a registered engine."""
        return self.tp_ratio(self.topology_of(engine_id).tp_size)

    def pp_ratio_from_engine_id(self, engine_id: str) -> int:
        """:meth:`pp_ratio` for a registered engine."""
        return self.pp_ratio(self.topology_of(engine_id).pp_size)

    def block_size_ratio_from_engine_id(self, engine_id: str) -> BlockSizeRatio:
        """:meth:`block_size_ratio` for a registered engine."""
        return self.block_size_ratio(self.topology_of(engine_id).block_size)

    def is_kv_replicated(self, engine_id: str) -> bool:
        """Whether ``engine_id`` has more TP ranks than KV heads (ranks share heads)."""
        return self.topology_of(engine_id).is_kv_replicated

    def replicates_kv_cache(self, engine_id: str) -> bool:
        """Whether ``engine_id``'s ranks hold identical KV: MLA, or replicated heads."""
        return self.topology_of(engine_id).replicates_kv_cache

    def get_target_remote_ranks(self, remote_tp_size: int, remote_pp_size: int) -> list[RemoteRank]:
        """Remote ``(global_rank, pp_rank, tp_rank)`` triples this worker contacts.

        Raises:
            ConfigError: sizes do not divide, or ``remote_pp_size`` exceeds the layers.
        """
        return target_remote_ranks(
            self._local, self._tp_rank, self._pp_rank, remote_tp_size, remote_pp_size
        )

    def get_target_remote_ranks_from_engine_id(self, engine_id: str) -> list[RemoteRank]:
        """:meth:`get_target_remote_ranks` for a registered engine."""
        remote = self.topology_of(engine_id)
        return self.get_target_remote_ranks(remote.tp_size, remote.pp_size)

    def plan_reads(self, engine_id: str) -> ReadPlan:
        """This worker's :class:`ReadPlan` for pulling KV from ``engine_id``.

        Raises:
            UnknownEngineError: ``engine_id`` is not registered.
        """
        return build_read_plan(
            self._local, self._tp_rank, self._pp_rank, self.topology_of(engine_id), engine_id
        )

    def expected_readers(self, engine_id: str) -> int:
        """Workers of reader engine ``engine_id`` that will contact this worker.

        Raises:
            UnknownEngineError: ``engine_id`` is not registered.
        """
        return num_expected_readers(
            self.topology_of(engine_id), self._local, self._tp_rank, self._pp_rank
        )
