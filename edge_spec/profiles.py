"""Device profiles: what a bundle's graphs are built for (`python -m export --device`), and what
the runtime does when a bundle meets a provider.

A profile fixes the graphs' activation and KV types, their attention kind and the weight
formats they can hold; `runtime check` proves, node by node, that a provider has a kernel for
each (edge_spec/placement.py, kernel tables in edge_spec/kernels/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # the --device value, recorded as Manifest.device
    provider: str  # the --provider it is built for
    activations: str  # float32 | float16: hidden states, attention, norms' inputs
    kv_dtype: str  # KV buffers' element type
    attentions: tuple[str, ...]  # edge_spec.names.ATTENTION_KINDS it allows; the first is the default
    quants: tuple[str, ...]  # weight formats it can express
    why_not: dict  # quant or attention it refuses -> the reason, in a clause
    quantized_embedding: bool = True  # int4/int8 embedding tables as GatherBlockQuantized (else float)
    zero_points: bool = False  # int4/int8 MatMulNBits always carry their zero-point input (export --zero-points implied)

    def refusal(self, quant: str, attention: str) -> str | None:
        """Why --device NAME cannot be exported with this --quant and --attention, or None."""
        if attention not in self.attentions:
            return f"--device {self.name} --attention {attention}: {self.why_not.get(attention, 'not part of this profile')}"
        if quant not in self.quants:
            return f"--device {self.name} --quant {quant}: {self.why_not.get(quant, 'not part of this profile')}"
        return None


_GPU_WHY = {
    "fp32": "this profile keeps float16 activations and KV (choose --quant fp16, int8 or int4; fp32 graphs are --device cpu)",
    "portable": "GPU graphs write the KV cache in place with GroupQueryAttention (fused); portable graphs would copy rows through the host",
}

_DML_WHY = {
    "fp32": _GPU_WHY["fp32"],
    "fused": "DirectML's GroupQueryAttention skips rotary and ignores the cache in passes of more than one token "
    "(edge_spec/kernels/semantics.json); --device dml writes masked graphs",
    "portable": "--device dml writes masked graphs (positions and mask from the runtime, no integer index arithmetic on the GPU)",
}

PROFILES = {
    "cpu": DeviceProfile("cpu", "cpu", "float32", "float32", ("fused", "portable"), ("int4", "int8", "fp16", "fp32"), {}),
    "cuda": DeviceProfile("cuda", "cuda", "float16", "float16", ("fused",), ("int4", "int8", "fp16"), _GPU_WHY),
    # DirectML registers no GatherBlockQuantized: the embedding table stays float16 there. Its
    # GroupQueryAttention computes something else (see _DML_WHY): masked attention, rotary in the
    # graph, the KV rows copied in by the runtime.
    # Its MatMulNBits (171d616) takes a node only with the zero-point input (edge_spec/kernels/semantics.json): every node gets one.
    "dml": DeviceProfile("dml", "dml", "float16", "float16", ("masked",), ("int4", "int8", "fp16"), _DML_WHY, quantized_embedding=False,
                         zero_points=True),
    "coreml": DeviceProfile(
        "coreml", "coreml", "float32", "float32", ("masked",), ("fp16", "fp32"),
        {
            "int4": "MatMulNBits and GatherBlockQuantized are ONNX Runtime contrib ops the Core ML EP does not take "
            "(int4/int8 Core ML weights come with --format coreml)",
            "int8": "MatMulNBits and GatherBlockQuantized are ONNX Runtime contrib ops the Core ML EP does not take "
            "(int4/int8 Core ML weights come with --format coreml)",
            "fused": "GroupQueryAttention is an ONNX Runtime contrib op the Core ML EP does not take",
            "portable": "its index arithmetic (Range, Less, Expand, Neg) has no Core ML EP builder; --device coreml writes masked graphs",
        },
    ),
}
DEVICES = tuple(PROFILES)


def load_verdict(device: str, provider: str) -> str | None:
    """A warning when a bundle exported for `device` would run on `provider`, but slowly (a
    provider with no kernel for some node is refused by the placement check, not here)."""
    if device == provider:
        return None
    if provider == "cpu":
        if device in ("cuda", "dml"):
            return (f"this bundle was exported for --device {device} (float16 activations): the CPU provider casts its "
                    "float16 Add, Mul and Sigmoid nodes to float32 and holds more memory; --device cpu bundles are built for it")
        return None
    return f"this bundle was exported for --device {device}; on {provider} export it with --device {provider}"
