from kvtier.specs.tiering import TieringSpec


class OutOfTreeSpec(TieringSpec):
    """The tiering spec under another name, loaded through spec_module_path."""


class EntryPointSpec(TieringSpec):
    """Found through the ``kvtier.specs`` entry point group."""
