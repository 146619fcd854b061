"""A module whose import fails, as a plugin with a missing dependency would."""

import kvtier_testplugin_missing_dependency  # type: ignore[import-not-found]  # noqa: F401
