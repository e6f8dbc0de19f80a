"""What every server process does on shutdown signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from pdserve.process import wait_for_shutdown_signal


async def test_a_second_signal_during_the_drain_is_logged_not_obeyed(caplog):
    """Ctrl-C reaches every child of ``pdserve up`` and the launcher's SIGTERM follows: the
    second must not kill a server half-way through its drain."""
    caplog.set_level(logging.INFO, logger="pdserve.process")
    loop = asyncio.get_running_loop()
    try:
        waiting = asyncio.create_task(wait_for_shutdown_signal())
        await asyncio.sleep(0.05)  # the handlers are in place
        os.kill(os.getpid(), signal.SIGINT)
        assert await asyncio.wait_for(waiting, 10) == "SIGINT"
        for sig in (signal.SIGTERM, signal.SIGINT):  # the default actions: die, KeyboardInterrupt
            os.kill(os.getpid(), sig)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if f"{sig.name}: already shutting down" in caplog.text:
                    break
            assert f"{sig.name}: already shutting down" in caplog.text
    finally:  # the test session's loop lives on: give the signals back to pytest
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def test_the_log_level_is_pdserves_and_other_libraries_keep_to_warnings():
    """--log-level DEBUG shows pdserve's debug lines, not gRPC's per-probe ones."""
    from pdserve.process import setup_logging

    names = ("", "pdserve", "__main__")
    saved = {name: logging.getLogger(name).level for name in names}
    try:
        setup_logging("DEBUG")
        assert logging.getLogger("pdserve.router.dispatch").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.INFO)
        setup_logging("ERROR")
        assert not logging.getLogger("pdserve.router.dispatch").isEnabledFor(logging.WARNING)
        assert not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.WARNING)
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_a_server_lifts_its_open_file_limit_to_the_hard_one():
    """Each connection holds a descriptor: at a soft limit of 256, a few hundred idle HTTP
    connections stopped the router's gRPC front end too."""
    import shutil
    import subprocess
    import sys

    import pytest

    if shutil.which("prlimit") is None:
        pytest.skip(reason="prlimit (util-linux) is not installed")
    script = (
        "import resource; from pdserve.process import raise_open_file_limit; raise_open_file_limit(); "
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run(
        ["prlimit", "--nofile=256:4096", sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4096", "4096"]
