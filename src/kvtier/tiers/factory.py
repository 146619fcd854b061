"""``SecondaryTierFactory``: ``type`` + ``module_path``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from kvtier.codecs import CodecConfig, codec_config
from kvtier.errors import BackendUnavailableError
from kvtier.plugins import PluginFactory, PluginRegistry
from kvtier.tiers.backend import Backend
from kvtier.tiers.base import SecondaryTier, TierOptions, TierSpec, constructor_arguments
from kvtier.tiers.remote import remote_tier


def _tier_of(loaded: object) -> object:
    """A configured :class:`Backend` class stands for the remote tier running it."""
    if isinstance(loaded, type) and issubclass(loaded, Backend):
        return remote_tier(loaded)
    return loaded


tier_registry: PluginRegistry[SecondaryTier] = PluginRegistry(
    kind="secondary tier",
    base=SecondaryTier,
    entry_point_group="kvtier.tiers",
    builtins=[
        ("example", "kvtier.tiers.example", "ExampleTier"),
        ("memory", "kvtier.tiers.memory", "MemoryTier"),
        ("fs", "kvtier.tiers.fs", "FilesystemTier"),
        ("redis", "kvtier.tiers.redis", "RedisTier"),
        ("obj", "kvtier.tiers.obj", "ObjectStoreTier"),
        ("p2p", "kvtier.tiers.p2p", "PeerTier"),
        ("mooncake", "kvtier.tiers.mooncake", "MooncakeTier"),
    ],
    adapt=_tier_of,
)


class SecondaryTierFactory(PluginFactory[SecondaryTier]):
    """Resolves and builds the secondary tiers named in configuration."""

    registry = tier_registry

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register a secondary tier under ``tier_type`` (``ValueError`` if taken)."""
        cls.register(tier_type, module_path, class_name)

    @classmethod
    def get_tier_class(
        cls, tier_config: Mapping[str, Any], *, entry: str = ""
    ) -> type[SecondaryTier]:
        tier_type = tier_config.get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise ValueError(f"{entry or 'secondary tier'}: configuration must include 'type'")
        # Errors name the entry, or nothing more (not the name key: "type" says little).
        return tier_registry.resolve(tier_type, tier_config.get("module_path"), entry=entry)

    @staticmethod
    def create_secondary_tier(
        tier_config: Mapping[str, Any],
        primary_kv_view: memoryview,
        spec: TierSpec,
        *,
        entry: str = "",
    ) -> SecondaryTier:
        cls = SecondaryTierFactory.get_tier_class(tier_config, entry=entry)
        options = dict(tier_config)
        tier_type = options.pop("type")
        # A loading hint only: it never reaches the constructor.
        options.pop("module_path", None)
        raw_codec = options.pop("codec", None)
        codec = None
        if raw_codec is not None:
            codec = codec_config(raw_codec, entry=f"{entry or 'secondary tier'}.codec")
        return SecondaryTierFactory.build_secondary_tier(
            cls, tier_type, options, primary_kv_view, spec, entry=entry, codec=codec
        )

    @staticmethod
    def build_secondary_tier(
        cls: type[SecondaryTier],
        tier_type: str,
        options: TierOptions | Mapping[str, Any],
        primary_kv_view: memoryview,
        spec: TierSpec,
        *,
        entry: str = "",
        codec: CodecConfig | None = None,
    ) -> SecondaryTier:
        """Construct a tier whose class was resolved already (a validated
        configuration holds it): errors say ``entry``, the class is not
        looked up again. ``options`` validated already (an instance of
        ``cls.Options``) are not validated again. ``codec``: the entry's
        codec, built here for the spec's layout (refused at once if it
        cannot encode it); the tier gets it as ``codec=``."""
        try:
            # Only a configured codec is passed: tiers of earlier releases
            # take no such argument.
            extra: dict[str, Any] = {}
            if codec is not None:
                extra["codec"] = codec.build(spec.layout)
            if isinstance(options, TierOptions):
                if type(options) is not cls.Options:
                    raise TypeError(
                        f"{cls.__qualname__} takes {cls.Options.__qualname__}, "
                        f"not {type(options).__qualname__}"
                    )
                arguments = (
                    constructor_arguments(options)
                    if _takes_any_keyword(cls)
                    # Its own signature: the options as declared, validated again by the base.
                    else {name: getattr(options, name) for name in options.model_fields_set}
                )
                return cls(
                    spec=spec,
                    primary_kv_view=primary_kv_view,
                    tier_type=tier_type,
                    **extra,
                    **arguments,
                )
            return cls(
                spec=spec,
                primary_kv_view=primary_kv_view,
                tier_type=tier_type,
                **extra,
                **dict(options),
            )
        except BackendUnavailableError as exc:
            if not entry or exc.entry:
                raise
            raise exc.at(entry) from exc.__cause__
        except Exception as exc:
            # Keep the type callers catch (OSError, ConfigError...), and say where.
            if entry and entry not in str(exc):
                exc.add_note(f"while starting {entry} (type {tier_type!r}, {cls.__qualname__})")
            raise


register_tier = SecondaryTierFactory.register_tier


@functools.cache
def _takes_any_keyword(cls: type[SecondaryTier]) -> bool:
    """Whether ``cls(...)`` passes keywords it does not name on (``**kwargs``), so
    that the validated options object reaches :class:`SecondaryTier` with them."""
    parameters = inspect.signature(cls).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
