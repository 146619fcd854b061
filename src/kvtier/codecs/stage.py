"""The one place chunks pass through a codec on their way to and from a tier.

A tier's runtime holds one :class:`CodecStage`: a pass-through under the
``none`` codec; under any other, a stored payload is a codec header (name,
parameters, sizes) then the encoded bytes, in a namespace of the codec's own.
See docs/codecs.md.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import threading

from kvtier.codecs.base import Codec
from kvtier.codecs.exact import NoneCodec
from kvtier.errors import CorruptChunkError
from kvtier.layout import KEY_BYTES, KVLayout

CODEC_MAGIC = b"KVCD"
CODEC_FRAME_VERSION = 1
#: Longest codec name a header records.
MAX_NAME_BYTES = 16
# magic, frame version, lossy flag, parameters length, name, decoded bytes, encoded bytes
_FRAME = struct.Struct(f"<4sBBH{MAX_NAME_BYTES}sQQ")


class CodecMismatchError(CorruptChunkError):
    """A chunk encoded by another codec, or the same one with other parameters."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class CodecStage:
    """Encodes chunks for a tier and decodes what it loads, with one codec.

    ``align``: stored payloads are padded with zeros to a multiple of it (a
    tier writing with ``O_DIRECT`` needs whole pages); a variable-size
    codec's payload is padded only as far as its own length needs, and its
    header's encoded length says where the encoded bytes end.
    """

    def __init__(self, codec: Codec | None, layout: KVLayout, *, align: int = 1) -> None:
        self.codec: Codec = codec if codec is not None else NoneCodec(layout, name="none")
        self.layout = layout
        #: No header, no copy: the slot's bytes are the payload.
        self.identity = bool(getattr(self.codec, "identity", False))
        self.lossy = self.codec.lossy
        self.fixed_size = self.identity or self.codec.fixed_size
        self._align = align
        self._local = threading.local()
        if self.identity:
            self.params = b""
            self._prefix = b""
            self.stored_bytes = layout.slot_bytes
            return
        name = self.codec.name.encode()
        if not name or len(name) > MAX_NAME_BYTES:
            raise ValueError(f"codec name {self.codec.name!r} must be 1 to {MAX_NAME_BYTES} bytes")
        self.params = json.dumps(
            self.codec.params(), sort_keys=True, separators=(",", ":")
        ).encode()
        if len(self.params) > 0xFFFF:
            raise ValueError(f"codec {self.codec.name!r}: parameters too long to record")
        self._name = name
        self._header_bytes = _round_up(_FRAME.size + len(self.params), 8)
        self._max_encoded = self.codec.max_encoded_bytes()
        #: Payload bytes of one stored chunk (most of them, for a variable-size codec).
        self.stored_bytes = _round_up(self._header_bytes + self._max_encoded, align)

    @property
    def name(self) -> str:
        return self.codec.name

    def namespace(self, layout_namespace: bytes) -> bytes:
        """The namespace a tier stores this codec's chunks under."""
        if self.identity:
            return layout_namespace
        return hashlib.blake2b(
            layout_namespace + self._name + b"\0" + self.params,
            digest_size=KEY_BYTES,
            person=b"kvtier-codec",
        ).digest()

    def scratch(self, count: int) -> list[memoryview]:
        """This thread's ``count`` page-aligned buffers of :attr:`stored_bytes`."""
        buffers: list[mmap.mmap] = getattr(self._local, "buffers", [])
        while len(buffers) < count:
            buffers.append(mmap.mmap(-1, _round_up(self.stored_bytes, mmap.PAGESIZE)))
        self._local.buffers = buffers
        return [memoryview(b)[: self.stored_bytes] for b in buffers[:count]]

    def decoded(self) -> memoryview:
        """This thread's buffer of one whole chunk, to decode into before a
        slot is written (so a decode left running past its bound writes
        into this, never into a slot that is another chunk's by then)."""
        buffer: mmap.mmap | None = getattr(self._local, "decoded", None)
        if buffer is None:
            buffer = self._local.decoded = mmap.mmap(-1, self.layout.slot_bytes)
        return memoryview(buffer)

    def abandon_buffers(self) -> None:
        """Leave this thread's buffers to a codec call still running past its
        bound: the next :meth:`scratch` and :meth:`decoded` are fresh ones."""
        self._local.buffers = []
        self._local.decoded = None

    def encode(self, chunk: memoryview, out: memoryview) -> int:
        """Header and encoded ``chunk`` into ``out``; the payload's length.
        (``none``: the chunk's bytes, which tiers store straight from the slot.)"""
        if self.identity:
            out[: len(chunk)] = chunk
            return len(chunk)
        body = out[self._header_bytes :]
        written = self.codec.encode(chunk, body[: self._max_encoded])
        if not 0 < written <= self._max_encoded:
            raise ValueError(
                f"codec {self.name!r} wrote {written} bytes, at most {self._max_encoded}"
            )
        header = _FRAME.pack(
            CODEC_MAGIC,
            CODEC_FRAME_VERSION,
            int(self.lossy),
            len(self.params),
            self._name,
            len(chunk),
            written,
        )
        out[: _FRAME.size] = header
        end = _FRAME.size + len(self.params)
        out[_FRAME.size : end] = self.params
        out[end : self._header_bytes] = bytes(self._header_bytes - end)
        used = self._header_bytes + written
        length = self.stored_bytes if self.fixed_size else _round_up(used, self._align)
        out[used:length] = bytes(length - used)
        return length

    def round_trip(self, chunk: bytes | memoryview) -> bytes:
        """What a tier of this codec serves for ``chunk`` (``chunk`` itself
        unless the codec is lossy): for tools that check what they load."""
        buffer = self.scratch(1)[0]
        length = self.encode(memoryview(chunk), buffer)
        out = bytearray(self.layout.slot_bytes)
        self.decode(buffer[:length], memoryview(out))
        return bytes(out)

    def check_header(self, payload: memoryview) -> memoryview:
        """The encoded bytes of ``payload`` once its header says this codec wrote it.

        A damaged header is :class:`CorruptChunkError`; another codec's or
        other parameters' chunk is :class:`CodecMismatchError`.
        """
        if len(payload) < _FRAME.size:
            raise CorruptChunkError(f"codec header truncated to {len(payload)} bytes")
        magic, version, lossy, params_len, name, decoded, encoded = _FRAME.unpack_from(payload)
        if magic != CODEC_MAGIC or version != CODEC_FRAME_VERSION:
            raise CorruptChunkError("no codec header (bad magic or version)")
        start = _FRAME.size + params_len
        if len(payload) < start:
            raise CorruptChunkError("codec header truncated in its parameters")
        if name.rstrip(b"\0") != self._name or bytes(payload[_FRAME.size : start]) != self.params:
            shown = name.rstrip(b"\0").decode(errors="replace")
            raise CodecMismatchError(
                f"chunk encoded by codec {shown!r}{' (lossy)' if lossy else ''} with "
                f"parameters {bytes(payload[_FRAME.size : start])!r}; this tier reads "
                f"{self.name!r} with {self.params!r}"
            )
        if lossy != int(self.lossy):
            raise CorruptChunkError("codec header's lossy flag contradicts its codec")
        if decoded != self.layout.slot_bytes:
            raise CorruptChunkError(
                f"codec header says {decoded} decoded bytes, a chunk is {self.layout.slot_bytes}"
            )
        body_start = _round_up(start, 8)
        if encoded > self._max_encoded or body_start + encoded > len(payload):
            raise CorruptChunkError(f"codec header says {encoded} encoded bytes, more than held")
        return payload[body_start : body_start + encoded]

    def decode(self, payload: memoryview, out: memoryview) -> None:
        """Decode a stored payload into ``out`` (a slot); raises
        :class:`CorruptChunkError` (or :class:`CodecMismatchError`) unless
        every byte of ``out`` was written from a chunk of this codec."""
        if self.identity:
            if len(payload) != len(out):
                raise CorruptChunkError(f"chunk of {len(payload)} bytes, a slot holds {len(out)}")
            out[:] = payload
            return
        body = self.check_header(payload)
        try:
            self.codec.decode(body, out)
        except Exception as exc:  # the codec's own failure costs this chunk only
            raise CorruptChunkError(f"codec {self.name!r} failed to decode: {exc!r}") from exc
