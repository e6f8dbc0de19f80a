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
