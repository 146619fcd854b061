"""Cache policies for the primary tier."""

from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import CachePolicyFactory, policy_registry, register_policy

__all__ = ["CachePolicy", "CachePolicyFactory", "policy_registry", "register_policy"]
