"""What a ``secondary_tiers`` entry of vLLM's tiering that names a kvtier tier
holds, validated: its own options and the kvtier tier entry inside them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from pydantic import field_validator
from vllm.v1.kv_offload.base import Locality

from kvtier.config import TierConfig, validate_options, validate_tier
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.row_layout import row_elements
from kvtier.options import Options

#: Keys of a ``secondary_tiers`` entry that vLLM's factory takes for itself.
_FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})


class TieringOptions(Options):
    """What a ``secondary_tiers`` entry of vLLM's tiering gives this tier, beside
    ``type``, ``module_path`` and ``backpressure`` (which vLLM's factory takes)."""

    tier: dict[str, Any]
    """One kvtier secondary-tier entry: ``{type: fs, root_dir: ...}`` and its options."""

    enable_kv_events: bool = False
    """Announce chunks stored in and removed from the tier as vLLM KV events
    (when vLLM's own KV events are on)."""

    locality: str | None = None
    """Where the tier's storage is relative to this engine (``LOCAL`` or
    ``REMOTE``), for vLLM's per-request tier filters and KV events; unset, as
    with vLLM's own tiers, means unknown."""

    model_id: str | None = None
    """Declares the weights' identity instead of reading their files; whoever
    sets it must change it whenever the weights change."""

    @field_validator("locality")
    @classmethod
    def _known_locality(cls, value: str | None) -> str | None:
        if value is not None and value not in Locality.__members__:
            raise ValueError(f"Locality must be one of {list(Locality.__members__)}, got {value!r}")
        return value


@dataclass(frozen=True)
class TieringEntry:
    """One validated entry: where it stands, its options, its kvtier tier."""

    path: str
    settings: TieringOptions
    tier: TierConfig


def validate_entry(spec: Any, options: Mapping[str, Any]) -> TieringEntry:
    """The entry vLLM's factory handed over as ``options``, validated against
    ``spec`` (an ``OffloadingSpec``); :class:`ConfigError` naming its path."""
    path = _entry_path(spec, options)
    settings = cast(TieringOptions, validate_options(TieringOptions, options, path))
    tier_config = validate_tier(settings.tier, f"{path}.tier")
    if tier_config.tier_type == "p2p":
        raise ConfigError(
            [
                (
                    f"{path}.tier.type",
                    "'p2p' serves chunks from kvtier's own CPU tier, which vLLM's "
                    "tiering replaces with its own; use kvtier's connector "
                    "(KVTierConnector) for p2p, or vLLM's own p2p tier here",
                )
            ]
        )
    _, opaque = row_elements(spec.config)
    codec = tier_config.codec
    if opaque is not None and codec is not None and codec.codec_class.lossy:
        raise ConfigError(
            [
                (
                    f"{path}.tier.codec",
                    f"{codec.codec_type!r} is lossy and encodes float KV only, "
                    f"but {opaque}; use codec none or lossless",
                )
            ]
        )
    return TieringEntry(path, settings, tier_config)


def _entry_path(spec: Any, options: Mapping[str, Any]) -> str:
    """``secondary_tiers[i]``: the entry whose options vLLM's factory handed
    over (as the same objects), since it hands a tier its options, not its place."""
    configs = getattr(spec, "secondary_tier_configs", None)
    for index, entry in enumerate(configs if isinstance(configs, list) else ()):
        if not isinstance(entry, Mapping):
            continue
        own = {k: v for k, v in entry.items() if k not in _FACTORY_KEYS}
        if own.keys() == options.keys() and all(own[k] is options[k] for k in own):
            return f"secondary_tiers[{index}]"
    return "secondary_tiers[?]"
