"""Client for dynamo-node's engine endpoint (wire protocol version 1).

The protocol is described in ``runtime/python/README.md``: little-endian
frames (``u32 len``, ``u8 op``, body) over a Unix stream socket, requests and
replies strictly alternating. REGISTER's reply carries the node's shared G2
region as a file descriptor (``SCM_RIGHTS``).

A :class:`NodeClient` owns one connection. It connects lazily, reconnects at
most once per ``retry_interval_s`` while the node is away (at once while its
socket does not exist: the node is starting), and logs one warning
per outage. Every call either returns the decoded reply or raises a
:class:`NodeError`; callers decide how to degrade. Each successful REGISTER
bumps :attr:`NodeClient.generation`: pins, pending stores and slots handed out
on an earlier connection mean nothing on the new one.

Not thread-safe: use one client per thread.
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

# Under "vllm." so that, inside vLLM, its handlers and levels apply.
logger = logging.getLogger(f"vllm.{__name__}")

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
# Most keys one request may carry (the node refuses more): longer lists go in several requests.
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 64


class Op(enum.IntEnum):
    """Request opcodes; a reply's opcode is the request's with the high bit set."""

    REGISTER = 0x01
    LOOKUP = 0x02
    PREPARE_STORE = 0x03
    COMPLETE_STORE = 0x04
    PREPARE_LOAD = 0x05
    COMPLETE_LOAD = 0x06
    TAKE_EVENTS = 0x07
    LOCATE = 0x08


ERROR_OP = 0xFF
REPLY_BIT = 0x80


class Role(enum.IntEnum):
    MANAGER = 0
    WORKER = 1


class LookupAnswer(enum.IntEnum):
    MISS = 0
    HIT = 1
    PENDING = 2


class ErrorCode(enum.IntEnum):
    MALFORMED = 1
    NOT_REGISTERED = 2
    REFUSED = 3
    UNSUPPORTED_VERSION = 4
    INTERNAL = 5


class Location(enum.IntEnum):
    """LOCATE's location kinds."""

    ENGINE_G1 = 0
    NODE_G2 = 1
    NODE_G3 = 2
    NODE_WORKER_G1 = 3


# PREPARE_STORE answers -1 for a block already stored (skip it), -2 for no room.
SLOT_NO_ROOM = -2
# PREPARE_LOAD answers -1 for a block it cannot hand out.
SLOT_NOT_AVAILABLE = -1


class NodeError(Exception):
    """Base of every failure a :class:`NodeClient` call raises (itself: a
    request too large for one frame)."""


class NodeUnavailable(NodeError):
    """The node could not be reached, the connection broke or timed out, or
    it sent something that is not protocol version 1 (the connection is then
    closed)."""


