"""Which of a GGUF's tensor types `export --gguf-blocks` keeps as they are, and at what cost.

    python -m benchmarks gguf_types FILE.gguf [--out FILE.json]

MatMulNBits dequantizes w = (q - zero_point) * scale per block along K, with 2, 4 or 8-bit q, an
integer zero point and a float scale per block of 16 to 256 weights. A type without a float
minimum (Q8_0, Q4_0, Q5_0, Q6_K) is that form; one with a minimum per 32 (Q4_1, Q5_1, Q4_K,
Q5_K: w = d * q + m, and m / d is no integer zero point) keeps its q and scales with zero point 0
and adds the minimum as a second term (export.gguf_blocks, where the table lives). For each type
present: its share, its bits per weight in the file, its form, and the bits per weight the CPU
kernel reads in that form (the packed q, a float32 scale and block sum per block, and the float32
minimum matrix: export.gguf_blocks.kernel_bits).
"""

from __future__ import annotations

from collections import defaultdict

from export.gguf_blocks import FORMS, NOT_BLOCKS, kernel_bits


def analyse(path: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    params: dict[str, int] = defaultdict(int)
    for tensor in reader.tensors:
        params[tensor.tensor_type.name] += int(tensor.n_elements)
    total = sum(params.values())
    rows = {}
    for name, count in sorted(params.items(), key=lambda kv: -kv[1]):
        form = FORMS.get(name)
        file_bits = form[0] if form else NOT_BLOCKS.get(name)
        why = form[5] if form else ("float: norms and biases stay float32, a float matrix is quantized by the exporter" if name in NOT_BLOCKS else "no block form: quantized by the exporter")
        rows[name] = {"params": count, "share": count / total, "file_bits_per_weight": file_bits, "exact": form is not None, "why": why,
                      "exact_form": None if form is None else {"bits": form[1], "block": form[2], "zero_point": form[3], "minimum_term": form[4]},
                      "exact_kernel_bits_per_weight": None if form is None else kernel_bits(name)}
    exact = sum(r["params"] for r in rows.values() if r["exact"])
    return {"file": path, "params": total, "types": rows, "share_exact": exact / total}


def table(result: dict) -> list[str]:
    lines = ["| type | share of weights | bits/weight in the file | exact in MatMulNBits | bits/weight the CPU kernel reads, exact |", "|---|---|---|---|---|"]
    for name, r in result["types"].items():
        form = r["exact_form"]
        exact = (f"yes: {form['bits']}-bit, block {form['block']}, zero point {form['zero_point']}{', minimum term' if form['minimum_term'] else ''}"
                 if form else f"no: {r['why']}")
        kernel = f"{r['exact_kernel_bits_per_weight']:.2f}" if form else "-"
        file_bits = f"{r['file_bits_per_weight']:g}" if r["file_bits_per_weight"] else "?"
        lines.append(f"| {name} | {100 * r['share']:.1f}% | {file_bits} | {exact} | {kernel} |")
    return lines
