"""What every pdserve server process does: logging, the ready line, and clean shutdown (and a
free loopback port for the tools that start them)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys

READY_PREFIX = "PDSERVE_READY "

log = logging.getLogger(__name__)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging(level: str | None = None) -> None:
    level = str(level or os.environ.get("PDSERVE_LOG_LEVEL") or "INFO").upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level: {level.lower()!r} is not one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", stream=sys.stderr)
    # The level is pdserve's own (and a module run as a script's); other libraries say their
    # warnings only: gRPC's DEBUG writes lines per health probe that would bury ours.
    logging.getLogger().setLevel(max(logging.getLevelName(level), logging.WARNING))
    for name in ("pdserve", "__main__"):
        logging.getLogger(name).setLevel(level)


def raise_open_file_limit() -> None:
    """Lifts this process's soft limit on open files to the hard one, as servers do: each client
    connection holds a descriptor, and a default of 1024 lets a few hundred idle connections
    stop every front end of the process."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit some kernels refuse as a soft one
            pass


def announce_ready(role: str, **addresses: object) -> None:
    """Prints the machine-readable line a launcher waits for (and a human can read)."""
    print(READY_PREFIX + json.dumps({"role": role, **addresses}), flush=True)


def free_port() -> int:
    """A loopback port nobody holds right now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_ready(line: str) -> dict | None:
    if not line.startswith(READY_PREFIX):
        return None
    return json.loads(line[len(READY_PREFIX) :])


async def wait_for_shutdown_signal() -> str:
    """Returns the name of the first SIGINT/SIGTERM received. Later ones are logged, not obeyed,
    for the rest of the event loop's life: Ctrl-C reaches every child of ``pdserve up``, whose
    SIGTERM follows, and the second signal must not cut the (bounded) drain short."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if received.done():
            log.info("%s: already shutting down", sig.name)
        else:
            received.set_result(sig.name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return await received
