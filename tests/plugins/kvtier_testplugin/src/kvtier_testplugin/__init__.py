"""Out-of-tree kvtier plugins for kvtier's factory tests."""
