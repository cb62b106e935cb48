"""Core ML stage sessions (Apple Neural Engine) behind the ONNX Runtime session interface.

A CoreMLSession answers `run(output_names, feeds) -> list of arrays` with the feeds and outputs
ModelRunner.run_stage uses for ONNX Runtime, so ModelRunner and KVCache are unchanged:
- the KV lives in the package's states, made once per session (`make_state`). Roles share
  sessions the way they share KV (a layer-skip draft runs the target's trunk and head sessions),
  so the target's trunk state is the one the draft writes. past_key.i / past_value.i feeds are
  ignored; kv_len says where the block goes and which state rows are valid, so rollback is
  still only ModelRunner's cache moving kv_len;
- the package still returns the block's new_key.i / new_value.i rows, which ModelRunner copies
  into its own KVCache as for ONNX: that cache is then an unused mirror, costing its memory and
  a copy of T rows per layer per pass (see DESIGN NOTE below);
- a block of any length T is run as consecutive blocks of the package's enumerated lengths,
  largest first (exact: each sub-block sees the rows the previous one wrote), and the head,
  which scores every row, is cut down to logit_positions here.

DESIGN NOTE: dropping the mirror needs a KVCache that keeps kv_len and row_tokens without
buffers (feeds() returning {}, write_rows() doing nothing) for roles on this backend, chosen where
the Engine builds caches; nothing in ModelRunner itself would change.

coremltools is imported only when a package is loaded, and only on macOS 15+ (Core ML states):
elsewhere load_session raises CoreMLUnavailable naming what is needed.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np

from edge_spec import names
from edge_spec.manifest import BundleError, CoreMLPackageInfo, StageInfo, coreml_feature

# --coreml-compute-units values (the ONNX Runtime CoreML EP's MLComputeUnits names) -> coremltools'.
COMPUTE_UNITS = {
    "CPUAndNeuralEngine": "CPU_AND_NE",  # the Neural Engine, CPU for what it cannot run
    "ALL": "ALL",
    "CPUAndGPU": "CPU_AND_GPU",
    "CPUOnly": "CPU_ONLY",
}
MIN_MACOS = 15
REQUIREMENT = f"macOS {MIN_MACOS}+ (Core ML states) and coremltools 9.0 (pip install 'edge-spec[coreml]')"


class CoreMLUnavailable(Exception):
    """This machine cannot run Core ML packages."""


def _macos_major() -> int | None:
    if sys.platform != "darwin":
        return None
    release = platform.mac_ver()[0]
    return int(release.split(".")[0]) if release else None


def require_coreml():
    """coremltools, or CoreMLUnavailable saying what this machine lacks."""
    major = _macos_major()
    if major is None:
        raise CoreMLUnavailable(f"the Core ML backend needs {REQUIREMENT}; this machine runs {platform.system() or sys.platform}")
    if major < MIN_MACOS:
        raise CoreMLUnavailable(f"the Core ML backend needs {REQUIREMENT}; this Mac runs macOS {platform.mac_ver()[0]}")
    try:
        import coremltools
    except ImportError:
        raise CoreMLUnavailable(f"the Core ML backend needs {REQUIREMENT}; coremltools is not installed") from None
    return coremltools


def plan_blocks(block: int, lengths: tuple[int, ...]) -> list[int]:
    """Split a block of T rows into enumerated lengths, largest first (lengths include 1)."""
    plan = []
    for length in sorted(lengths, reverse=True):
        while block >= length:
            plan.append(length)
            block -= length
    return plan


class CoreMLSession:
    """One stage package and its state. `model` is a coremltools MLModel (or anything with
    predict(data, state=...) and make_state())."""

    def __init__(self, model, stage: StageInfo, package: CoreMLPackageInfo):
        self.model = model
        self.stage = stage
        self.package = package
        self.block_input = package.inputs[0]
        # Core ML feeds: token ids and kv_len are int32, hidden states fp16 (the package's types).
        self.block_dtype = np.int32 if stage.embed else np.float16
        self.state = model.make_state() if package.states else None

    def _predict(self, x: np.ndarray, start: int) -> dict[str, np.ndarray]:
        data = {self.block_input: x}
        if self.stage.layers:
            data[coreml_feature(names.KV_LEN)] = np.array([start], dtype=np.int32)
            return self.model.predict(data, state=self.state)
        return self.model.predict(data)

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = np.asarray(feeds[self.stage.inputs[0]])  # ids [1,T] or hidden [1,T,H]
        start = int(feeds[names.KV_LEN][0]) if self.stage.layers else 0
        block = x.shape[1]
        if block == 0:
            raise ValueError("a Core ML stage needs a block of at least one row")
        if self.stage.layers and start + block > self.package.state_length:
            raise ValueError(f"block of {block} rows at {start} overflows the Core ML KV states ({self.package.state_length} rows)")
        parts: dict[str, list[np.ndarray]] = {name: [] for name in output_names}
        at = 0
        for length in plan_blocks(block, self.package.block_lengths):
            result = self._predict(np.ascontiguousarray(x[:, at : at + length], dtype=self.block_dtype), start + at)
            for name in output_names:
                parts[name].append(np.asarray(result[coreml_feature(name)]))
            at += length
        outputs = []
        for name in output_names:
            axis = 2 if name.startswith("new_") else 1  # new K/V [1,KVH,T,D]; logits/hidden [1,T,.]
            joined = np.concatenate(parts[name], axis=axis).astype(np.float32)
            if name == names.LOGITS and feeds.get(names.LOGIT_POSITIONS) is not None:
                joined = joined[:, np.asarray(feeds[names.LOGIT_POSITIONS])]  # [1,N,V]
            outputs.append(joined)
        return outputs


def load_session(path: str | Path, stage: StageInfo, package: CoreMLPackageInfo, compute_units: str = "CPUAndNeuralEngine") -> CoreMLSession:
    """Load a bundle's stage package on this Mac; raises CoreMLUnavailable elsewhere."""
    if compute_units not in COMPUTE_UNITS:
        raise ValueError(f"unknown Core ML compute units {compute_units!r} (choose from {', '.join(COMPUTE_UNITS)})")
    ct = require_coreml()
    try:
        model = ct.models.MLModel(str(path), compute_units=getattr(ct.ComputeUnit, COMPUTE_UNITS[compute_units]))
    except Exception as exc:  # Core ML reports load failures as plain exceptions; name the package
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BundleError(f"Core ML cannot load {path}: {first_line}") from None
    return CoreMLSession(model, stage, package)
