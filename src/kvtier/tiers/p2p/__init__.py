"""``p2p``: kvtier nodes fetch chunks from each other's primary tier over TCP.

Modules: :mod:`~kvtier.tiers.p2p.protocol` (framing, messages, authentication),
:mod:`~kvtier.tiers.p2p.server` (the peer service, with :mod:`~kvtier.tiers.p2p.gate`
and :mod:`~kvtier.tiers.p2p.admission` for its handshakes and budgets),
:mod:`~kvtier.tiers.p2p.tls`, :mod:`~kvtier.tiers.p2p.client`
(connections to one peer), :mod:`~kvtier.tiers.p2p.backend` (peers asked and
served), :mod:`~kvtier.tiers.p2p.tier` (the tier running it) and
:mod:`~kvtier.tiers.p2p.options` (its options). Only the
standard library is needed: sockets, ``selectors``, ``ssl``, ``hmac`` and ``secrets``.
"""

from kvtier.tiers.p2p.options import PeerTierOptions
from kvtier.tiers.p2p.tier import PeerTier

__all__ = ["PeerTier", "PeerTierOptions"]
