"""``ucx_perftest`` between two processes: the UCX ceiling.

Called by ``kvbridge/bench/transfer_bench.py`` through :func:`run_peer` (same
signature as the other peers) or :func:`run_perftest` for one size; also a
script (``python -m kvbridge.bench.peers.ucx_perftest --blocks 1,16,1024``).

The binary ships in the ``libucx`` wheel (``libucx/bin/ucx_perftest``) next to
the libraries it needs (``libucx/lib``). We start it as a server on a free
port, wait until the port listens, then run the client against the server's
address (127.0.0.1, or with ``--netns`` the server's namespace host, client and
server in two namespaces with ``UCX_TLS=tcp``: ``placement.py``) with
``-t tag_bw -s <nbytes> -n <iters> -f -v`` and read the final CSV line. Each
message is one contiguous buffer of the request's size, with up to 32 in
flight: no scatter, no per-request handshake, no data check. That is the
transport's best case, which is what kvbridge's ratio is taken against.

tag_bw is two-sided: the receiver must be running to match each message, so
on a busy 2-core machine it can fall below a one-sided READ. ``ucp_get``
(peer name ``ucx_perftest_get``) measures one-sided gets of the same sizes,
the operation NIXL's READ uses; pass ``test="ucp_get"`` to get it.

``ucx_perftest`` prints bandwidth in MB/s with MB = 2**20 bytes; results here
are converted to GB/s (1e9 B/s) like every other peer.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from kvbridge.bench.peers.child_env import child_env
from kvbridge.bench.peers.cli import standalone_main
from kvbridge.bench.peers.placement import LOOPBACK, Placement
from kvbridge.bench.peers.results import PeerOutcome, PeerResult, Unavailable
from kvbridge.bench.peers.workload import KVWorkload

PEER = "ucx_perftest"
_HOST = "127.0.0.1"
_MIB = 1 << 20
_TCP_LISTEN = "0A"  # socket state code of LISTEN in /proc/net/tcp
_LISTEN_TIMEOUT_S = 10.0
_MIN_MESSAGES = 64  # twice the tag_bw window, so the pipeline really fills
_MIN_RUN_NBYTES = 256 * _MIB
_PEER_OF_TEST = MappingProxyType({"tag_bw": PEER, "ucp_get": "ucx_perftest_get"})


class PerftestError(RuntimeError):
    """``ucx_perftest`` is missing, failed, or printed something unexpected."""


@dataclass(frozen=True, slots=True)
class PerftestRun:
    """Final line of one tag_bw run.

    Attributes:
        nbytes: Message size.
        num_iters: Messages sent (after warm-up).
        gbps_overall: Bytes of all messages over the whole run's time, GB/s.
        overhead_p50_us: Median time per message as the tool measures it (with
            32 messages in flight this is not a latency).
        output: What the client printed (stdout, then stderr), then the server:
            UCX's own log lines (``UCX_PROTO_INFO``, warnings) come with it.
    """

    nbytes: int
    num_iters: int
    gbps_overall: float
    overhead_p50_us: float
    output: str = ""


def find_perftest() -> Path:
    """Path of ``ucx_perftest`` inside the installed ``libucx`` wheel.

    Raises:
        PerftestError: no ``libucx`` package, or it has no ``bin/ucx_perftest``.
    """
    spec = importlib.util.find_spec("libucx")
    if spec is None or spec.origin is None:
        raise PerftestError("package libucx (the libucx-cu12 wheel) is not installed")
    binary = Path(spec.origin).parent / "bin" / "ucx_perftest"
    if not os.access(binary, os.X_OK):
        raise PerftestError(f"no executable ucx_perftest at {binary}")
    return binary


def _perftest_env(binary: Path, placement: Placement) -> dict[str, str]:
    return {**child_env({"LD_LIBRARY_PATH": str(binary.parent.parent / "lib")}),
            **placement.env}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _is_listening(port: int, pid: int) -> bool:
    """True when some IPv4 socket listens on ``port`` in the network namespace of
    process ``pid`` (without connecting to it: the server would take a probe
    connection for the test's client); False too once ``pid`` has exited."""
    try:
        with open(f"/proc/{pid}/net/tcp") as table:
            rows = table.readlines()[1:]  # after the header
    except OSError:  # gone: the caller's poll() says so
        return False
    return any(int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == _TCP_LISTEN
               for fields in (row.split() for row in rows))


def _parse_final_csv(stdout: str, nbytes: int) -> PerftestRun:
    """Read ``iterations,<pct>_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,...``.

    UCX's own log lines (``[stamp] [host:pid:thread] ...``: a warning, protocol
    tables) may come between the header and its values; they are skipped.
    """
    lines = [line.strip() for line in stdout.splitlines()
             if line.strip() and not line.startswith("[")]
    for header, values in zip(lines, lines[1:], strict=False):
        if "overall_bw" not in header:
            continue
        row = dict(zip(header.split(","), values.split(","), strict=False))
        pct_key = next(k for k in row if k.endswith("_percentile_lat"))
        return PerftestRun(
            nbytes=nbytes,
            num_iters=int(row["iterations"]),
            gbps_overall=float(row["overall_bw"]) * _MIB / 1e9,
            overhead_p50_us=float(row[pct_key]),
        )
    raise PerftestError(f"no final CSV line in ucx_perftest output: {stdout[-500:]!r}")


def run_perftest(nbytes: int, iters: int, warmup: int = 10, timeout_s: float = 120.0,
                 test: str = "tag_bw", placement: Placement = LOOPBACK, *,
                 memory: str = "host", num_pieces: int = 1,
                 error_handling: bool = False) -> PerftestRun:
    """One run of ``iters`` messages of ``nbytes`` between two processes.

    Args:
        test: ``tag_bw`` (two-sided) or ``ucp_get`` (one-sided read).
        placement: Server on its serving side, client on its reading side.
        memory: ``host``, or ``cuda`` (both sides' buffers in GPU memory).
        num_pieces: > 1: each message is a scatter-gather list of that many equal
            pieces on both sides (``-D iov,iov``); ``nbytes`` must divide evenly.
        error_handling: endpoints with peer error handling on both sides (``-e``, as
            a reader that must survive a dead peer needs), and for ``ucp_get`` a
            responder that does not progress (``-o``): whether UCX serves the get
            without the serving process (docs/design.md, "One-sided reads").

    Raises:
        ValueError: ``nbytes`` or ``iters`` < 1, ``warmup`` < 0, unknown ``test``.
        PerftestError: binary missing, server never listened, a side failed or
            timed out (both processes are gone when this raises).
    """
    if nbytes < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"need nbytes, iters >= 1 and warmup >= 0, got {nbytes}, {iters}, "
                         f"{warmup}")
    if test not in _PEER_OF_TEST:
        raise ValueError(f"test must be one of {sorted(_PEER_OF_TEST)}, got {test!r}")
    if memory not in ("host", "cuda") or num_pieces < 1 or nbytes % num_pieces:
        raise ValueError(f"memory must be host or cuda and num_pieces divide nbytes, got "
                         f"{memory!r}, {num_pieces} pieces of {nbytes} bytes")
    sizes = ",".join([str(nbytes // num_pieces)] * num_pieces)
    layout = ["-D", "iov,iov"] if num_pieces > 1 else []
    mem = ["-m", f"{memory},{memory}"] if memory != "host" else []
    both = ["-e"] if error_handling else []
    passive = ["-o"] if error_handling and test == "ucp_get" else []
    binary = find_perftest()
    env = _perftest_env(binary, placement)
    port = _free_port()  # on this host; a fresh namespace host has every port free
    with tempfile.TemporaryFile() as server_log:
        # ``ip netns exec`` execs the command: server.pid is the server's own pid
        server = subprocess.Popen(placement.serve.command([str(binary), "-p", str(port),
                                                           *both]),
                                  env=env, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            give_up = time.monotonic() + _LISTEN_TIMEOUT_S
            while not _is_listening(port, server.pid):
                if server.poll() is not None or time.monotonic() > give_up:
                    server_log.seek(0)
                    raise PerftestError(f"server did not listen on port {port}: "
                                        f"{server_log.read()[-300:]!r}")
                time.sleep(0.02)
            client = subprocess.run(
                placement.read.command([str(binary), placement.serve.ip, "-p", str(port),
                                        "-t", test, "-s", sizes, "-n", str(iters),
                                        "-w", str(warmup), "-f", "-v", *layout, *mem,
                                        *both, *passive]),
                env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
            )
            if client.returncode != 0:
                raise PerftestError(f"client exited with {client.returncode}: "
                                    f"{(client.stderr or client.stdout)[-300:]!r}")
            server.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise PerftestError(f"ucx_perftest timed out after {timeout_s:.0f} s") from exc
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        server_log.seek(0)
        server_output = server_log.read().decode(errors="replace")
    return replace(_parse_final_csv(client.stdout, nbytes),
                   output=client.stdout + client.stderr + server_output)


def run_peer(sizes: list[int], iters: int, workload: KVWorkload | None = None,
             warmup: int | None = None, timeout_s: float | None = None,
             test: str = "tag_bw", placement: Placement = LOOPBACK) -> PeerOutcome:
    """``test`` at each request size, as a one-message-per-request ceiling.

    Args:
        sizes: Message sizes in bytes (the requests' total sizes).
        iters: Messages per size; raised so each run sends at least 64
            messages and 256 MiB, or the 32-deep window never fills.
        workload: Accepted for the common peer signature; only used to check
            the sizes fit it.
        warmup: Untimed messages; default a tenth of the messages, at least 2.
        timeout_s: Deadline per run; default scales with the bytes sent.
        test: ``tag_bw`` (peer ``ucx_perftest``) or ``ucp_get`` (peer
            ``ucx_perftest_get``).
        placement: Where server and client run (default: both on loopback).

    Returns:
        One ``PeerResult`` per size (``verified`` is False: the tool sends no
        checkable data, and its latency fields are ``None``), or
        ``Unavailable`` when the binary is missing or a run fails.

    Raises:
        ValueError: ``iters`` < 1, a size < 1, or unknown ``test``.
        WorkloadError: a size does not fit ``workload``.
    """
    if iters < 1 or any(n < 1 for n in sizes):
        raise ValueError(f"need iters >= 1 and sizes >= 1, got iters={iters} sizes={sizes}")
    if test not in _PEER_OF_TEST:
        raise ValueError(f"test must be one of {sorted(_PEER_OF_TEST)}, got {test!r}")
    if workload is not None:
        for nbytes in sizes:
            workload.num_blocks_for(nbytes)
    results: list[PeerResult] = []
    try:
        for nbytes in sizes:
            num_iters = max(iters, _MIN_MESSAGES, -(-_MIN_RUN_NBYTES // nbytes))
            num_warmup = max(2, num_iters // 10) if warmup is None else warmup
            run_timeout_s = timeout_s or 60.0 + nbytes * (num_iters + num_warmup) / 50e6
            run = run_perftest(nbytes, num_iters, num_warmup, run_timeout_s, test, placement)
            results.append(PeerResult(
                peer=_PEER_OF_TEST[test], nbytes=nbytes, num_blocks=1, num_iters=run.num_iters,
                gbps_median=run.gbps_overall, latency_p50_us=None, latency_p99_us=None,
                verified=False, note=f"{test}, one contiguous message per request, overall",
            ))
    except PerftestError as exc:
        return Unavailable(_PEER_OF_TEST[test], str(exc))
    return results


def main(argv: list[str] | None = None) -> int:
    """CLI: print GB/s at the benchmark's request sizes."""

    def add_test(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--test", choices=sorted(_PEER_OF_TEST), default="tag_bw")

    return standalone_main(argv, __doc__.splitlines()[0],
                           lambda sizes, iters, opts: run_peer(sizes, iters, test=opts.test),
                           add_test)


if __name__ == "__main__":
    sys.exit(main())
