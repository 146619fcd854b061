"""``p2p``: fetch chunks that other kvtier nodes hold in their primary tier,
and serve this node's own to them. Lookups are batched per step, loads
verified in their slot, stores send nothing (peers pull).

The tier is the local-tier runtime over :class:`~kvtier.tiers.p2p.backend.PeerBackend`.
See docs/p2p.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvtier.tiers.base import HolderIndex, JobResult, TransferJob
from kvtier.tiers.local import LocalTier
from kvtier.tiers.p2p.backend import PeerBackend
from kvtier.tiers.p2p.options import PeerTierOptions

if TYPE_CHECKING:
    from kvtier.primary import PrimaryTier


class PeerTier(LocalTier[PeerTierOptions]):
    """Chunks fetched from other kvtier nodes' primary tiers; serves its own."""

    backend_class = PeerBackend
    backend: PeerBackend
    holds_stores: ClassVar[bool] = False
    #: Peers serve their primary tier's exact chunks: there is nothing to decode.
    takes_codecs: ClassVar[bool] = False

    @property
    def address(self) -> tuple[str, int] | None:
        """Where this node's peer service listens, once bound."""
        return self.backend.address

    def advertised_address(self) -> str | None:
        return self.backend.advertised_address()

    def use_holder_index(self, index: HolderIndex) -> None:
        self.backend.use_holder_index(index)

    def on_attach(self, primary: PrimaryTier) -> None:
        """Start the workers, and serving the node's primary tier on the bound listen address."""
        super().on_attach(primary)
        self.backend.serve(primary)

    def submit_store(self, job: TransferJob) -> None:
        """Succeeds at once and sends nothing: peers fetch what they need."""
        self.jobs.report(JobResult(job.job_id, True, frozenset(job.keys), 0, 0.0))
