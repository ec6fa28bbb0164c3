"""``kv_connector_extra_config`` of the vLLM connector: what a deployment may set.

Nothing is needed on one host; every field has a default that works there,
authenticated: instances of the same user share a secret made on first use
(``kvbridge/transfer/protocol/cluster_secret.py``). A multi-host deployment sets
at least ``host`` (the address D's workers reach P's workers at) and a cluster
secret (``secret_file`` or ``$KVBRIDGE_SECRET``, the same on every P and D), or
says ``"insecure": true``. Example ``--kv-transfer-config`` for a P on 10.0.0.1::

    {"kv_connector": "KVBridgeConnector",
     "kv_connector_module_path": "kvbridge.integrations.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"host": "10.0.0.1", "base_port": 5600,
                                   "secret_file": "/etc/kvbridge/secret"}}

Decoded with msgspec: a wrong type, an unknown field or a value out of range
raises ``ConfigError`` naming the field, when vLLM builds the connector.
This module does not import vLLM.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvbridge.errors import ConfigError
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.protocol.cluster_secret import cluster_secret, is_loopback
from kvbridge.transfer.protocol.security import load_cluster_secret

__all__ = ["SYNC_LOAD_MAX_BYTES", "VllmSettings", "for_data_parallel_rank",
           "for_failure_policy", "parse_settings"]

#: ``sync_load_max_bytes`` by default under ``kv_load_failure_policy`` ``recompute``.
SYNC_LOAD_MAX_BYTES = 4 << 20

_FIX = ('set "secret_file" in kv_connector_extra_config (or $KVBRIDGE_SECRET in every '
        'instance\'s environment), or "insecure": true')

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


class VllmSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The connector's settings (``kv_connector_extra_config``), all optional.

    Attributes:
        host: address this engine's transfer agents are reached at, announced to
            D in ``kv_transfer_params`` (``remote_host``), and the address they
            listen on (unless ``listen_host``). Default ``127.0.0.1``: one host.
        listen_host: the address the agents bind instead of ``host``:
            ``"0.0.0.0"`` (every interface) when ``host`` is translated on the
            way (NAT, a container's published port). Default: ``host``.
        base_port: 0 (default): each worker listens on a free port and P
            announces the list (``remote_ports``), so instances never collide.
            Else worker of global rank ``g`` listens on ``base_port + g`` (for
            firewalls that open fixed ports); with data parallelism, DP rank
            ``r``'s workers on ``base_port + r * TP * PP + g``
            (:func:`for_data_parallel_rank`).
        secret_file: file holding the cluster secret: peers prove they know it
            (HMAC) before any KV moves. Default: ``$KVBRIDGE_SECRET`` if set, else
            on a loopback ``host`` the secret this user's instances on this host
            share (made on first use); a non-loopback ``host`` then refuses to
            start unless ``insecure``.
        insecure: run without authentication when no secret is configured (any
            process that reaches the agents' ports may read and write the KV
            cache): for a network you trust. Logged as a warning at every start.
        lease_s: how long P holds a finished prefill's blocks for D's readers
            if they do not report (they normally do within milliseconds).
        max_held_share: share of P's KV cache blocks that finished prefills
            held for D's readers may take (default 0.5: the other half stays
            for new prefills). A new hold beyond it releases the oldest holds
            first; their readers are refused and D recomputes.
        host_buffer: stage transfers through a host copy of the cache (GPU
            caches on links that cannot reach device memory).
        idle_wait_s: on a step with nothing to compute while transfers are in
            flight, a worker waits up to this long for one to end instead of
            letting the engine spin (new requests wait at most this long).
        sync_load_max_bytes: D loads at most this many bytes per worker
            synchronously: in the step that schedules the request, before its
            forward (vLLM's ``load_kv_async=False``), so the first token comes
            two engine steps sooner; that step's forward waits for the read
            (its cost: docs/benchmarks.md, "Figures behind the code"). Larger loads run
            asynchronously while other requests keep stepping. 0: every load
            asynchronous. Default (None): 4 MiB when D's
            ``kv_load_failure_policy`` is ``recompute`` (a load late for its
            deadline is recomputed); 0 under vLLM's default ``fail``, where a
            load late for its deadline would fail a request whose read was
            merely slow (:func:`for_failure_policy`). Set it under ``fail`` to
            accept that.
        sync_load_deadline_s: the forward waits at most this long for the
            step's synchronous loads (default 0.25 s), so a slow or stopped P
            never stalls the whole batch for longer. A load still running then
            is late: its read is cancelled and, once nothing of it can still
            write into its blocks, counts as failed (vLLM recomputes it or
            fails its request, as its policy says; ``worker_side.py``). A read
            the cancel cannot stop within 2 s is waited for under
            ``recompute`` and keeps its failed request's blocks under ``fail``.
        model_id: identity P and D must share (default: the model's name
            and its architecture's sizes). Set it when P and D load the same
            weights from differently named paths.
        agent: transfer agent overrides (``kvbridge.transfer.agent_config.AgentConfig``
            fields, e.g. ``{"read_timeout_s": 30}``).
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)] = "127.0.0.1"
    base_port: Port = 0
    listen_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)] | None = None
    secret_file: str | None = None
    insecure: bool = False
    lease_s: Seconds = 30.0
    max_held_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    host_buffer: bool = False
    idle_wait_s: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.02
    sync_load_max_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    sync_load_deadline_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.25
    model_id: str | None = None
    agent: dict[str, Any] = {}

    def agent_config(self) -> AgentConfig:
        """The transfer agent's config with ``agent`` applied over the defaults.

        Same-host copies are made on the caller's (vLLM's forward) thread up to
        ``sync_load_max_bytes`` only, unless ``agent`` sets ``inline_copy_max_nbytes``.

        Raises:
            ConfigError: an unknown field or a bad value.
        """
        try:
            # a same-host copy made inline runs on vLLM's forward thread: only the
            # synchronous loads' sizes (larger ones go to the agent's own threads)
            return AgentConfig.from_options({
                "lease_s": self.lease_s, "listen_host": self.listen_host or self.host,
                "inline_copy_max_nbytes": self.sync_load_max_bytes or 0, **self.agent})
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config.agent: {exc}") from None

    def secret(self) -> bytes | None:
        """The secret the agents authenticate with; None only with ``insecure``.

        ``secret_file``, else ``$KVBRIDGE_SECRET``, else (``insecure``: None,
        logged), else this user's host secret on a loopback ``host``
        (:func:`kvbridge.transfer.protocol.cluster_secret.cluster_secret`).

        Raises:
            ConfigError: the file cannot be read or is empty; a non-loopback
                ``host`` with no secret and not ``insecure``; a host secret
                that is not private to this user.
        """
        return cluster_secret(self.host, secret_file=self.secret_file, insecure=self.insecure,
                              fix=_FIX)


def parse_settings(extra_config: object) -> VllmSettings:
    """Validate ``kv_connector_extra_config`` (``None`` or a dict) into settings.

    Raises:
        ConfigError: not a mapping, an unknown field, a wrong type or range.
    """
    if extra_config is None:
        return VllmSettings()
    if not isinstance(extra_config, dict):
        raise ConfigError(f"kv_connector_extra_config must be a JSON object, got "
                          f"{type(extra_config).__name__}")
    try:
        settings = msgspec.convert(extra_config, VllmSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    if settings.base_port and settings.base_port < 1024:
        raise ConfigError(f"kv_connector_extra_config.base_port {settings.base_port}: use 0 "
                          f"(free ports) or a port >= 1024")
    settings.agent_config()  # fail at start-up, not at the first transfer
    if (not settings.insecure and not is_loopback(settings.host)
            and load_cluster_secret(secret_file=settings.secret_file) is None):
        settings.secret()  # raises, naming the fix, before vLLM builds anything more
    return settings


def for_failure_policy(settings: VllmSettings, policy: str) -> VllmSettings:
    """The settings with ``sync_load_max_bytes`` set for D's ``kv_load_failure_policy``.

    Under ``fail`` (vLLM's default) a synchronous load still running at
    ``sync_load_deadline_s`` ends its request in an error because P or the
    machine was slow for a moment; under ``recompute`` D only recomputes it.
    So, unless the deployment set ``sync_load_max_bytes``,
    loads are synchronous (up to ``SYNC_LOAD_MAX_BYTES``) only under
    ``recompute``.
    """
    if settings.sync_load_max_bytes is not None:
        return settings
    nbytes = SYNC_LOAD_MAX_BYTES if policy == "recompute" else 0
    return msgspec.structs.replace(settings, sync_load_max_bytes=nbytes)


def for_data_parallel_rank(settings: VllmSettings, dp_rank: int, world_size: int) -> VllmSettings:
    """The settings of one data-parallel rank (vLLM runs an engine per DP rank).

    Each DP rank is an engine of its own (vLLM suffixes its engine id with
    ``_dp<rank>``), with its own workers and agents. Free ports (``base_port``
    0) never collide; fixed ones are moved past the lower ranks' workers.

    Args:
        settings: the connector's settings.
        dp_rank: vLLM's ``data_parallel_rank``.
        world_size: workers per DP rank (TP * PP).

    Raises:
        ConfigError: the moved ports run past 65535.
    """
    if not settings.base_port or not dp_rank:
        return settings
    base_port = settings.base_port + dp_rank * world_size
    if base_port + world_size - 1 > 65535:
        raise ConfigError(
            f"kv_connector_extra_config.base_port {settings.base_port}: data-parallel rank "
            f"{dp_rank} would listen on ports {base_port}..{base_port + world_size - 1}; use "
            f"a lower base_port, or 0 (free ports)")
    return msgspec.structs.replace(settings, base_port=base_port)
