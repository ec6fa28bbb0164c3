"""The stand-alone command line every peer module shares.

``python -m kvbridge.bench.peers.<peer> --blocks 1,16,1024 --iters 20`` runs one
peer outside ``kvbridge bench`` and prints one result per size; each peer
module's ``main`` calls :func:`standalone_main`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from kvbridge.bench.peers.results import PeerOutcome, Unavailable
from kvbridge.bench.peers.workload import DEFAULT_BLOCK_COUNTS, sizes_for_blocks

__all__ = ["standalone_main"]

RunPeer = Callable[[list[int], int, argparse.Namespace], PeerOutcome]
"""``run(sizes, iters, options)`` of one peer."""


def standalone_main(argv: Sequence[str] | None, description: str, run: RunPeer,
                    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
                    ) -> int:
    """Parse ``--blocks`` and ``--iters`` (plus the peer's own flags), run, print.

    Args:
        argv: Command-line words (``None``: ``sys.argv[1:]``).
        description: First line of the help text.
        run: Runs the peer on the request sizes.
        add_arguments: Adds the peer's own flags to the parser.

    Returns:
        0 with a result per size printed, 1 when the peer was unavailable.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCK_COUNTS)),
                        help="request sizes in 64 KiB blocks, comma separated")
    parser.add_argument("--iters", type=int, default=20, help="timed requests per size")
    if add_arguments is not None:
        add_arguments(parser)
    opts = parser.parse_args(argv)
    sizes = sizes_for_blocks([int(n) for n in opts.blocks.split(",")])
    outcome = run(sizes, opts.iters, opts)
    if isinstance(outcome, Unavailable):
        print(outcome)
        return 1
    for row in outcome:
        print(row)
    return 0
