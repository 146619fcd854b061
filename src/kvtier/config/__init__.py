"""kvtier's configuration: the loader, the typed model it builds, the plain sections.

- :mod:`~kvtier.config.loader`: the file format and validation (resolves plugins);
- :mod:`~kvtier.config.model`: the validated types the specs and runtime read;
- :mod:`~kvtier.config.sections`: plain sections the runtime reads (no plugins).

The runtime imports the model and the sections, never this package's loader.
"""

from kvtier.config.loader import load_config, validate_options, validate_tier
from kvtier.config.model import IndexConfig, KVTierConfig, TierConfig
from kvtier.config.sections import BackpressureConfig, MetricsConfig, TraceRecordingConfig

__all__ = [
    "BackpressureConfig",
    "IndexConfig",
    "KVTierConfig",
    "MetricsConfig",
    "TierConfig",
    "TraceRecordingConfig",
    "load_config",
    "validate_options",
    "validate_tier",
]
