"""Length-prefixed pickled messages over a pipe, read without ever blocking.

The engine process's outputs are read on the API process's event loop. uvloop (libuv) puts a watched
fd in non-blocking mode, and multiprocessing's Connection.recv on a non-blocking fd raises
BlockingIOError halfway through a message that has not fully arrived, having consumed its first part:
every later message is then misread. That happened on the H100, where one step's message (256 rows)
is written in two parts. So the reading side takes whatever bytes are there and hands out only whole
messages; the writing side (the engine process, blocking fd) writes each message in full.

    send_message(fd, obj)             # writer: blocks until all of it is in the pipe
    writer = MessageWriter(fd)        # or: pickled and written by a thread; writer.close() flushes
    reader = MessageReader(fd)        # reader: makes fd non-blocking
    reader.read_available()           # the whole messages readable now, in order; reader.eof once closed
"""
from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import threading

_LENGTH = struct.Struct("!Q")
_READ_SIZE = 1 << 20


def send_message(fd: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class MessageWriter:
    """send_message on a thread of its own: the engine's next step does not wait for the pickling or
    for a full pipe (the GIL is free while the GPU runs a step). At most max_pending messages wait;
    past that, send blocks, which is the backpressure a slow reader should exert."""

    def __init__(self, fd: int, max_pending: int = 8):
        self.fd = fd
        self.pending: queue.Queue = queue.Queue(max_pending)
        self.broken = False  # the reader is gone: later messages are dropped, never block the sender
        self.thread = threading.Thread(target=self._write, name="flexengine-outputs", daemon=True)
        self.thread.start()

    def send(self, message) -> None:
        self.pending.put(message)

    def close(self) -> None:
        """Write everything sent so far, then stop the thread."""
        self.pending.put(None)
        self.thread.join()

    def _write(self) -> None:
        while (message := self.pending.get()) is not None:
            if self.broken:
                continue
            try:
                send_message(self.fd, message)
            except BrokenPipeError:
                self.broken = True


class MessageReader:
    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd = fd
        self.buffer = bytearray()
        self.eof = False  # the writer closed its end (exited or died); nothing more will come

    def wait(self, timeout: float | None) -> bool:
        """Wait until something (bytes or EOF) can be read; False on timeout."""
        return bool(select.select([self.fd], [], [], timeout)[0])

    def read_available(self) -> list:
        """Every whole message that has arrived, without waiting for the rest of a partial one."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
            self.buffer += chunk
            if len(chunk) < _READ_SIZE:  # drained for now: a writer that keeps writing cannot hold us here
                break
        messages, start = [], 0
        while len(self.buffer) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self.buffer, start)
            end = start + _LENGTH.size + size
            if end > len(self.buffer):
                break
            messages.append(pickle.loads(self.buffer[start + _LENGTH.size:end]))
            start = end
        del self.buffer[:start]
        return messages
