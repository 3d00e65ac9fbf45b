"""A signal watcher for the Triton backend's stub, whose main thread waits outside Python
(SIGUSR1 writes the step timeline)."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable


class SignalWatch:
    """Calls ``callback`` on a thread of its own each time the process gets ``signum``.

    The C-level handler writes to a socket (``signal.set_wakeup_fd``) from whichever thread
    the signal lands on, so this works while the main thread is blocked outside Python (the
    Triton stub's is). Must be created on the main thread; :meth:`close` restores the
    previous handler and wakeup fd.
    """

    def __init__(self, signum: int, callback: Callable[[], None],
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.signum, self.callback, self.on_error = signum, callback, on_error
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous = signal.signal(signum, lambda *_: None)  # raises off the main thread
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="kvflow-signal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if self.signum in data:
                try:
                    self.callback()
                except Exception as e:  # noqa: BLE001  (a failed write must not end the watch)
                    if self.on_error is not None:
                        self.on_error(e)

    def close(self) -> None:
        """Restore the previous handler (SIG_IGN if there was none Python knew of) and wakeup
        fd. Off the main thread they cannot be restored: the sockets are then left open (the
        C handler still writes to the wakeup fd, which must not be reused), and the thread
        stops."""
        try:
            signal.set_wakeup_fd(self._previous_fd)
            signal.signal(self.signum, self._previous if self._previous is not None
                          else signal.SIG_IGN)
        except ValueError:
            self.callback = lambda: None
            return
        self._write.close()
        self._read.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)
        self._read.close()
