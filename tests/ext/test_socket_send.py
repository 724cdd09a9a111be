"""Batched non-blocking sends: compiled == twin, on real Unix and TCP loopback sockets.

The sender thread (web/socket_sender.py) trusts each result to say exactly how many bytes the kernel
took, so a partial count must match what the peer can read, and failures must come back as -errno."""
from __future__ import annotations

import errno
import os
import random
import select
import socket
import struct
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from ext import socket_send_py
from tests.ext.twins import compiled_module, twin_and_compiled

compiled = compiled_module("socket_send")
MODULES = twin_and_compiled("socket_send")
SMALL_BUFFER = 4096  # the kernel raises it to its minimum: still far below the payloads here
READER_BUFFER = 1 << 16  # a TCP reader as small as the writer crawls (window probes), this one does not
BAD_FD = 1 << 20  # above any RLIMIT_NOFILE used here: never an open descriptor

Pair = tuple[socket.socket, socket.socket]


def unix_pair() -> Pair:
    return socket.socketpair()


def tcp_pair() -> Pair:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return writer, reader


PAIRS = [pytest.param(unix_pair, id="unix"), pytest.param(tcp_pair, id="tcp")]


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    """Makes socket pairs (optionally with small buffers) and closes them all after the test."""
    made: list[socket.socket] = []

    def make(kind: Callable[[], Pair], small: bool = False) -> Pair:
        writer, reader = kind()
        made.extend((writer, reader))
        if small:
            writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_BUFFER)
        writer.setblocking(False)
        reader.settimeout(5)  # a missing byte fails the test instead of hanging it
        return writer, reader

    yield make
    for sock in made:
        sock.close()


def payload(size: int, seed: int = 0) -> bytes:
    """Random bytes (fixed per seed): any misordering or loss shows up in the comparison."""
    return random.Random(seed).randbytes(size)


