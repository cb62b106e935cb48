"""Which of a GGUF's tensor types ONNX Runtime's MatMulNBits can hold exactly, and at what cost.

    python -m benchmarks gguf_types FILE.gguf [--out FILE.json]

MatMulNBits dequantizes w = (q - zero_point) * scale per block along K, with 2, 4 or 8-bit q, an
integer zero point (uint8) and a float scale per block of 16 to 256 weights (a float zero point
exists, but sends the CPU kernel to its dequantize-then-SGEMM path). A GGUF type maps exactly
when its blocks fit that form: a scale per block and an integer offset. Types with a float
minimum per block (Q4_1, Q5_1, Q4_K, Q5_K: w = d * q + m) do not: m / d is not an integer, so
they need either a second term (the block sums times the minimums) or a refit. For each type
present: its parameters, its bits per weight in the file, the exact MatMulNBits form if there is
one and the bits per weight the CPU kernel reads in that form (the packed q, and a float32 scale
and block sum per block: benchmarks.op_profile.matmulnbits_bytes).
"""

from __future__ import annotations

from collections import defaultdict

# type -> (bits per weight in the file, exact MatMulNBits form as (bits, block, zero point) or None, why)
FORMS = {
    "F32": (32.0, None, "float; not a block type"),
    "F16": (16.0, None, "float; not a block type"),
    "Q8_0": (8.5, (8, 32, 128), "w = d * q, q int8: q + 128 as uint8 with the default zero point 128"),
    "Q4_0": (4.5, (4, 32, 8), "w = d * (q - 8): MatMulNBits' symmetric default"),
    "Q5_0": (5.5, (8, 32, 16), "w = d * (q - 16), q 5-bit: held in 8 bits with zero point 16"),
    "Q6_K": (6.5625, (8, 16, 32), "w = d * s_j * (q - 32) per 16: an 8-bit block of 16 with scale d * s_j (exact in float32) and zero point 32"),
    "Q4_1": (5.0, None, "w = d * q + m: m / d is not an integer zero point"),
    "Q5_1": (6.0, None, "w = d * q + m: m / d is not an integer zero point"),
    "Q4_K": (4.5, None, "w = d * s_j * q - dmin * m_j per 32: the minimum is not an integer multiple of the scale"),
    "Q5_K": (5.5, None, "w = d * s_j * q - dmin * m_j per 32: the minimum is not an integer multiple of the scale"),
}


def kernel_bits(bits: int, block: int) -> float:
    """Bits per weight the CPU kernel reads for MatMulNBits at (bits, block)."""
    return bits + 64 / block


def analyse(path: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    params: dict[str, int] = defaultdict(int)
    for tensor in reader.tensors:
        params[tensor.tensor_type.name] += int(tensor.n_elements)
    total = sum(params.values())
    rows = {}
    for name, count in sorted(params.items(), key=lambda kv: -kv[1]):
        file_bits, form, why = FORMS.get(name, (None, None, "not analysed"))
        rows[name] = {"params": count, "share": count / total, "file_bits_per_weight": file_bits, "exact": form is not None, "why": why,
                      "exact_form": None if form is None else {"bits": form[0], "block": form[1], "zero_point": form[2]},
                      "exact_kernel_bits_per_weight": None if form is None else kernel_bits(form[0], form[1])}
    exact = sum(r["params"] for r in rows.values() if r["exact"] and r["exact_form"])
    return {"file": path, "params": total, "types": rows, "share_exact": exact / total}


def table(result: dict) -> list[str]:
    lines = ["| type | share of weights | bits/weight in the file | exact in MatMulNBits | bits/weight the CPU kernel reads, exact |", "|---|---|---|---|---|"]
    for name, r in result["types"].items():
        form = r["exact_form"]
        exact = f"yes: {form['bits']}-bit, block {form['block']}, zero point {form['zero_point']}" if form else f"no: {r['why']}"
        kernel = f"{r['exact_kernel_bits_per_weight']:.2f}" if form else "-"
        file_bits = f"{r['file_bits_per_weight']:g}" if r["file_bits_per_weight"] else "?"
        lines.append(f"| {name} | {100 * r['share']:.1f}% | {file_bits} | {exact} | {kernel} |")
    return lines
