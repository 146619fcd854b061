"""The one resolver behind kvtier's plugin factories (tiers, policies, specs):
registry, then entry points, then module path, each name resolved once.

See docs/architecture.md, 'Plugins', and docs/out-of-tree-tier.md for
``KVTIER_ALLOWED_MODULES``.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, TypeVar, cast

from kvtier.errors import (
    PluginLoadError,
    PluginTypeError,
    UnknownPluginError,
    UntrustedModuleError,
    describe_error,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

ALLOWED_MODULES_ENV = "KVTIER_ALLOWED_MODULES"


@dataclass(frozen=True)
class _LazyClass:
    module: str
    class_name: str


@dataclass(frozen=True)
class RegistrySnapshot:
    """What :meth:`PluginRegistry.restore` puts back (from :meth:`~PluginRegistry.snapshot`)."""

    registry: dict[str, _LazyClass]
    warned: frozenset[str]


def module_is_allowed(module_path: str) -> bool:
    """Whether ``KVTIER_ALLOWED_MODULES`` lets ``module_path`` be imported."""
    allowed = os.environ.get(ALLOWED_MODULES_ENV)
    if allowed is None:
        return True
    prefixes = [p.strip() for p in allowed.split(",") if p.strip()]
    return any(module_path == p or module_path.startswith(p + ".") for p in prefixes)


class PluginRegistry(Generic[T]):
    """Maps names to classes derived from ``base`` for one kind of plugin."""

    def __init__(
        self,
        *,
        kind: str,
        base: type[Any],
        entry_point_group: str,
        name_key: str = "type",
        module_key: str = "module_path",
        builtins: Iterable[tuple[str, str, str]] = (),
        adapt: Callable[[object], object] | None = None,
    ) -> None:
        """``builtins``: ``(name, module_path, class_name)`` of each built-in,
        registered as :meth:`register` would (imported on first use).
        ``adapt``: turns what a module holds into a subclass of ``base`` where
        it can (a tier backend into the tier running it), before the check."""
        self.kind = kind
        self.base = base
        self._adapt = adapt
        self.name_key = name_key
        self.module_key = module_key
        self.entry_point_group = entry_point_group
        self._registry: dict[str, _LazyClass] = {}
        # Once-per-process warnings already given, by topic.
        self._warned: set[str] = set()
        # Classes resolved, by (name, module path), and where an out-of-tree
        # one came from: each use is logged as a load is, and a module path
        # is checked against the allow-list again (which may have changed).
        self._resolved: dict[tuple[str, str | None], tuple[type[T], _LazyClass | None]] = {}
        for name, module_path, class_name in builtins:
            self.register(name, module_path, class_name)

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` resolve to ``module_path.class_name``, imported on first use."""
        if name in self._registry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._registry[name] = _LazyClass(module_path, class_name)
        self._resolved.clear()

    def unregister(self, name: str) -> None:
        """Forget ``name`` (for tests and for plugins replacing themselves)."""
        del self._registry[name]
        self._resolved.clear()

    def snapshot(self) -> RegistrySnapshot:
        """The registrations and given warnings, for :meth:`restore` (tests use it)."""
        return RegistrySnapshot(dict(self._registry), frozenset(self._warned))

    def restore(self, snapshot: RegistrySnapshot, *, forget_warnings: bool = False) -> None:
        """Put back what :meth:`snapshot` saw; ``forget_warnings`` as a new process has."""
        self._registry = dict(snapshot.registry)
        self._warned = set() if forget_warnings else set(snapshot.warned)
        self._resolved.clear()

    def _warn_once(self, topic: str, message: str, *args: object) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            logger.warning(message, *args)

    def registered_names(self) -> list[str]:
        """Names in the registry itself (built-ins and ``register`` calls), sorted."""
        return sorted(self._registry)

    def registered_target(self, name: str) -> str:
        """``module.Class`` a registered name resolves to, without importing it."""
        lazy = self._registry[name]
        return f"{lazy.module}.{lazy.class_name}"

    def installed_targets(self) -> dict[str, str]:
        """``module.Class`` of each name installed packages declare as an entry
        point, without importing it (for a name declared twice, the one that
        :meth:`resolve` picks)."""
        targets: dict[str, str] = {}
        for ep in entry_points(group=self.entry_point_group):
            targets.setdefault(ep.name, ep.value.replace(":", "."))
        return targets

    def names(self) -> list[str]:
        """Every name that resolves without a module path, sorted."""
        installed = {ep.name for ep in entry_points(group=self.entry_point_group)}
        return sorted(set(self._registry) | installed)

    def resolve(self, name: str, module_path: str | None = None, *, entry: str = "") -> type[T]:
        """The class for ``name``; ``entry`` names the config entry in errors.

        Resolved once per name and module path (until a registration
        changes); a module path stays subject to ``KVTIER_ALLOWED_MODULES``.
        """
        known = self._resolved.get((name, module_path))
        if known is not None:
            cls, origin = known
            if origin is None:
                return cls
            if origin.module != module_path or module_is_allowed(origin.module):
                self._log_out_of_tree(origin)
                return cls
            # No longer allowed: resolved anew, which says why (or finds another way).
        cls, origin = self._find(name, module_path, entry)
        self._resolved[(name, module_path)] = (cls, origin)
        return cls

    def _find(
        self, name: str, module_path: str | None, entry: str
    ) -> tuple[type[T], _LazyClass | None]:
        """The class, and where it came from if out of tree."""
        where = f"{entry}: " if entry else ""
        lazy = self._registry.get(name)
        if lazy is not None:
            self._ignored_module_path(name, module_path, lazy.module, lazy.class_name)
            return self._load(lazy, name, entry), None
        # The same package seen twice (an editable install beside a wheel) is one entry.
        declared = entry_points(group=self.entry_point_group, name=name)
        installed = list({ep.value: ep for ep in declared}.values())
        if installed:
            chosen = installed[0]
            if len(installed) > 1:
                self._warn_once(
                    f"duplicate:{name}",
                    "%s %r is declared by %d installed entry points (%s); using %s. "
                    "Uninstall one, or name the class with a %s of its own.",
                    self.kind,
                    name,
                    len(installed),
                    ", ".join(ep.value for ep in installed),
                    chosen.value,
                    self.name_key,
                )
            module, _, attr = (part.strip() for part in chosen.value.partition(":"))
            self._ignored_module_path(name, module_path, module, attr or name)
            origin = _LazyClass(module, attr or name)
            self._log_out_of_tree(origin)
            return self._load(origin, name, entry), origin
        if module_path is None:
            raise UnknownPluginError(
                f"{where}unknown {self.kind} {name!r}. Supported: {', '.join(self.names())}. "
                f"For an out-of-tree {self.kind}, also set {self.module_key!r}."
            )
        if not module_is_allowed(module_path):
            raise UntrustedModuleError(
                f"{where}{self.module_key} {module_path!r} is not allowed by "
                f"{ALLOWED_MODULES_ENV}={os.environ.get(ALLOWED_MODULES_ENV)!r}",
                entry=entry,
                module=module_path,
                name=name,
            )
        origin = _LazyClass(module_path, name)
        self._log_out_of_tree(origin)
        return self._load(origin, name, entry), origin

    def _ignored_module_path(
        self, name: str, module_path: str | None, module: str, class_name: str
    ) -> None:
        """Warn when configuration names a module that a registered name overrides."""
        if module_path is not None and module_path != module:
            target = f"{module}.{class_name}"
            self._warn_once(
                f"ignored:{name}:{module_path}",
                "%s %r is already registered (%s): its %s %r is ignored. "
                "Give the out-of-tree class another name to load it.",
                self.kind,
                name,
                target,
                self.module_key,
                module_path,
            )

    def _log_out_of_tree(self, origin: _LazyClass) -> None:
        self._warn_once(
            "out-of-tree",
            "Loading an out-of-tree %s. This interface is experimental and may "
            "change in future kvtier releases.",
            self.kind,
        )
        logger.info(
            "Loading out-of-tree %s %r from module %r", self.kind, origin.class_name, origin.module
        )

    def _load(self, target: _LazyClass, name: str, entry: str) -> type[T]:
        where = f"{entry}: " if entry else ""
        module_path, class_name = target.module, target.class_name
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise PluginLoadError(
                f"{where}cannot import module {module_path!r} for {self.kind} {name!r}: "
                f"{describe_error(exc)}",
                entry=entry,
                module=module_path,
                name=name,
            ) from exc
        try:
            loaded = getattr(module, class_name)
        except AttributeError:
            raise PluginLoadError(
                f"{where}module {module_path!r} has no class {class_name!r} "
                f"(needed for {self.kind} {name!r})",
                entry=entry,
                module=module_path,
                name=name,
            ) from None
        if self._adapt is not None:
            loaded = self._adapt(loaded)
        # An explicit check, not an assert: asserts vanish under ``python -O``. The base
        # must be in the MRO: a virtual subclass (``Base.register(cls)``) passes
        # ``issubclass`` but inherits none of the base's methods.
        if not (isinstance(loaded, type) and self.base in loaded.__mro__):
            virtual = isinstance(loaded, type) and issubclass(loaded, self.base)
            raise PluginTypeError(
                f"{where}{module_path}.{class_name} is not a subclass of "
                f"{self.base.__module__}.{self.base.__qualname__}"
                + (" (registered as a virtual subclass only: inherit from it)" if virtual else "")
            )
        return cast("type[T]", loaded)


class PluginFactory(Generic[T]):
    """A factory for one kind of plugin: registration and resolution through
    its :attr:`registry`. Subclasses set the registry, name their public
    calls as the kind's configuration does, and build instances."""

    registry: ClassVar[PluginRegistry[Any]]

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` resolve to ``module_path.class_name`` (``ValueError`` if taken)."""
        cls.registry.register(name, module_path, class_name)

    @classmethod
    def resolve(cls, name: str, module_path: str | None = None, *, entry: str = "") -> type[T]:
        """The class configured as ``name`` (and ``module_path``); errors name
        ``entry``, by default the configuration key of the name."""
        resolved = cls.registry.resolve(name, module_path, entry=entry or cls.registry.name_key)
        return cast("type[T]", resolved)
