"""The engine process's message pipe: whole messages, in order, however the bytes arrive, on a
non-blocking fd (as uvloop leaves it), and EOF once the writer is gone; a writer that never blocks."""
from __future__ import annotations

import os
import threading
import time

from hypothesis import given, settings, strategies as st

from flexengine.server.pipe import MessageReader, MessageWriter

PIPE_CAPACITY = 64 * 1024  # Linux's default: a bigger message cannot be in the pipe whole


def read_until_eof(reader: MessageReader) -> tuple[list, int]:
    """Everything the writer sends, and how many reads left a partial message waiting in the buffer."""
    got, partial_reads = [], 0
    while not reader.eof:
        reader.wait(5.0)
        got += reader.read_available()
        partial_reads += bool(reader.buffer)
    return got, partial_reads


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 300_000)), min_size=1, max_size=6), st.booleans())
def test_messages_arrive_whole_and_in_order(specs, drain_each):
    """The writer queues what a full pipe does not take and writes it as the pipe drains, either after
    each message or once at the end."""
    messages = [{"index": i, "kind": kind, "payload": bytes([i % 251]) * size} for i, (kind, size) in enumerate(specs)]
    read_fd, write_fd = os.pipe()
    reader = MessageReader(read_fd)
    assert not os.get_blocking(read_fd)

    def write():
        writer = MessageWriter(write_fd)
        for message in messages:
            writer.send(message)
            if drain_each:
                assert writer.drain(10.0)
        assert writer.drain(10.0) and not writer.buffer
        os.close(write_fd)

    writer = threading.Thread(target=write)
    writer.start()
    got, partial_reads = read_until_eof(reader)
    writer.join()
    os.close(read_fd)
    assert got == messages
    assert reader.buffer == bytearray()
    if any(len(m["payload"]) > PIPE_CAPACITY for m in messages):
        assert partial_reads > 0  # the case that broke Connection.recv did happen here


def test_send_into_a_full_pipe_returns_at_once():
    read_fd, write_fd = os.pipe()
    writer, reader = MessageWriter(write_fd), MessageReader(read_fd)
    messages = [{"i": i, "payload": b"x" * 100_000} for i in range(5)]
    started = time.perf_counter()
    for message in messages:
        writer.send(message)
    assert time.perf_counter() - started < 1.0 and len(writer.buffer) > 4 * 100_000
    assert not writer.flush() and not writer.drain(0.01)  # nobody reads: it cannot finish
    got = []
    while len(got) < len(messages):
        reader.wait(1.0)
        got += reader.read_available()
        writer.flush()
    assert got == messages and not writer.buffer
    os.close(write_fd)
    os.close(read_fd)


def test_nothing_to_read_returns_no_messages_without_blocking():
    read_fd, write_fd = os.pipe()
    reader = MessageReader(read_fd)
    assert reader.read_available() == [] and not reader.eof
    assert not reader.wait(0.01)
    os.write(write_fd, (10).to_bytes(8, "big") + b"12345")  # half a message
    assert reader.wait(0.01)
    assert reader.read_available() == [] and len(reader.buffer) == 13
    os.close(write_fd)
    assert reader.read_available() == [] and reader.eof
    os.close(read_fd)


def test_writer_whose_reader_is_gone_drops_messages_without_blocking():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    writer = MessageWriter(write_fd)
    for i in range(20):
        writer.send({"i": i, "payload": b"x" * 100_000})
    assert writer.broken and not writer.buffer and writer.drain(0.01)
    os.close(write_fd)
