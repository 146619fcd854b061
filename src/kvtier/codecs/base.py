"""The codec contract: how a chunk is encoded on its way to a secondary tier.

A :class:`Codec` turns one chunk (a primary slot's bytes, laid out as the
engine's :class:`~kvtier.layout.KVLayout` says) into fewer bytes and back.
It is built once per tier, for that tier's layout, and refuses a layout it
cannot handle when it is built, with the reason, so a configuration that
cannot work fails at start. Exact codecs (``lossy = False``) give back the
input bytes; a lossy one gives back values close to them, in the layout's
dtype, and is served only to tiers configured with that very codec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from kvtier.errors import KVTierError
from kvtier.layout import KVLayout
from kvtier.options import Options


class CodecOptions(Options):
    """Base for a codec's typed options; unknown keys are errors.

    Subclass it, declare fields with defaults and docstrings, and set it as the
    codec's ``Options``: configuration is validated against it at start.
    """


class CodecLayoutError(KVTierError, ValueError):
    """A codec cannot encode the KV layout of the tier it was given to."""


class Codec(ABC):
    """Base of every chunk codec, built-in or out-of-tree.

    Built as ``cls(layout, options, name=...)`` with ``options`` an instance
    of :attr:`Options` and ``name`` the configured ``type``. Subclasses
    refuse a layout in :meth:`check_layout`.
    ``encode`` and ``decode`` run on a tier's worker threads, several at once:
    they must not share mutable state.
    """

    #: The typed options this codec accepts.
    Options: ClassVar[type[CodecOptions]] = CodecOptions
    #: Whether decoded bytes may differ from the encoded ones. A lossy chunk
    #: is only ever served to a tier configured with the same codec and options.
    lossy: ClassVar[bool] = False
    #: Whether :meth:`encode` always writes exactly :meth:`max_encoded_bytes`
    #: (tiers that store fixed-size values take only such codecs).
    fixed_size: ClassVar[bool] = True
    #: Whether :meth:`encode` and :meth:`decode` always return promptly
    #: (kvtier's own codecs: numpy, zstd and lz4 calls), so that a tier calls
    #: them on its worker directly. Read from the class's own body, never
    #: inherited (a subclass's own methods may block): any other codec's
    #: calls run on a helper thread, each waited for at most the tier's
    #: ``codec_timeout_s``, at some cost in speed (see docs/codecs.md).
    returns_promptly: ClassVar[bool] = False

    @classmethod
    def declares_prompt_return(cls) -> bool:
        """:attr:`returns_promptly` as this very class declares it."""
        return bool(cls.__dict__.get("returns_promptly", False))

    def __init__(
        self, layout: KVLayout, options: CodecOptions | None = None, *, name: str | None = None
    ) -> None:
        #: The name chunk headers record: the configured ``type``.
        self.name = name or type(self).__name__
        self.layout = layout
        self.options = options if options is not None else self.Options()
        if type(self.options) is not self.Options:
            raise TypeError(
                f"{type(self).__qualname__} takes {self.Options.__qualname__}, "
                f"not {type(self.options).__qualname__}"
            )
        reason = self.check_layout(layout)
        if reason is not None:
            raise CodecLayoutError(f"codec {self.name!r} cannot encode this KV layout: {reason}")

    def params(self) -> dict[str, Any]:
        """The parameters the chunk header records: every option, defaults too."""
        return self.options.model_dump(mode="json")

    def check_layout(self, layout: KVLayout) -> str | None:
        """Why this codec cannot handle ``layout``, or ``None`` if it can."""
        return None

    @abstractmethod
    def max_encoded_bytes(self) -> int:
        """Most bytes :meth:`encode` writes for one chunk of the layout."""

    @abstractmethod
    def encode(self, chunk: memoryview, out: memoryview) -> int:
        """Encode ``chunk`` (one slot, ``layout.slot_bytes``) into the start of
        ``out`` (:meth:`max_encoded_bytes` long); the number of bytes written."""

    @abstractmethod
    def decode(self, data: memoryview, out: memoryview) -> None:
        """Decode ``data`` (what :meth:`encode` wrote) into ``out``, a whole
        slot, every byte of it; raise on data that cannot be this codec's."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.params()})"