def read_exactly(reader: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = reader.recv(min(size - got, 1 << 16))
        assert chunk, f"EOF after {got} of {size} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def assert_nothing_more(reader: socket.socket) -> None:
    reader.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            reader.recv(1)
    finally:
        reader.settimeout(5)


def close_abruptly(sock: socket.socket) -> None:
    """Closes with SO_LINGER 0: a TCP peer resets instead of finishing (no effect on Unix sockets)."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def wait_for_error_or_hangup(sock: socket.socket) -> None:
    """The peer's reset reaches this socket asynchronously on TCP; Unix sockets see the close at once."""
    poller = select.poll()
    poller.register(sock, select.POLLERR | select.POLLHUP)
    assert poller.poll(5000), "the peer's close never reached the socket"


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("kind", PAIRS)
def test_every_byte_arrives_in_order_on_each_socket(module: ModuleType, kind, pairs) -> None:
    """Room in every socket: each buffer is taken whole and the peers read exactly it."""
    made = [pairs(kind) for _ in range(4)]
    buffers = [payload(size, seed) for seed, size in enumerate([1, 1000, 12_000, 777])]
    results = module.send_all([writer.fileno() for writer, _ in made], buffers)
    assert results == [len(buffer) for buffer in buffers]
    for (_, reader), buffer in zip(made, buffers):
        assert read_exactly(reader, len(buffer)) == buffer
        assert_nothing_more(reader)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("kind", PAIRS)
def test_a_full_send_buffer_takes_part_and_the_rest_follows_after_reading(module: ModuleType, kind, pairs) -> None:
    """The count is exact: the peer reads those bytes and no more; the caller resends the rest."""
    writer, reader = pairs(kind, small=True)
    data = payload(4 << 20)
    [taken] = module.send_all([writer.fileno()], [data])
    assert 0 < taken < len(data)
    assert read_exactly(reader, taken) == data[:taken]
    assert_nothing_more(reader)
    received, done = [data[:taken]], taken
    for _ in range(100_000):  # each round waits on the peer's real recv
        if done == len(data):
            break
        [sent] = module.send_all([writer.fileno()], [data[done:]])
        assert sent >= 0
        received.append(read_exactly(reader, sent))
        done += sent
    assert done == len(data)
    assert b"".join(received) == data


@pytest.mark.parametrize("module", MODULES)
def test_a_full_unix_socket_takes_nothing(module: ModuleType, pairs) -> None:
    """Nobody reads, so the space a partial send ran out of stays gone: the next send takes 0."""
    writer, reader = pairs(unix_pair, small=True)
    [taken] = module.send_all([writer.fileno()], [payload(1 << 20)])
    assert 0 < taken < 1 << 20
    assert module.send_all([writer.fileno(), writer.fileno()], [b"x", payload(1000)]) == [0, 0]
    assert read_exactly(reader, taken) == payload(1 << 20)[:taken]


@pytest.mark.parametrize("module", MODULES)
def test_a_full_tcp_socket_takes_nothing(module: ModuleType, pairs) -> None:
    """TCP may still move bytes to the peer's window after the first partial send; once both buffers
    are full, a send takes 0 and nothing is lost."""
    writer, reader = pairs(tcp_pair, small=True)
    data, done, zero_seen = payload(4 << 20), 0, False
    for _ in range(10_000):
        [sent] = module.send_all([writer.fileno()], [data[done:]])
        assert sent >= 0
        if sent == 0:
            zero_seen = True
            break
        done += sent
    assert zero_seen and 0 < done < len(data)
    assert read_exactly(reader, done) == data[:done]


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("kind", PAIRS)
def test_a_closed_peer_gives_minus_errno(module: ModuleType, kind, pairs) -> None:
    """No SIGPIPE (MSG_NOSIGNAL): the failure comes back as -EPIPE, or -ECONNRESET from a TCP reset."""
    writer, reader = pairs(kind)
    close_abruptly(reader)
    wait_for_error_or_hangup(writer)
    [first] = module.send_all([writer.fileno()], [payload(100)])
    assert first in (-errno.EPIPE, -errno.ECONNRESET)
    assert module.send_all([writer.fileno()], [payload(100)]) == [-errno.EPIPE]


@pytest.mark.parametrize("module", MODULES)
def test_a_failed_socket_does_not_stop_the_others(module: ModuleType, pairs) -> None:
    """One result per socket: a bad descriptor or a closed peer in the batch leaves the rest sent."""
    first, closed, last = (pairs(unix_pair) for _ in range(3))
    closed[1].close()
    buffers = [payload(500, 1), payload(600, 2), payload(700, 3), payload(800, 4)]
    results = module.send_all([first[0].fileno(), BAD_FD, closed[0].fileno(), last[0].fileno()], buffers)
    assert results == [500, -errno.EBADF, -errno.EPIPE, 800]
    assert read_exactly(first[1], 500) == buffers[0]
    assert read_exactly(last[1], 800) == buffers[3]


@pytest.mark.parametrize("module", MODULES)
def test_bad_descriptors_give_minus_ebadf(module: ModuleType) -> None:
    """A descriptor that is not open is a failed socket, not an exception."""
    assert module.send_all([BAD_FD, BAD_FD], [b"x", payload(100)]) == [-errno.EBADF, -errno.EBADF]


@pytest.mark.parametrize("module", MODULES)
def test_a_negative_descriptor_gives_minus_ebadf_and_one_past_a_c_int_raises(module: ModuleType) -> None:
    """send(2) on -1 fails with EBADF; a descriptor that does not fit a C int is a caller's error."""
    assert module.send_all([-1], [b"x"]) == [-errno.EBADF]
    with pytest.raises(OverflowError):
        module.send_all([1 << 31], [b"x"])


@pytest.mark.parametrize("module", MODULES)
def test_a_non_socket_descriptor_gives_minus_enotsock(module: ModuleType) -> None:
    read_end, write_end = os.pipe()
    try:
        assert module.send_all([write_end], [b"x"]) == [-errno.ENOTSOCK]
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("module", MODULES)
def test_empty_buffers_and_empty_batches_send_nothing(module: ModuleType, pairs) -> None:
    """An empty buffer makes no send at all: 0 even where a send would fail."""
    writer, reader = pairs(unix_pair)
    assert module.send_all([], []) == []
    assert module.send_all([writer.fileno(), BAD_FD], [b"", b""]) == [0, 0]
    assert module.send_all([writer.fileno()], [b"after"]) == [5]
    assert read_exactly(reader, 5) == b"after"
    assert_nothing_more(reader)


@pytest.mark.parametrize("module", MODULES)
def test_argument_errors(module: ModuleType, pairs) -> None:
    """Misuse raises before anything is sent."""
    writer, reader = pairs(unix_pair)
    fd = writer.fileno()
    with pytest.raises(ValueError):
        module.send_all([fd, fd], [b"x"])
    with pytest.raises(ValueError):
        module.send_all([], [b"x"])
    for wrong in (bytearray(b"x"), memoryview(b"x"), "x", None):
        with pytest.raises(TypeError):
            module.send_all([fd, fd], [b"first", wrong])
    with pytest.raises(TypeError):
        module.send_all(["not a descriptor"], [b"x"])
    assert_nothing_more(reader)


def test_twin_and_compiled_agree_on_the_same_operations(pairs) -> None:
    """Two identical setups, the same sequence of sends and reads: equal results at every step."""
    if compiled is None:
        pytest.skip("not built")

    full_sizes = [300_000, 5000, 2000, 300_000, 1, 70_000]
    read_parts = [1.0, 0.5, 0.0, 1.0, 0.3, 1.0]  # of what the full socket holds: part frees no room

    def run(module: ModuleType) -> list[list[int]]:
        room, full, gone = pairs(unix_pair), pairs(unix_pair, small=True), pairs(unix_pair)
        gone[1].close()
        fds = [room[0].fileno(), full[0].fileno(), gone[0].fileno(), BAD_FD, room[0].fileno()]
        steps, held = [], 0
        for step, (size, part) in enumerate(zip(full_sizes, read_parts)):
            buffers = [payload(3000, step), payload(size, step), payload(10, step), b"x", b""]
            steps.append(module.send_all(fds, buffers))
            read_exactly(room[1], 3000)
            held += max(steps[-1][1], 0)
            taken = int(held * part)
            read_exactly(full[1], taken)
            held -= taken
        return steps

    twin, native = run(socket_send_py), run(compiled)
    assert twin == native
    assert [step[0] for step in twin] == [3000] * len(full_sizes)
    assert [step[2:] for step in twin] == [[-errno.EPIPE, -errno.EBADF, 0]] * len(full_sizes)
    full = [step[1] for step in twin]
    assert 0 < full[0] < full_sizes[0] and 0 in full and len(set(full)) > 2, full


def _write_session(module: ModuleType, seed: int) -> list:
    """Random writes, closes and failures over three streams with hand-overs between loop iterations
    (what web/socket_sender.py does with them): the observable state after every operation."""
    rng = random.Random(seed)
    scheduled: list[int] = []
    writes = module.WriteQueue(lambda: scheduled.append(len(scheduled)))
    streams = [module.SenderStream(10 + i, None, 1 << 10, writes) for i in range(3)]
    log: list = []
    for _ in range(60):
        stream = rng.choice(streams)
        action = rng.random()
        try:
            if action < 0.6:
                stream.write(bytes([rng.randrange(256)]) * rng.randrange(0, 4))
            elif action < 0.7:
                stream.ending = "close"
                writes.queue(stream)
            elif action < 0.75:
                stream.error = "the client connection failed"
                stream.write(b"x")
            elif action < 0.78:
                writes.stopped = True
                stream.write(b"y")
            else:  # the hand-over at the end of the loop iteration
                writes.scheduled = False
                log.append(("handed", [(s.fd, b"".join(s.pending), s.ending) for s in writes.streams]))
                for s in writes.streams:
                    s.pending.clear()
                    s.queued = False
                writes.streams.clear()
        except (ConnectionResetError, RuntimeError) as error:
            log.append((type(error).__name__, str(error)))
        log.append([(s.fd, list(s.pending), s.queued, s.ending, s.error, s.cap_bytes) for s in streams])
        log.append((list(scheduled), writes.scheduled, writes.stopped, [s.fd for s in writes.streams]))
    return log


@pytest.mark.parametrize("module", MODULES)
def test_a_stream_write_queues_it_once_per_hand_over(module: ModuleType) -> None:
    scheduled: list[str] = []
    writes = module.WriteQueue(lambda: scheduled.append("hand-over"))
    first, second = (module.SenderStream(fd, None, 100, writes) for fd in (3, 4))
    first.write(b"a")
    second.write(b"b")
    first.write(b"c")
    assert scheduled == ["hand-over"] and writes.streams == [first, second]
    assert first.pending == [b"a", b"c"] and first.queued and second.pending == [b"b"]
    with pytest.raises(TypeError):
        first.write("text")  # type: ignore[arg-type]
    first.ending = "close"
    with pytest.raises(RuntimeError, match="closed sender stream"):
        first.write(b"d")
    second.error = "the client stopped reading"
    with pytest.raises(ConnectionResetError, match="stopped reading"):
        second.write(b"e")
    writes.stopped = True
    third = module.SenderStream(5, None, 100, writes)
    with pytest.raises(ConnectionResetError, match="server stopped"):
        third.write(b"f")
    assert first.pending == [b"a", b"c"] and second.pending == [b"b"] and not third.pending


@pytest.mark.skipif(compiled is None, reason="not built")
def test_twin_and_compiled_streams_agree_on_random_sessions() -> None:
    for seed in range(40):
        assert _write_session(socket_send_py, seed) == _write_session(compiled, seed), seed


def _sender_rounds(module: ModuleType, pairs: Callable[..., Pair], seed: int) -> tuple[list, list[bytes]]:
    """The sender thread's intake and send rounds (take_handed, send_round) on real Unix sockets with
    small buffers, over random hand-overs of bytes, closes, drops and a client that hangs up: the log
    of every callback and state, and what each client received."""
    rng = random.Random(seed)
    writes = module.WriteQueue(lambda: None)
    connections = [pairs(unix_pair, small=True) for _ in range(4)]
    streams = [module.SenderStream(writer.fileno(), None, 6000, writes) for writer, _ in connections]
    held: dict = {}
    sendable: dict = {}
    blocked: set = set()
    log: list = []
    fds = [stream.fd for stream in streams]
    which = fds.index  # the log names streams by position: the two runs' descriptors differ
    release = lambda stream: (log.append(("release", which(stream.fd))), held.pop(stream.fd, None),  # noqa: E731
                              sendable.pop(stream.fd, None), blocked.discard(stream.fd), setattr(stream, "gone", True))
    fail = lambda stream, reason: (log.append(("fail", which(stream.fd), reason)), release(stream))  # noqa: E731
    block = lambda fd: log.append(("block", which(fd)))  # noqa: E731
    received = [b""] * len(connections)
    for round_ in range(25):
        items = []
        for i in rng.sample(range(len(streams)), 3):
            ending = rng.choice([None] * 8 + ["close", "drop"])
            items.append((streams[i], payload(rng.randrange(0, 5000), seed * 100 + round_ * 4 + i), ending))
        if round_ == 24:
            items.insert(1, (None, b"", "stop"))
        log.append(("took", module.take_handed(items, held, sendable, blocked, release, fail)))
        if round_ == 10:
            close_abruptly(connections[3][1])  # the client hangs up: a later send fails
        if sendable:
            module.send_round(sendable, blocked, block, release, fail)
        for i, (_, reader) in enumerate(connections):  # the clients read some of it
            if i != 3 and rng.random() < 0.5:
                reader.setblocking(False)
                try:
                    received[i] += reader.recv(rng.randrange(1, 8000))
                except BlockingIOError:
                    pass
        for fd in sorted(blocked, key=which):  # the socket takes more (what the sender's poll reports)
            if rng.random() < 0.5:
                blocked.discard(fd)
                sendable[fd] = held[fd]
        log.append((sorted(map(which, held)), sorted(map(which, sendable)), sorted(map(which, blocked)),
                    [(len(s.unsent), s.closing, s.gone, s.error) for s in streams]))
    return log, received


@pytest.mark.skipif(compiled is None, reason="not built")
def test_twin_and_compiled_take_and_send_rounds_agree(pairs) -> None:
    for seed in range(6):
        assert _sender_rounds(socket_send_py, pairs, seed) == _sender_rounds(compiled, pairs, seed), seed
