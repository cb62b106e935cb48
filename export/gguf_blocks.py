"""A GGUF's quantized blocks as MatMulNBits and GatherBlockQuantized can hold them, bit for bit.

MatMulNBits computes with w = (q - zero_point) * scale per block along K (2, 4 or 8-bit q, an
integer zero point, a float scale per block of 16 to 256 weights). A GGUF type maps exactly when
its blocks have that form; types that add a float minimum per 32 weights (Q4_1, Q5_1, Q4_K,
Q5_K: w = d * q + m) keep their q and scales with zero point 0 and carry the minimum as a second
term, the activations' sums over each 32 times a [K/32, N] matrix (export.quantize writes it).
So a bundle made from a GGUF computes with the weights llama.cpp runs, not a second rounding of
them. The bit layouts follow ggml's block structs (as gguf-py's dequantizers read them); every
decode is checked against gguf-py's own dequantization where it is used (Blocks.dequantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# type -> (bits per weight in the file, MatMulNBits bits, block, zero point, minimum per 32, how)
FORMS = {
    "Q8_0": (8.5, 8, 32, 128, False, "w = d * q, q int8: q + 128 as uint8 with the default zero point 128"),
    "Q4_0": (4.5, 4, 32, 8, False, "w = d * (q - 8): MatMulNBits' symmetric default"),
    "Q5_0": (5.5, 8, 32, 16, False, "w = d * (q - 16), q 5-bit: held in 8 bits with zero point 16"),
    "Q6_K": (6.5625, 8, 16, 32, False, "w = d * s_j * (q - 32) per 16: an 8-bit block of 16 with scale d * s_j (exact in float32), zero point 32"),
    "Q4_1": (5.0, 4, 32, 0, True, "w = d * q + m per 32: zero point 0, scale d, and m as the minimum term"),
    "Q5_1": (6.0, 8, 32, 0, True, "w = d * q + m per 32, q 5-bit: 8 bits, zero point 0, and m as the minimum term"),
    "Q4_K": (4.5, 4, 32, 0, True, "w = d * s_j * q - dmin * m_j per 32: zero point 0, scale d * s_j, and -dmin * m_j as the minimum term"),
    "Q5_K": (5.5, 8, 32, 0, True, "w = d * s_j * q - dmin * m_j per 32, q 5-bit: 8 bits, zero point 0, and the minimum term"),
}
NOT_BLOCKS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0}
MINIMUM_BLOCK = 32  # every type with a minimum keeps one per 32 weights


@dataclass(frozen=True)
class Blocks:
    """Weights w [N, K] as w = (q - zero) * scale per `block` along K, plus `minimum` per 32 when
    the type has one. q is unpacked (one uint8 per weight)."""

    type: str
    bits: int
    block: int
    zero: int
    q: np.ndarray  # uint8 [N, K]
    scale: np.ndarray  # float32 [N, K / block]
    minimum: np.ndarray | None  # float32 [N, K / 32], added

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def rows(self, index: np.ndarray) -> Blocks:
        """The rows at `index`, in that order (a processor's row permutation, a trimmed head)."""
        return Blocks(self.type, self.bits, self.block, self.zero, self.q[index], self.scale[index], None if self.minimum is None else self.minimum[index])

    def same_form(self, other: Blocks) -> bool:
        return (self.bits, self.block, self.zero, self.minimum is None) == (other.bits, other.block, other.zero, other.minimum is None)

    def dequantized(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 rows [start, stop), in the order of operations gguf-py's dequantizers use."""
        q, scale = self.q[start:stop], self.scale[start:stop]
        n, k = q.shape
        w = scale[:, :, None] * (q.reshape(n, -1, self.block).astype(np.float32) - np.float32(self.zero))
        w = w.reshape(n, k)
        if self.minimum is not None:
            w = (w.reshape(n, -1, MINIMUM_BLOCK) + self.minimum[start:stop][:, :, None]).reshape(n, k)
        return w


def concat(parts: list[Blocks]) -> Blocks:
    """Blocks of the same form stacked along N (a merged projection)."""
    first = parts[0]
    if not all(first.same_form(p) for p in parts):
        raise ValueError("blocks of different forms cannot share one MatMulNBits")
    minimum = None if first.minimum is None else np.concatenate([p.minimum for p in parts])
    return Blocks(first.type, first.bits, first.block, first.zero, np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), minimum)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes [..., g * group] -> 4-bit values: each group's low nibbles, then its high ones."""
    shape = qs.shape[:-1]
    qs = qs.reshape(*shape, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (qs & np.uint8(0x0F)).reshape(*shape, -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (one little-endian uint32) -> [..., 32] values 0/1."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def decode(type_name: str, data: np.ndarray, k: int) -> Blocks | None:
    """A GGUF tensor's bytes [N, bytes per row] (as gguf's reader maps them) as Blocks of its exact
    MatMulNBits form; None for a type without one (floats, Q2_K, Q3_K, the IQ types)."""
    import gguf
    from gguf.quants import Q4_K

    if type_name not in FORMS:
        return None
    _, bits, block, zero, _, _ = FORMS[type_name]
    block_weights, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n = data.shape[0]
    b = np.ascontiguousarray(data).reshape(n, k // block_weights, type_size)
    minimum = None
    if type_name == "Q8_0":
        scale, q = _f16(b[..., 0:2]), (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif type_name == "Q4_0":
        scale, q = _f16(b[..., 0:2]), _nibbles(b[..., 2:], 16)
    elif type_name == "Q4_1":
        scale, minimum, q = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:], 16)
    elif type_name == "Q5_0":
        scale, q = _f16(b[..., 0:2]), _nibbles(b[..., 6:], 16) | (_fifth_bits(b[..., 2:6]) << np.uint8(4))
    elif type_name == "Q5_1":
        scale, minimum = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 8:], 16) | (_fifth_bits(b[..., 4:8]) << np.uint8(4))
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        scale = d[..., None] * sc.reshape(n, -1, 8).astype(np.float32)
        minimum = -(dmin[..., None] * m.reshape(n, -1, 8).astype(np.float32))
        if type_name == "Q4_K":
            q = _nibbles(b[..., 16:], 32)
        else:
            high = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = _nibbles(b[..., 48:], 32) | ((high & np.uint8(1)).reshape(n, -1, 256) << np.uint8(4))
    else:  # Q6_K: ql 128, qh 64, 16 int8 scales, d
        low = _nibbles(b[..., 0:128], 64)
        high = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & np.uint8(3)
        q = low | (high.reshape(n, -1, 256) << np.uint8(4))
        scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    q = q.reshape(n, k).astype(np.uint8)
    scale = np.ascontiguousarray(scale, np.float32).reshape(n, k // block)
    if minimum is not None:
        minimum = np.ascontiguousarray(minimum, np.float32).reshape(n, k // MINIMUM_BLOCK)
    return Blocks(type_name, bits, block, zero, q, scale, minimum)


RECODE_BLOCK = 64  # int8 blocks for a type re-rounded instead of kept (export --gguf-to-int8)


def to_int8(blocks: Blocks, block: int = RECODE_BLOCK) -> Blocks:
    """`blocks` rounded once more, to symmetric int8 blocks of `block` (scale max|w| / 127): a
    6-bit type at 9 bits per weight read instead of 12, at a rounding step about a quarter of
    its own."""
    w = blocks.dequantized().reshape(blocks.shape[0], -1, block)
    scale = np.maximum(np.abs(w).max(-1) / np.float32(127), np.float32(1e-30)).astype(np.float32)
    q = (np.clip(np.round(w / scale[..., None]), -127, 127) + 128).astype(np.uint8).reshape(blocks.shape)
    return Blocks(f"{blocks.type} as int8/{block}", 8, block, 128, q, scale, None)


def matmul_kernel_bits(bits: int, block: int, minimum: bool = False) -> float:
    """Bits per weight ONNX Runtime's CPU kernel reads for MatMulNBits at (bits, block): the
    packed q, a float32 scale and a float32 block sum per block (op_profile.matmulnbits_bytes),
    and with a minimum term the float32 minimum matrix, one value per 32 weights."""
    return bits + 64 / block + (32 / MINIMUM_BLOCK if minimum else 0)


def kernel_bits(type_name: str) -> float:
    """matmul_kernel_bits of a GGUF type's kept form."""
    _, bits, block, _, minimum, _ = FORMS[type_name]
    return matmul_kernel_bits(bits, block, minimum)


def kept_bytes(type_name: str, n: int, k: int, to_int8: tuple[str, ...] = ()) -> int | None:
    """Bytes export writes for an [N, K] tensor of `type_name` kept as its blocks (quantize's
    _blocks_tensors and the minimum matrix), the same for MatMulNBits and GatherBlockQuantized;
    None for a type with no block form (it is re-quantized)."""
    if type_name in to_int8:
        bits, block, zero, minimum = 8, RECODE_BLOCK, 128, False
    elif type_name in FORMS:
        _, bits, block, zero, minimum, _ = FORMS[type_name]
    else:
        return None
    blocks = k // block
    size = n * k * bits // 8 + n * blocks * 4
    if zero != 2 ** (bits - 1):
        size += n * (-(-blocks // 2) if bits == 4 else blocks)
    if minimum:
        size += n * (k // MINIMUM_BLOCK) * 4
    return size


@dataclass(frozen=True)
class StoredGGUF:
    """What a bundle keeping a GGUF's own blocks stores for its target, read from the file's
    tensor table alone (no weights): the export memory plan's stored bytes."""

    total: int  # every weight: the kept blocks, re-quantized matrices, float vectors
    head_row: int  # bytes of one LM head row (the head is trimmed to fewer rows by row)


def stored_gguf(path: str, to_int8: tuple[str, ...] = (), requantized_bytes_per_weight: float = 0.625) -> StoredGGUF:
    """StoredGGUF of `path`: matrices by kept_bytes (a type without a form at
    requantized_bytes_per_weight), vectors as float32, the LM head its own copy of the
    embedding's blocks when the file ties them."""
    from export.sources import gguf_reader

    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in gguf_reader(path).tensors}

    def matrix(type_name: str, shape: list[int]) -> int:
        k, n = shape[0], shape[1]
        kept = kept_bytes(type_name, n, k, to_int8)
        return kept if kept is not None else round(n * k * requantized_bytes_per_weight)

    total = 0
    for type_name, shape in tensors.values():
        total += matrix(type_name, shape) if len(shape) == 2 else 4 * int(np.prod(shape))
    head_type, head_shape = tensors.get("output.weight", tensors["token_embd.weight"])
    if "output.weight" not in tensors:
        total += matrix(head_type, head_shape)
    return StoredGGUF(total, matrix(head_type, [head_shape[0], 1]))
