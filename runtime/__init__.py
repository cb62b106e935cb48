"""edge-spec runtime: load a bundle on ONNX Runtime and generate, speculatively and exactly.

Imports only onnxruntime, numpy, tokenizers and jinja2: never torch or transformers.
"""

from runtime.engine import Engine, EngineConfig, GenerateConfig, GenerationResult

__all__ = ["Engine", "EngineConfig", "GenerateConfig", "GenerationResult"]
