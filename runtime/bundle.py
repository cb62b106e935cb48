"""Open a bundle folder: validate its manifest and every file before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_spec.manifest import BundleError, Manifest, read_manifest


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: Manifest
    digest: str = ""  # edge_spec.manifest.bundle_digest: the SHA-256 of manifest.json, which covers every file

    def file(self, relative: str) -> Path:
        return self.path / relative

    def require_role(self, role: str) -> None:
        if role not in self.manifest.models:
            have = ", ".join(self.manifest.models)
            raise BundleError(f"bundle {self.path} has no {role!r} model (it has: {have}); re-export with the draft you want")


def open_bundle(path: str | Path, check_hashes: bool = True, expected_sha256: str | None = None) -> Bundle:
    """expected_sha256: the bundle digest its user pinned; a bundle hashing otherwise is refused."""
    path = Path(path)
    manifest, digest = read_manifest(path, check_hashes=check_hashes, expected_sha256=expected_sha256)
    return Bundle(path, manifest, digest)