class NodeRefused(NodeError):
    """The node answered a request with ERROR."""

    def __init__(self, code: int, message: str):
        try:
            name = ErrorCode(code).name.lower().replace("_", " ")
        except ValueError:
            name = f"code {code}"
        super().__init__(f"dynamo-node refused the request ({name}): {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class EngineDescription:
    """What REGISTER says about the engine. The node salts block names with
    model, dtype, layout, block_tokens, world_size and block_bytes."""

    engine_id: str
    model: str
    dtype: str
    layout: str
    block_tokens: int
    world_size: int
    rank: int
    block_bytes: int
    kv_events: str = ""
    region: str = ""


@dataclass(frozen=True)
class Registration:
    """REGISTERED's body: the region and the engine's identity at the node."""

    region_id: int
    region_bytes: int
    slots: int
    slot_bytes: int
    payload_offset: int
    engine: int
    salt: bytes


@dataclass(frozen=True)
class Event:
    """One TAKE_EVENTS entry."""

    removed: bool
    key: bytes


class Region:
    """The node's G2 region mapped into this process (``MAP_SHARED``)."""

    def __init__(self, fd: int, registration: Registration):
        size = os.fstat(fd).st_size
        if size < registration.region_bytes:
            raise NodeUnavailable(
                f"region fd holds {size} bytes, REGISTERED says {registration.region_bytes}"
            )
        self.registration = registration
        # MAP_POPULATE: fault the page tables in now, at registration, rather than on the
        # first copy into each page (a store into a fresh mapping ran at half the speed of a
        # load from a touched one).
        self.mm = mmap.mmap(
            fd,
            registration.region_bytes,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )

    def close(self) -> None:
        """Unmap now, or when the last buffer exported from it is released."""
        try:
            self.mm.close()
        except BufferError:
            pass


# ---------------------------------------------------------------------------
# Encoding and decoding
# ---------------------------------------------------------------------------


def encode_str(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"string of {len(raw)} bytes is too long for the protocol")
    return struct.pack("<H", len(raw)) + raw


def chunks(keys: Sequence[bytes]) -> list[Sequence[bytes]]:
    """`keys` in requests of at most MAX_KEYS (one, possibly empty, for a short list)."""
    if len(keys) <= MAX_KEYS:
        return [keys]
    return [keys[i : i + MAX_KEYS] for i in range(0, len(keys), MAX_KEYS)]


def encode_keys(keys: Sequence[bytes]) -> bytes:
    parts = [struct.pack("<I", len(keys))]
    for key in keys:
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes (1..={MAX_KEY_BYTES} allowed)")
        parts.append(bytes((len(key),)))
        parts.append(key)
    return b"".join(parts)


def encode_register(role: Role, d: EngineDescription) -> bytes:
    return b"".join(
        (
            struct.pack("<HB", PROTOCOL_VERSION, role),
            encode_str(d.engine_id),
            encode_str(d.model),
            encode_str(d.dtype),
            encode_str(d.layout),
            struct.pack("<IIIQ", d.block_tokens, d.world_size, d.rank, d.block_bytes),
            encode_str(d.kv_events),
            encode_str(d.region),
        )
    )


class Reader:
    """Bounds-checked reader over a reply body; overruns raise NodeUnavailable."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise NodeUnavailable("reply body is shorter than its fields")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def string(self) -> str:
        (n,) = self.unpack("<H")
        return self.take(n).decode("utf-8", errors="replace")

    def key(self) -> bytes:
        return self.take(self.u8())

    def array(self, code: str, count: int) -> list[int]:
        """``count`` little-endian values of struct format ``code``."""
        return list(self.unpack(f"<{count}{code}")) if count else []

    def end(self) -> None:
        if self.pos != len(self.data):
            raise NodeUnavailable("reply body is longer than its fields")


def decode_registration(body: bytes) -> Registration:
    r = Reader(body)
    region_id, region_bytes, slots, slot_bytes, payload_offset, engine = r.unpack("<QQIQII")
    salt = r.take(16)
    r.end()
    return Registration(region_id, region_bytes, slots, slot_bytes, payload_offset, engine, salt)


def check_registration(registration: Registration, block_bytes: int) -> None:
    """Reject a region whose slots cannot hold the payloads they promise."""
    if registration.payload_offset + block_bytes > registration.slot_bytes:
        raise NodeUnavailable(
            f"slots of {registration.slot_bytes} bytes cannot hold a {block_bytes}-byte "
            f"payload at offset {registration.payload_offset}"
        )
    if registration.slots * registration.slot_bytes > registration.region_bytes:
        raise NodeUnavailable(
            f"{registration.slots} slots of {registration.slot_bytes} bytes overrun "
            f"the {registration.region_bytes}-byte region"
        )


def decode_counted(body: bytes, code: str, expected: int) -> list[int]:
    """``u32 n`` then n values; n must equal the number of keys asked about."""
    r = Reader(body)
    n = r.u32()
    if n != expected:
        raise NodeUnavailable(f"reply has {n} answers for {expected} keys")
    values = r.array(code, n)
    r.end()
    return values


# ---------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------


class NodeClient:
    """One registered connection to the node.

    Args:
        path: the node's ``engine_endpoint.socket``.
        role: manager (the scheduler process) or worker.
        description: what REGISTER sends.
        map_region: map the G2 region (workers); otherwise its fd is closed.
        timeout_s: limit for connecting and for each request's round trip.
        retry_interval_s: least time between two connection attempts.
    """

    def __init__(
        self,
        path: str,
        role: Role,
        description: EngineDescription,
        *,
        map_region: bool = False,
        timeout_s: float = 2.0,
        retry_interval_s: float = 1.0,
    ):
        self.path = path
        self.role = role
        self.description = description
        self.map_region = map_region
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.registration: Registration | None = None
        self.region: Region | None = None
        self.generation = 0
        self._sock: socket.socket | None = None
        self._next_attempt = 0.0
        self._in_outage = False

    # -- connection --------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def ensure_connected(self) -> Registration:
        """Return the live registration, connecting if the last attempt is at
        least ``retry_interval_s`` old; otherwise raise NodeUnavailable."""
        if self._sock is not None and self.registration is not None:
            return self.registration
        if time.monotonic() < self._next_attempt:
            raise NodeUnavailable("dynamo-node is away (waiting to reconnect)")
        return self.connect()

    def connect(self) -> Registration:
        """Open a new connection and REGISTER now, whatever the rate limit."""
        self.close()
        self._next_attempt = time.monotonic() + self.retry_interval_s
        try:
            registration = self._register()
        except NodeError as e:
            self.close()  # a connection without a registration is of no use
            self._fail(e)
            raise
        self.registration = registration
        self.generation += 1
        if self._in_outage:
            logger.info(
                "dynamo-node at %s is back (region %#x)", self.path, registration.region_id
            )
        self._in_outage = False
        return registration

    def _register(self) -> Registration:
        """Connect, send REGISTER, check and adopt the reply."""
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(self.timeout_s)
            self._sock.connect(self.path)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                # No socket yet (the node is starting, or binding it again): trying again costs
                # one failed syscall, so the next call tries at once. A node that launched this
                # engine binds it just before it sends the engine its first request.
                self._next_attempt = 0.0
            raise NodeUnavailable(f"cannot reach dynamo-node at {self.path}: {e}") from e
        body, fds = self._round_trip(
            Op.REGISTER, encode_register(self.role, self.description), want_fds=True
        )
        registration = decode_registration(body)
        self._adopt_region(registration, fds)
        return registration

    def _adopt_region(self, registration: Registration, fds: list[int]) -> None:
        """Map the region from REGISTERED's fd (or just close it)."""
        try:
            if not fds:
                raise NodeUnavailable("REGISTERED arrived without the region's file descriptor")
            check_registration(registration, self.description.block_bytes)
            if self.map_region:
                if self.region is None or (
                    self.region.registration.region_id != registration.region_id
                ):
                    try:
                        region = Region(fds[0], registration)
                    except (OSError, ValueError) as e:
                        raise NodeUnavailable(f"cannot map the region: {e}") from e
                    if self.region is not None:
                        self.region.close()
                    self.region = region
        finally:
            for fd in fds:
                os.close(fd)

    def alive(self) -> bool:
        """Whether the connection is open: False before connecting and once the
        node has closed it (it went away or restarted). Never blocks."""
        if self._sock is None:
            return False
        try:
            # Requests and replies alternate, so between calls nothing is ever
            # pending: a readable socket is one the node closed. (A zero-timeout
            # select, since recv on a socket with a timeout would wait for it.)
            readable, _, _ = select.select([self._sock], [], [], 0)
            return not readable or self._sock.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def close(self) -> None:
        """Close the connection (the mapped region, if any, stays mapped)."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
        self.registration = None

    def shutdown(self) -> None:
        """Close the connection and unmap the region."""
        self.close()
        if self.region is not None:
            self.region.close()
            self.region = None

    def _fail(self, err: NodeError) -> None:
        """Record a failure: a transport failure or a refusal that ends the
        connection closes it; the first failure of an outage is logged."""
        if isinstance(err, NodeUnavailable) or (
            isinstance(err, NodeRefused)
            and err.code
            in (ErrorCode.MALFORMED, ErrorCode.NOT_REGISTERED, ErrorCode.UNSUPPORTED_VERSION)
        ):
            self.close()
        if not self._in_outage:
            logger.warning(
                "dynamo-node (%s) is unavailable: %s. Lookups miss and stores are "
                "declined until it answers again (reconnecting at most every %.0f s).",
                self.path,
                err,
                self.retry_interval_s,
            )
            self._in_outage = True
        else:
            logger.debug("dynamo-node (%s) is still unavailable: %s", self.path, err)

    # -- framing -----------------------------------------------------------

    def _round_trip(
        self, op: Op, body: bytes, *, want_fds: bool = False
    ) -> tuple[bytes, list[int]]:
        """Send one request and read its reply: (reply body, received fds)."""
        assert self._sock is not None
        frame_len = 1 + len(body)
        if frame_len > MAX_FRAME_BYTES:
            raise NodeError(f"request of {frame_len} bytes exceeds the 16 MiB frame limit")
        fds: list[int] = []
        try:
            self._sock.sendall(struct.pack("<IB", frame_len, op) + body)
            header = self._recv_exact(5, fds if want_fds else None)
            (length, reply_op) = struct.unpack("<IB", header)
            if not 1 <= length <= MAX_FRAME_BYTES:
                raise NodeUnavailable(f"reply frame length {length} is out of range")
            reply = self._recv_exact(length - 1, fds if want_fds else None)
        except (OSError, NodeError) as e:
            for fd in fds:
                os.close(fd)
            if isinstance(e, NodeError):
                raise
            raise NodeUnavailable(f"connection to dynamo-node failed: {e}") from e
        if reply_op == ERROR_OP:
            for fd in fds:
                os.close(fd)
            r = Reader(reply)
            (code,) = r.unpack("<H")
            raise NodeRefused(code, r.string())
        if reply_op != op | REPLY_BIT:
            for fd in fds:
                os.close(fd)
            raise NodeUnavailable(f"reply op {reply_op:#x} does not answer op {op:#x}")
        return reply, fds

    def _recv_exact(self, n: int, fds: list[int] | None) -> bytes:
        """Read exactly n bytes; with ``fds``, collect SCM_RIGHTS fds too."""
        assert self._sock is not None
        buf = bytearray()
        while len(buf) < n:
            if fds is None:
                chunk = self._sock.recv(n - len(buf))
            else:
                chunk, got, _flags, _addr = socket.recv_fds(
                    self._sock, n - len(buf), 4, socket.MSG_CMSG_CLOEXEC
                )
                fds.extend(got)
            if not chunk:
                raise NodeUnavailable("dynamo-node closed the connection")
            buf += chunk
        return bytes(buf)

    def call(self, op: Op, body: bytes = b"") -> bytes:
        """One request on the live connection; returns the reply body."""
        self.ensure_connected()
        try:
            reply, _ = self._round_trip(op, body)
        except NodeError as e:
            self._fail(e)
            raise
        self._in_outage = False
        return reply

    # -- operations --------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Per key, a LookupAnswer value and, for a hit, its pinned slot (else -1)."""
        answers: list[tuple[int, int]] = []
        for chunk in chunks(keys):
            r = Reader(self.call(Op.LOOKUP, encode_keys(chunk)))
            n = r.u32()
            if n != len(chunk):
                raise NodeUnavailable(f"reply has {n} answers for {len(chunk)} keys")
            answers.extend(r.unpack("<Bi") for _ in range(n))
            r.end()
        return answers

    def prepare_store(self, keys: Sequence[bytes]) -> list[int]:
        """One slot per key: >= 0 to write, -1 already stored, SLOT_NO_ROOM."""
        return [
            slot
            for chunk in chunks(keys)
            for slot in decode_counted(self.call(Op.PREPARE_STORE, encode_keys(chunk)), "i", len(chunk))
        ]

    def complete_store(self, keys: Sequence[bytes], success: bool) -> int:
        """Seal (success) or give back the keys' slots; returns how many were stored."""
        flag = bytes((1 if success else 0,))
        return sum(self._single_u32(self.call(Op.COMPLETE_STORE, flag + encode_keys(chunk))) for chunk in chunks(keys))

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the keys; one slot per key, or SLOT_NOT_AVAILABLE."""
        return [
            slot
            for chunk in chunks(keys)
            for slot in decode_counted(self.call(Op.PREPARE_LOAD, encode_keys(chunk)), "i", len(chunk))
        ]

    def complete_load(self, keys: Sequence[bytes]) -> int:
        """Unpin the keys; returns how many were released."""
        return sum(self._single_u32(self.call(Op.COMPLETE_LOAD, encode_keys(chunk))) for chunk in chunks(keys))

    def take_events(self) -> list[Event]:
        r = Reader(self.call(Op.TAKE_EVENTS))
        events = []
        for _ in range(r.u32()):
            kind = r.u8()
            events.append(Event(removed=kind == 1, key=r.key()))
        r.end()
        return events

    def locate(self, chain: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(kind, id, leading blocks held) for every location holding a prefix of
        the chain of (group, 64-bit vLLM block hash)."""
        body = struct.pack("<I", len(chain)) + b"".join(
            struct.pack("<IQ", group, block_hash) for group, block_hash in chain
        )
        r = Reader(self.call(Op.LOCATE, body))
        found = [r.unpack("<BII") for _ in range(r.u32())]
        r.end()
        return found

    @staticmethod
    def _single_u32(body: bytes) -> int:
        r = Reader(body)
        value = r.u32()
        r.end()
        return value
