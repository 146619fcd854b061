"""The one resolver behind kvtier's three factories.

A name resolves, in order, through

1. the registry: built-ins and :meth:`PluginRegistry.register` calls, stored as
   lazy ``(module, class)`` strings so unused backends import nothing;
2. installed entry points in the registry's group (``kvtier.tiers`` ...);
3. the configured module path: ``importlib.import_module(module_path)`` and the
   attribute named like the plugin.

Importing a module runs its code, so configuration that names one is trusted
input. Operators who accept configuration from less trusted hands can confine
module paths with ``KVTIER_ALLOWED_MODULES``: a comma-separated list of module
prefixes (``acme_kv,corp.tiers``); when the variable is set, any other module
path is refused before it is imported, and an empty value refuses them all.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar, cast

from kvtier.errors import (
    PluginLoadError,
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
        name_key: str,
        module_key: str,
        entry_point_group: str,
    ) -> None:
        self.kind = kind
        self.base = base
        self.name_key = name_key
        self.module_key = module_key
        self.entry_point_group = entry_point_group
        self._registry: dict[str, _LazyClass] = {}
        self._warned_out_of_tree = False

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` resolve to ``module_path.class_name``, imported on first use."""
        if name in self._registry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._registry[name] = _LazyClass(module_path, class_name)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (for tests and for plugins replacing themselves)."""
        del self._registry[name]

    def registered_names(self) -> list[str]:
        """Names in the registry itself (built-ins and ``register`` calls), sorted."""
        return sorted(self._registry)

    def registered_target(self, name: str) -> str:
        """``module.Class`` a registered name resolves to, without importing it."""
        lazy = self._registry[name]
        return f"{lazy.module}.{lazy.class_name}"

    def names(self) -> list[str]:
        """Every name that resolves without a module path, sorted."""
        installed = {ep.name for ep in entry_points(group=self.entry_point_group)}
        return sorted(set(self._registry) | installed)

    def resolve(self, name: str, module_path: str | None = None, *, entry: str = "") -> type[T]:
        """The class for ``name``; ``entry`` names the config entry in errors."""
        where = f"{entry}: " if entry else ""
        lazy = self._registry.get(name)
        if lazy is not None:
            return self._load(lazy.module, lazy.class_name, name, entry, out_of_tree=False)
        for ep in entry_points(group=self.entry_point_group, name=name):
            module, _, attr = ep.value.partition(":")
            return self._load(module.strip(), attr.strip() or name, name, entry, out_of_tree=True)
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
        return self._load(module_path, name, name, entry, out_of_tree=True)

    def _load(
        self, module_path: str, class_name: str, name: str, entry: str, *, out_of_tree: bool
    ) -> type[T]:
        where = f"{entry}: " if entry else ""
        if out_of_tree:
            if not self._warned_out_of_tree:
                self._warned_out_of_tree = True
                logger.warning(
                    "Loading an out-of-tree %s. This interface is experimental and may "
                    "change in future kvtier releases.",
                    self.kind,
                )
            logger.info(
                "Loading out-of-tree %s %r from module %r", self.kind, class_name, module_path
            )
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
        # An explicit check, not an assert: asserts vanish under ``python -O``.
        if not (isinstance(loaded, type) and issubclass(loaded, self.base)):
            raise TypeError(
                f"{where}{module_path}.{class_name} is not a subclass of "
                f"{self.base.__module__}.{self.base.__qualname__}"
            )
        return cast("type[T]", loaded)
