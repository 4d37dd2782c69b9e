"""Length-prefixed pickled messages over a pipe, written and read without ever blocking.

The engine process's outputs are read on the API process's event loop. uvloop (libuv) puts a watched
fd in non-blocking mode, and multiprocessing's Connection.recv on a non-blocking fd raises
BlockingIOError halfway through a message that has not fully arrived, having consumed its first part:
every later message is then misread. That happened on the H100, where one step's message (256 rows)
is written in two parts. So the reading side takes whatever bytes are there and hands out only whole
messages, and the writing side keeps what a full pipe does not take yet and writes it later.

Both sides call these from the thread that owns the loop (the event loop; the engine loop): no helper
thread has to win the GIL from an engine loop that is busy on the host, which made each message wait
for the interpreter's 5 ms switch interval.

    writer = MessageWriter(fd)        # makes fd non-blocking
    writer.send(obj)                  # what the pipe takes now is written; the rest waits in writer.buffer
    writer.flush()                    # when fd is writable again: True once nothing waits
    reader = MessageReader(fd)        # makes fd non-blocking
    reader.read_available()           # the whole messages readable now, in order; reader.eof once closed
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import time

_LENGTH = struct.Struct("!Q")
_READ_SIZE = 1 << 20


def encode(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


class MessageWriter:
    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd = fd
        self.buffer = bytearray()  # encoded messages the pipe has not taken yet
        self.broken = False        # the reader is gone: later messages are dropped

    def send(self, message) -> None:
        if not self.broken:
            self.buffer += encode(message)
            self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; True once nothing waits."""
        while self.buffer:
            try:
                written = os.write(self.fd, self.buffer)
            except BlockingIOError:
                return False
            except BrokenPipeError:
                self.broken = True
                self.buffer.clear()
                break
            del self.buffer[:written]  # cheap: a bytearray drops its head by moving its start
        return True

    def wait_writable(self, timeout: float | None) -> bool:
        return bool(select.select([], [self.fd], [], timeout)[1])

    def drain(self, timeout: float | None = None) -> bool:
        """Block until everything sent is written or the reader is gone; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.flush():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 or not self.wait_writable(remaining):
                return False
        return True


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
