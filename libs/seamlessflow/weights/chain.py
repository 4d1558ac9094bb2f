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
        """Add the next version; False if it does not continue this chain (a delta on
        a base this chain does not end with), which leaves the chain unchanged."""
        if manifest.kind == "full":
            if manifest.version > self.version or not self.manifests:
                self.manifests = [manifest]
                return True
            return False
        if self.manifests and manifest.base_version == self.version:
            self.manifests.append(manifest)
            return True
        return False
