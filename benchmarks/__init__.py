"""Measurements that need both sides (transformers and the runtime): not part of the package."""
