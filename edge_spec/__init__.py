"""The contract shared by `export/` (which writes bundles) and `runtime/` (which reads them).

Nothing here imports torch, transformers or onnxruntime: only numpy and the standard library.
"""

__version__ = "0.1.0"
