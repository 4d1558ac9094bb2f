"""The chain of manifests that builds the current version (what weight-sync keeps).

Its own module, without torch: the weight-sync service handles manifests only, never
tensors, and starts without importing torch (seconds of CPU in every run and restart).
"""

from __future__ import annotations

from seamlessflow.protocol import WeightManifest


class VersionChain:
    """A full manifest and the consecutive deltas after it, up to the current version."""

    def __init__(self) -> None:
        self.manifests: list[WeightManifest] = []

    @property
    def version(self) -> int:
        return self.manifests[-1].version if self.manifests else 0

    def extend(self, manifest: WeightManifest) -> bool:
        """Add the next version, or complete the current one (``completes``); False if
        it does neither (a delta on a base this chain does not end with, an older or
        repeated version), which leaves the chain unchanged."""
        if self.completes(manifest):
            self.manifests[-1] = manifest
            return True
        if manifest.kind == "full":
            if manifest.version > self.version or not self.manifests:
                self.manifests = [manifest]
                return True
            return False
        if self.manifests and manifest.base_version == self.version:
            self.manifests.append(manifest)
            return True
        return False

    def completes(self, manifest: WeightManifest) -> bool:
        """``manifest`` is the current version announced again with its fallback stored,
        where the chain holds it with the fallback pending (``fallback_pending``)."""
        last = self.manifests[-1] if self.manifests else None
        return (
            last is not None
            and manifest.version == last.version
            and last.fallback_pending
            and not manifest.fallback_pending
        )
