from kvtier.policies.lru import LRUCachePolicy


class OutOfTreePolicy(LRUCachePolicy):
    """An LRU under another name, loaded through cache_policy_module_path."""


class EntryPointPolicy(LRUCachePolicy):
    """Found through the ``kvtier.policies`` entry point group."""


class NotAPolicy:
    pass
