"""``tiering``: the built-in spec — a CPU primary tier and the configured secondary tiers."""

from __future__ import annotations

import errno
import logging

from kvtier.config.model import IndexConfig
from kvtier.errors import ConfigError
from kvtier.fleet.factory import build_index
from kvtier.fleet.publisher import IndexPublisher
from kvtier.fleet.routing import PeerFinder
from kvtier.machine import available_memory
from kvtier.manager import TieringManager
from kvtier.primary import PrimaryTier, SlotBuffer
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.warm_start import WarmStart
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.units import format_bytes

logger = logging.getLogger(__name__)


class TieringSpec(OffloadingSpec):
    """Builds the tiers in configuration order; a tier that fails to start
    stops the startup and releases the tiers already built."""

    #: The configuration entry whose tier is being built, while one is (tools
    #: that bound start-up name it when a constructor does not return).
    starting: str | None = None

    def build_manager(self) -> TieringManager:
        # Checked by load_config too; again here for a configuration built by hand.
        problems = self.config.problems()
        if problems:
            raise ConfigError(problems)
        slot_bytes = self.layout.slot_bytes
        num_slots = int(self.config.cpu_bytes_to_use) // slot_bytes
        problems = []
        if num_slots < 1:
            problems.append(
                (
                    "cpu_bytes_to_use",
                    f"{int(self.config.cpu_bytes_to_use)} bytes cannot hold "
                    f"one {slot_bytes}-byte chunk of this layout",
                )
            )
        warm_bytes = int(self.config.warm_start_bytes)
        if 0 < warm_bytes < slot_bytes:
            problems.append(
                (
                    "warm_start_bytes",
                    f"{warm_bytes} bytes cannot hold one {slot_bytes}-byte chunk of this "
                    "layout: the warm start would bring nothing back (0 turns it off)",
                )
            )
        if problems:
            raise ConfigError(problems)
        buffer = self._primary_buffer(num_slots, slot_bytes)
        if self.config.populate_primary:
            buffer.populate_in_background()
        policy = self.config.policy_class()(num_slots)
        tiers: list[SecondaryTier] = []
        try:
            for index, tier_config in enumerate(self.config.secondary_tiers):
                self.starting = f"secondary_tiers[{index}] (type {tier_config.tier_type!r})"
                # Resolved and validated once, by load_config: neither the class
                # is looked up nor the options validated again.
                tiers.append(
                    SecondaryTierFactory.build_secondary_tier(
                        tier_config.tier_class,
                        tier_config.tier_type,
                        tier_config.options,
                        buffer.view,
                        self,
                        entry=f"secondary_tiers[{index}]",
                        codec=tier_config.codec,
                    )
                )
        except BaseException:
            for tier in tiers:
                tier.shutdown()
            buffer.close()
            raise
        self.starting = None
        logger.info(
            "kvtier: %d primary slots of %d bytes, policy %s, tiers %s",
            num_slots,
            slot_bytes,
            self.config.eviction_policy,
            [t.tier_type for t in tiers],
        )
        manager = TieringManager(PrimaryTier(buffer, policy), tiers, self.config.backpressure)
        try:
            if self.config.index is not None:
                self._attach_index(manager, self.config.index)
            if self.config.warm_start_bytes:
                WarmStart.attach(manager, int(self.config.warm_start_bytes) // slot_bytes)
        except BaseException:
            manager.shutdown()
            raise
        return manager

    def _primary_buffer(self, num_slots: int, slot_bytes: int) -> SlotBuffer:
        name = self.config.shared_memory_name
        size_bytes = num_slots * slot_bytes
        size = format_bytes(size_bytes)
        available = available_memory(less_used=False)
        if available is not None and size_bytes > available[0]:
            # Mapped lazily, it would start, and the engine be killed for memory
            # once its slots were written (at once: they are mapped ahead).
            free, source = available
            problem = f"{size} of slots exceed the {format_bytes(free)} available ({source})"
            raise ConfigError([("cpu_bytes_to_use", problem)])
        try:
            return SlotBuffer(num_slots, slot_bytes, shared_name=name)
        except FileExistsError as error:
            problem = (
                f"{error.filename} exists: another engine's primary tier, or one a killed "
                "process left; name another, or remove it if no process uses it"
            )
            raise ConfigError([("shared_memory_name", problem)]) from error
        except OSError as error:
            if error.errno not in (errno.ENOMEM, errno.ENOSPC):
                raise
            where = " in shared memory" if name else ""
            problem = f"cannot map {size} of slots{where}: {error.strerror}"
            raise ConfigError([("cpu_bytes_to_use", problem)]) from error

    @staticmethod
    def _attach_index(manager: TieringManager, section: IndexConfig) -> None:
        """Publish the node's chunks to the cluster index; tiers that ask
        other nodes ask it first."""
        index = build_index(section.index_class, section.options)
        advertised = [tier.advertised_address() for tier in manager.tiers]
        publisher = IndexPublisher(
            index,
            held=manager.primary.ready_keys,
            p2p_address=next((address for address in advertised if address), None),
        )
        serving = any(getattr(tier, "address", None) for tier in manager.tiers)
        if serving and publisher.lease.p2p_address is None:
            logger.warning(
                "cluster index: this node's p2p service listens on a wildcard address, so "
                "peers asking the index cannot find it: set index.p2p_address"
            )
        manager.attachments.append(publisher)
        manager.residency.add_listener(publisher.residency_changed)
        finder = PeerFinder(index)
        for tier in manager.tiers:
            tier.use_holder_index(finder)
