"""A training run's budget: its time (`max_minutes`) and the stop its user asks for (SIGTERM, or a first Ctrl-C).
Either ends the run as its last step would, with a checkpoint and the drafter, so `--resume` loses nothing; a
second Ctrl-C interrupts at once (the checkpoint before stays the latest)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger("mmvsd.training")


class Budget:
    def __init__(self, max_minutes: float = 0) -> None:
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes > 0 else math.inf  # time.monotonic()
        self.requested = 0  # the signal that asked for a stop, 0: none

    def stopped(self) -> bool:
        """A stop was asked for."""
        return bool(self.requested)

    def spent(self, seconds_ahead: float = 0.0) -> bool:
        """A stop was asked for, or the time will be up `seconds_ahead` from now."""
        return self.stopped() or time.monotonic() + seconds_ahead > self.deadline

    @contextlib.contextmanager
    def listening(self) -> Iterator[Budget]:
        """Within it, SIGTERM and a first Ctrl-C ask for a stop (outside the main thread signals are not ours)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def ask(signum, frame) -> None:
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = signum
            logger.warning("%s: stopping after this step with a checkpoint and the drafter (--resume goes on; "
                           "Ctrl-C again stops at once)", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
