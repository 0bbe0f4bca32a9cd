"""Stopping a run on SIGINT or SIGTERM after a checkpoint."""

from __future__ import annotations

import signal
import threading

from preinfer.trainer import Trainer


class RunStopped(SystemExit):
    """A run stopped by a signal after writing its checkpoint; its code is 128 + the signal number (a SystemExit,
    so that the command line ends with that code without a handler of its own)."""


class StopOnSignals:
    """While training, SIGINT and SIGTERM ask the trainer to stop after its current step (it checkpoints first);
    the first signal puts the previous handlers back, so a second one interrupts or kills as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self.previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum
        self.trainer.stop_requested = True
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()
