"""Renewing a grant's lease while one read of it runs: ``LeaseRenewal``.

The lease covers most reads, so renewals start only once a read has run for
``AgentConfig.renew_every_s``: from then on its grant's lease is renewed every
``renew_every_s``, naming the read (its xfer id), while the server serves it (a
same-host copy on the grant board's word is not served: it renews nothing, see
``same_host.py``). If the server refuses because the grant expired, was revoked
or released meanwhile, the read fails with ``LeaseRefusedError`` once it ends
(``refusal``); other reads on the link are not touched. If it refuses because it
serves no such read (``NoReadServedError``: its half of the read ended first, or
has not pinned the grant yet), that renewal extended nothing and the read goes
on (its own data decides), renewing again ``renew_every_s`` later.

Used by ``reads.py`` around each plan item's read; P's side of a renewal is
``serving/session.py`` -> ``GrantTable.renew``.
"""

from __future__ import annotations

import asyncio
import logging

from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.errors import LeaseRefusedError, NoReadServedError, TransferError
from kvbridge.transfer.reading.base import BegunRead
from kvbridge.transfer.reading.link import PeerLink

__all__ = ["LeaseRenewal"]

logger = logging.getLogger(__name__)


class LeaseRenewal:
    """The renewals of one read's lease, due ``renew_every_s`` after it began.

    Create on the agent's loop right after the read began; call ``stop`` once
    it ended, whatever the outcome.
    """

    def __init__(self, link: PeerLink, grant: str, begun: BegunRead,
                 config: AgentConfig) -> None:
        self._renewer: list[asyncio.Task[None]] = []
        self._due = asyncio.get_running_loop().call_later(
            config.renew_every_s,
            lambda: self._renewer.append(asyncio.create_task(
                _renew_while_reading(link, grant, begun, config))),
        )

    def refusal(self) -> LeaseRefusedError | None:
        """The server's refusal to renew the read's grant, if its renewals ended so.

        The read ran to its end (a pinned grant outlives its lease until its
        reads end), but the server no longer stands behind the grant.
        """
        for task in self._renewer:
            if task.done() and not task.cancelled():
                error = task.exception()
                if isinstance(error, LeaseRefusedError):
                    return error
        return None

    def stop(self) -> None:
        """No more renewals (one under way is cancelled)."""
        self._due.cancel()
        for task in self._renewer:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # a refusal the read's own failure made moot


async def _renew_while_reading(link: PeerLink, grant: str, begun: BegunRead,
                               cfg: AgentConfig) -> None:
    """Renew now, then every ``renew_every_s`` (started once ``begun`` ran that long),
    while the server serves it (``begun.asked``: else that round is skipped).

    Raises:
        LeaseRefusedError: the server refused (the grant is gone); the read
            fails when it ends (``LeaseRenewal.refusal``). A ``NoReadServedError``
            is no verdict on the read (the server's half of it is over, or not
            pinned yet): the next round asks again. Any other failure ends the
            renewals only: a dead link fails the read by itself.
    """
    while True:
        xfer_id = begun.request.xfer_id  # a copy that asked again asked under a new one
        try:
            if begun.asked:
                remaining = await link.renew(grant, cfg.lease_s, xfer_id)
                logger.debug("renewed grant of read %d for %.1fs", xfer_id, remaining)
        except NoReadServedError as exc:
            logger.debug("lease renewal of read %d extended nothing: %s", xfer_id, exc)
        except LeaseRefusedError as exc:
            logger.info("lease renewal of read %d refused: %s", xfer_id, exc)
            raise
        except TransferError as exc:
            logger.info("lease renewal of read %d failed: %s", xfer_id, exc)
            return
        await asyncio.sleep(cfg.renew_every_s)
