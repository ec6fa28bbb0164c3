"""Hosting the connector in the engine: its scheduler side here, a worker side per TP rank.

``LLMEngine`` calls :func:`build` when its config names connector settings. It
gets the ``ConnectorScheduler`` for its scheduler plus the worker extension path
and picklable spec that ``WorkerGroup`` hands to every TP worker process. There,
:func:`make_connector_worker` builds a :class:`ConnectorWorkerHost`: the rank's
``ConnectorWorker`` registered on the rank's KV caches (which starts its
transfer agent). Per step the engine calls, on every rank through
``WorkerGroup.call``::

    start_load_kv(metadata)     before the forward
    finish_step()               after it: wait_for_save() + get_output()
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvbridge.connector.metadata import ConnectorMetadata
from kvbridge.connector.outputs import WorkerOutput
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.connector.worker import ConnectorWorker, WorkerHandshake
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.rank_worker import WorkerContext
from kvbridge.topology import EngineTopology
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.protocol.cluster_secret import cluster_secret
from kvbridge.transfer.protocol.security import CompatInfo

__all__ = ["ConnectorWorkerHost", "ConnectorWorkerSpec", "build", "make_connector_worker"]

_FIX = "pass --secret-file (or set $KVBRIDGE_SECRET), or --insecure"

#: ``WorkerGroupConfig.worker_extension`` of engines with a connector.
EXTENSION_PATH = "kvbridge.reference.engine.connector_host:make_connector_worker"


@dataclass(frozen=True, slots=True)
class ConnectorWorkerSpec:
    """What every TP worker needs to build its ``ConnectorWorker`` (sent to the workers)."""

    engine_id: str
    topology: EngineTopology
    compat: CompatInfo
    host: str
    base_port: int
    secret: bytes | None
    host_buffer: bool
    agent: AgentConfig | None


def build(config: EngineConfig) -> tuple[ConnectorScheduler, str, ConnectorWorkerSpec]:
    """The connector's scheduler side and the worker extension for ``config``.

    Args:
        config: An engine config with ``connector`` settings.

    Returns:
        ``(connector_scheduler, worker_extension_path, worker_spec)``.

    Raises:
        ConfigError: no connector settings, or settings the connector rejects.
    """
    settings = config.connector
    if settings is None:
        from kvbridge.errors import ConfigError

        raise ConfigError("engine config has no connector settings")
    model = config.model_config()
    topology = EngineTopology(
        tp_size=config.tp_size, pp_size=1, block_size=config.block_size,
        num_kv_heads=model.num_kv_heads, is_mla=False, layout=config.layout,
        num_layers=model.num_layers,
    )
    # P and D must run the same weights: name the model and where its weights come from.
    identity = f"{model.name}:{config.weights_dir or f'seed={model.seed}'}"
    compat = CompatInfo(
        model=identity, dtype=model.dtype, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, num_layers=model.num_layers, layout=config.layout,
        block_size=config.block_size, is_mla=False,
    )
    secret = settings.secret
    if secret is None:  # zero config: the host secret on one host, else refuse or insecure
        secret = cluster_secret(settings.host, insecure=settings.insecure, fix=_FIX)
    num_blocks = config.kv_cache_config().num_blocks
    scheduler = ConnectorScheduler(
        settings.engine_id, config.role.value, topology, settings.host,
        settings.transfer_base_port, config.block_size, lease_s=settings.lease_s,
        secret=secret,  # P signs its params with it, D checks them
        max_held_blocks=int(num_blocks * settings.max_held_share),
    )
    agent = msgspec.structs.replace(settings.agent or AgentConfig(),
                                    listen_host=settings.listen_host or settings.host)
    spec = ConnectorWorkerSpec(
        engine_id=settings.engine_id, topology=topology, compat=compat, host=settings.host,
        base_port=settings.transfer_base_port, secret=secret,
        host_buffer=settings.host_buffer, agent=agent,
    )
    return scheduler, EXTENSION_PATH, spec


class ConnectorWorkerHost:
    """One TP rank's connector worker, driven by the engine through ``WorkerGroup.call``.

    Args:
        ctx: The rank's worker context; ``ctx.extension_config`` is a
            :class:`ConnectorWorkerSpec`.

    Raises:
        ConfigError: the caches do not match the spec's topology.
        TransferError: the transfer agent could not start (e.g. port taken).
    """

    def __init__(self, ctx: WorkerContext) -> None:
        spec = ctx.extension_config
        if not isinstance(spec, ConnectorWorkerSpec):
            raise TypeError(f"extension_config must be a ConnectorWorkerSpec, got "
                            f"{type(spec).__name__}")
        self.worker = ConnectorWorker(
            spec.engine_id, spec.topology, ctx.tp_rank, 0, spec.compat, host=spec.host,
            base_port=spec.base_port, secret=spec.secret, host_buffer=spec.host_buffer,
            agent_config=spec.agent, on_event=ctx.notify,
        )
        try:
            self.worker.register_kv_caches(ctx.kv_caches)
        except BaseException:
            self.worker.shutdown()
            raise

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Start this step's reads, notices and revocations (before the forward)."""
        self.worker.start_load_kv(metadata)

    def finish_step(self) -> WorkerOutput:
        """After the forward: hold finished prefills for readers, report what finished."""
        self.worker.wait_for_save()
        return self.worker.get_output()

    def handshake(self) -> WorkerHandshake | None:
        """Where this rank's transfer agent listens."""
        return self.worker.handshake_metadata

    def close(self) -> None:
        """Stop the transfer agent (``WorkerGroup.shutdown`` calls this)."""
        self.worker.shutdown()


def make_connector_worker(ctx: WorkerContext) -> ConnectorWorkerHost:
    """Worker extension factory (see :data:`EXTENSION_PATH`)."""
    return ConnectorWorkerHost(ctx)
