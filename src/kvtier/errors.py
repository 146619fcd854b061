"""One error hierarchy for kvtier.

Every class also inherits the builtin a caller would naturally catch, so
``except ValueError`` keeps working for code that does not know kvtier.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration document is invalid.

    ``problems`` lists ``(path, message)`` pairs, one per invalid entry, where
    ``path`` reads like ``secondary_tiers[1].root_dir``.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid kvtier configuration{where}:"]
        lines += [f"  {path or '<root>'}: {message}" for path, message in problems]
        super().__init__("\n".join(lines))


class PluginLoadError(KVTierError, ImportError):
    """A tier, policy or spec named in configuration could not be loaded."""

    def __init__(self, message: str, *, entry: str, module: str | None, name: str):
        # ImportError's own ``name`` is the module, as for any failed import.
        super().__init__(message, name=module)
        self.entry = entry
        self.module = module
        #: The tier, policy or spec name being resolved.
        self.plugin = name


class PluginTypeError(KVTierError, TypeError):
    """A class named for a tier, policy or spec does not derive from its base."""


class UntrustedModuleError(PluginLoadError):
    """``module_path`` names a module outside ``KVTIER_ALLOWED_MODULES``."""


class MissingDependencyError(KVTierError, ImportError):
    """An optional dependency of a built-in backend is not installed."""

    def __init__(self, package: str, extra: str):
        self.package = package
        self.extra = extra
        super().__init__(
            f"{package!r} is not installed; install it with: pip install 'kvtier[{extra}]' "
            f"(from a kvtier checkout: pip install '.[{extra}]')"
        )


class ChunkVanishedError(KVTierError, KeyError):
    """A chunk the tier held is gone when a load reads it (evicted since the
    lookup, possibly by another process): a miss, not a failure."""


class CorruptChunkError(KVTierError, ValueError):
    """Stored chunk bytes failed an integrity check and must not be served."""


class LayoutMismatchError(KVTierError, ValueError):
    """Two parts of kvtier disagree on the KV layout they were built for."""


class ClosedError(KVTierError, RuntimeError):
    """A closed :class:`~kvtier.KVCache` (or a released lookup) was used."""


class UnknownPluginError(KVTierError, ValueError):
    """A tier, policy or spec name is neither registered nor given a module path."""


class BackendUnavailableError(KVTierError, ConnectionError):
    """A tier's backend cannot serve it at start: unreachable, missing or refusing.

    ``tier_type`` names the tier, ``target`` what it tried to reach (a URL, a
    bucket), ``reason`` what went wrong and ``entry`` the configuration entry
    (``secondary_tiers[1]``) when known. Raised only while a tier starts;
    once running, backend failures become failed jobs and misses.
    """

    def __init__(self, tier_type: str, target: str, reason: str, entry: str = ""):
        self.tier_type = tier_type
        self.target = target
        self.reason = reason
        self.entry = entry
        where = f"{entry}: " if entry else ""
        super().__init__(f"{where}tier {tier_type!r}: cannot use {target}: {reason}")

    def at(self, entry: str) -> BackendUnavailableError:
        """The same error, naming the configuration entry it came from."""
        return BackendUnavailableError(self.tier_type, self.target, self.reason, entry)


class PeerProtocolError(KVTierError, ConnectionError):
    """A peer sent a message kvtier's peer protocol does not allow; the
    connection is dropped."""


class PeerAuthError(PeerProtocolError):
    """A peer failed the challenge-response authentication of a connection."""


def describe_error(error: BaseException) -> str:
    """``Type: message``, for logs and reports (some clients' ``repr`` hides the message),
    followed by the notes that say where it happened."""
    notes = getattr(error, "__notes__", ())
    return f"{type(error).__name__}: {error}" + "".join(f" ({note})" for note in notes)
