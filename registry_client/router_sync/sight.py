"""Whether router-sync can still vouch for what it offers (`registry_client.router_sync.sync`):
blind (its
watch has heard nothing from a registry: no change, no list, no bookmark) longer than its grace,
it cannot. Then it offers nothing and stops touching its alive file; each change of that is
said in one line, with the cause."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from registry_client.router_sync.vllm_router import ROUTER_EXPIRY_S

if TYPE_CHECKING:
    from registry_client.router_sync.offers import Groups

log = logging.getLogger("engine_registry.router_sync")


class Sight:
    """Whether router-sync can still vouch for what it offers: blind (nothing heard from a
    registry) longer than ``grace_s``, it cannot; each change of that is said in one line."""

    def __init__(self, grace_s: float, alive_file: Path | None) -> None:
        self.grace_s = grace_s
        self.alive_file = alive_file
        self.blinded = False
        self.since = 0.0  # when the watch last heard something, once blind past the grace

    def vouches(self, groups: Groups, offered: int) -> bool:
        blind_s, cause = groups.blind()
        if blind_s <= self.grace_s:
            if self.blinded:
                back = time.monotonic() - self.since
                log.warning(
                    "router-sync: the watch is back after %.0f s blind; offering the "
                    "registry's instances again",
                    back,
                )
            self.blinded = False
            return True
        if not self.blinded:
            self.since = time.monotonic() - blind_s
            probe = f"; {self.alive_file} is no longer touched" if self.alive_file else ""
            log.error(
                "router-sync: blind for %.0f s, past the %g s grace (%s): no longer offering "
                "the %d instances it last saw (the routers forget them within %g s)%s; "
                "offering again once the watch is back",
                blind_s,
                self.grace_s,
                cause or "nothing heard on the watch, not even a bookmark",
                offered,
                ROUTER_EXPIRY_S,
                probe,
            )
        self.blinded = True
        return False

    def alive(self) -> None:
        if self.alive_file is not None:
            self.alive_file.touch()


__all__ = ["Sight"]
