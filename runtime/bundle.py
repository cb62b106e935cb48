"""Open a bundle folder: validate its manifest and every file before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_spec.manifest import BundleError, Manifest, load_manifest


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: Manifest

    def file(self, relative: str) -> Path:
        return self.path / relative

    def require_role(self, role: str) -> None:
        if role not in self.manifest.models:
            have = ", ".join(self.manifest.models)
            raise BundleError(f"bundle {self.path} has no {role!r} model (it has: {have}); re-export with the draft you want")


def open_bundle(path: str | Path, check_hashes: bool = True) -> Bundle:
    path = Path(path)
    return Bundle(path, load_manifest(path, check_hashes=check_hashes))
