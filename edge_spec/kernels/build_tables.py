#!/usr/bin/env python3
"""Build per-provider ONNX Runtime kernel tables (small JSON data files).

Two modes, same output format:

  from-docs       parse ONNX Runtime's generated docs/OperatorKernels.md
                  ("Operators implemented by <Provider>" section).
  from-installed  read the kernel registry of the onnxruntime that Python
                  imports (C.get_all_opkernel_def()), positional input/output
                  type constraints taken from the op schemas.

Output (keys sorted, one kernel table line per op):

  {"kernels": {"<domain>::<op>": [ENTRY, ...], ...},
   "onnxruntime": "<version>", "provider": "<EP name>", "source": "<text>"}

  ENTRY = {"since": int, "until": int | null,
           "inputs": [...], "outputs": [...],
           "variadic_last_input": bool, "variadic_last_output": bool,
           "types": {"<constraint>": ["float16", ...], ...}}

Domain "ai.onnx" is the default ("") domain.  inputs/outputs give, per formal
position, the type-constraint name ("T") or "=<type>" for a fixed type
("tensor(int64)" -> "=int64").  Type names are ONNX's lower-case element
names ("float", "float16", "int4", ...); non-tensor types keep a wrapper
("seq(float)", "optional(float)", "optional(seq(float))").

A node has a kernel when some ENTRY has since <= opset <= until (until null:
open-ended) and each constrained letter's actual type is in its list.  A
constraint letter used in inputs/outputs but absent from "types" is not
constrained by the kernel (any type the op schema allows).

from-installed keeps the exact type combinations of the registry: several
registrations of one version range are merged only where that loses nothing
(they differ in at most one constraint), so one op/version may have several
entries (alternatives).  from-docs can only give the union per constraint
that the markdown lists.

Only the Python standard library and onnxruntime are used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

INT_MAX = 2147483647

DOMAIN_ALIASES = {"": "ai.onnx", "ai.onnx": "ai.onnx"}


def norm_domain(domain: str) -> str:
    return DOMAIN_ALIASES.get(domain, domain)


def norm_type(t: str) -> str:
    """'tensor(float16)' -> 'float16'; 'seq(tensor(float))' -> 'seq(float)'."""
    t = t.strip()
    m = re.fullmatch(r"tensor\((.+)\)", t)
    if m:
        return m.group(1)
    m = re.fullmatch(r"(seq|optional|sparse_tensor|map)\((.+)\)", t)
    if m:
        return "%s(%s)" % (m.group(1), norm_type(m.group(2)))
    return t


def is_fixed_type(type_str: str) -> bool:
    return "(" in type_str


def param_ref(type_str: str) -> str:
    """Schema/doc typeStr -> constraint letter or '=<fixed type>'."""
    type_str = type_str.strip()
    return "=" + norm_type(type_str) if is_fixed_type(type_str) else type_str


def read_ops(path: str | None) -> set[tuple[str, str]] | None:
    if not path:
        return None
    ops = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            domain, op = line.split()
            ops.add((norm_domain(domain), op))
    return ops


# --------------------------------------------------------------------------
# op schemas (variadic flags, positional type strings)
# --------------------------------------------------------------------------

def load_schemas():
    """{(domain, op): [(since_version, schema), ...] sorted} from onnxruntime."""
    from onnxruntime.capi import _pybind_state as C

    table: dict[tuple[str, str], list] = {}
    for s in C.get_all_operator_schema():
        table.setdefault((norm_domain(s.domain), s.name), []).append((s.since_version, s))
    for v in table.values():
        v.sort(key=lambda x: x[0])
    return table


def schema_for(schemas, domain: str, op: str, version: int):
    best = None
    for since, s in schemas.get((domain, op), []):
        if since <= version:
            best = s
    return best


def _is_variadic(param) -> bool:
    return "Variadic" in str(param.option)


def schema_signature(schema):
    ins = [param_ref(p.typeStr) for p in schema.inputs]
    outs = [param_ref(p.typeStr) for p in schema.outputs]
    var_in = bool(schema.inputs) and _is_variadic(schema.inputs[-1])
    var_out = bool(schema.outputs) and _is_variadic(schema.outputs[-1])
    return ins, outs, var_in, var_out


# --------------------------------------------------------------------------
# entries
# --------------------------------------------------------------------------

def make_entry(since, until, ins, outs, var_in, var_out, types):
    return {
        "since": since,
        "until": until,
        "inputs": list(ins),
        "outputs": list(outs),
        "variadic_last_input": bool(var_in),
        "variadic_last_output": bool(var_out),
        "types": {k: sorted(set(v)) for k, v in sorted(types.items())},
    }


def merge_exact(type_sets: list[dict[str, set]]) -> list[dict[str, set]]:
    """Merge registrations of one version range without widening them.

    Two registrations merge when they have the same constraint names and
    differ in at most one constraint's type set (the product of the merged
    sets is then exactly the union of the two products)."""
    items = [{k: set(v) for k, v in t.items()} for t in type_sets]
    changed = True
    while changed:
        changed = False
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                a, b = items[i], items[j]
                if a.keys() != b.keys():
                    continue
                diff = [k for k in a if a[k] != b[k]]
                if len(diff) <= 1:
                    for k in diff:
                        a[k] |= b[k]
                    del items[j]
                    changed = True
                    break
            if changed:
                break
    return items


def entry_sort_key(e):
    return (e["since"], INT_MAX if e["until"] is None else e["until"], json.dumps(e["types"], sort_keys=True))


# --------------------------------------------------------------------------
# from-docs
# --------------------------------------------------------------------------

SECTION_RE = re.compile(r"^##\s+Operators implemented by\s+(\S+)\s*$")
DOMAIN_RE = re.compile(r"\*\*Operator Domain:\*\*\s*\*([^*]+)\*")
PARAM_RE = re.compile(r"\*(in|out)\*\s*([^:<]*):\*\*([^*]+)\*\*")
TYPES_RE = re.compile(r"\*\*([^*]+)\*\*\s*=\s*(.*)")


def parse_versions(text: str):
    text = text.strip()
    m = re.fullmatch(r"(\d+)\+", text)
    if m:
        return int(m.group(1)), None
    m = re.fullmatch(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.fullmatch(r"(\d+)", text)
    if m:
        return int(m.group(1)), int(m.group(1))
    raise ValueError("unrecognised version cell: %r" % text)


def parse_params(cell: str):
    """Parameters cell -> list of alternative signatures (ins, outs, var_in, var_out).

    A name ending in '...' marks a variadic parameter."""
    alts = []
    for alt in re.split(r"<br>\s*<br>\s*or\s*<br>\s*<br>", cell):
        ins, outs = [], []
        for kind, name, type_str in PARAM_RE.findall(alt):
            (ins if kind == "in" else outs).append((param_ref(type_str), name.strip().endswith("...")))
        if ins or outs:
            alts.append(([r for r, _ in ins], [r for r, _ in outs],
                         bool(ins) and ins[-1][1], bool(outs) and outs[-1][1]))
    return alts


def letters(sig) -> set[str]:
    return {r for r in sig[0] + sig[1] if not r.startswith("=")}


STANDARD_DOMAINS = {"ai.onnx", "ai.onnx.ml"}


def choose_signature(alts, schema_sig, row_letters: set[str], prefer_schema: bool):
    """Pick the positional signature for one docs row.

    The docs list the signatures of several schema versions ("or") without
    saying which row each belongs to.  Standard ONNX domains version their
    schemas, so the installed onnxruntime's schema for the row's
    since-version is exact and is used when present.  Contrib schemas change
    between releases without a version bump, so there the docs win: the
    alternative whose constraint letters all appear in the row's Types cell,
    covering most of them, then the longest; the schema is the fallback."""
    if prefer_schema and schema_sig is not None:
        return schema_sig
    if not alts:
        return schema_sig if schema_sig is not None else ([], [], False, False)

    def score(sig):
        ls = letters(sig)
        return (ls <= row_letters, len(ls & row_letters), len(sig[0]) + len(sig[1]))

    ins, outs, var_in, var_out = max(alts, key=score)
    if schema_sig is not None:
        # the docs mark variadics inconsistently; trust the schema where it lines up
        if len(schema_sig[0]) == len(ins):
            var_in = schema_sig[2]
        if len(schema_sig[1]) == len(outs):
            var_out = schema_sig[3]
    return ins, outs, var_in, var_out


def parse_types(cell: str) -> dict[str, list[str]]:
    types: dict[str, list[str]] = {}
    for part in re.split(r"<br\s*/?>", cell):
        part = part.strip()
        if not part:
            continue
        m = TYPES_RE.match(part)
        if not m:
            raise ValueError("unrecognised types cell part: %r" % part)
        # split on commas that are not inside parentheses
        names, depth, cur = [], 0, ""
        for ch in m.group(2):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            if ch == "," and depth == 0:
                names.append(cur)
                cur = ""
            else:
                cur += ch
        names.append(cur)
        types[m.group(1).strip()] = sorted({norm_type(n) for n in names if n.strip()})
    return types


def parse_docs(path: str, provider: str):
    """-> {(domain, op): [(since, until, alternative signatures, types), ...]}"""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows: dict[tuple[str, str], list] = {}
    in_section = False
    found = False
    domain = None
    op = None
    alts = []
    for line in lines:
        m = SECTION_RE.match(line.strip())
        if m:
            in_section = m.group(1) == provider
            found = found or in_section
            domain = op = None
            continue
        if not in_section or not line.startswith("|"):
            continue
        dm = DOMAIN_RE.search(line)
        if dm:
            domain = norm_domain(dm.group(1).strip())
            continue
        row = line.strip()
        cells = row[1:-1].split("|") if row.endswith("|") else row[1:].split("|")
        if len(cells) < 4 or cells[0].strip().startswith("---"):
            continue
        if cells[0].strip() == "Op Name":
            continue
        name, params, versions, types = (c.strip() for c in cells[:4])
        if name:
            op = name
            alts = parse_params(params)
        if op is None or domain is None or not versions:
            continue
        since, until = parse_versions(versions)
        rows.setdefault((domain, op), []).append((since, until, alts, parse_types(types)))
    if not found:
        raise SystemExit("no section 'Operators implemented by %s' in %s" % (provider, path))
    return rows


def build_from_docs(args):
    ops = read_ops(args.ops)
    try:
        schemas = load_schemas()
    except Exception as e:  # onnxruntime missing: variadic flags unknown
        print("warning: no onnxruntime schemas (%s); variadic flags set to false" % e, file=sys.stderr)
        schemas = {}
    kernels = {}
    for (domain, op), regs in parse_docs(args.docs, args.provider).items():
        if ops is not None and (domain, op) not in ops:
            continue
        entries = []
        for since, until, alts, types in regs:
            s = schema_for(schemas, domain, op, since)
            # a standard-domain schema is exact only for its own since-version
            # (the docs may describe a newer onnxruntime than the installed one)
            exact = s is not None and s.since_version == since
            ins, outs, var_in, var_out = choose_signature(
                alts, schema_signature(s) if s is not None else None, set(types),
                prefer_schema=domain in STANDARD_DOMAINS and exact)
            entries.append(make_entry(since, until, ins, outs, var_in, var_out, types))
        kernels["%s::%s" % (domain, op)] = sorted(entries, key=entry_sort_key)
    return {
        "provider": args.provider,
        "onnxruntime": args.ort_version,
        "source": args.source or "docs/OperatorKernels.md (%s)" % args.docs,
        "kernels": kernels,
    }


# --------------------------------------------------------------------------
# from-installed
# --------------------------------------------------------------------------

def build_from_installed(args):
    import onnxruntime
    from onnxruntime.capi import _pybind_state as C

    ops = read_ops(args.ops)
    schemas = load_schemas()
    groups: dict[tuple, list[dict[str, set]]] = {}
    for k in C.get_all_opkernel_def():
        if k.provider != args.provider:
            continue
        domain = norm_domain(k.domain)
        if ops is not None and (domain, k.op_name) not in ops:
            continue
        start, end = k.version_range
        until = None if end >= INT_MAX else end
        tc = {name: {norm_type(t) for t in ts} for name, ts in k.type_constraints.items()}
        groups.setdefault((domain, k.op_name, start, until), []).append(tc)
    if not groups and ops is None:
        raise SystemExit("no kernels registered for provider %s in this onnxruntime" % args.provider)

    kernels: dict[str, list] = {}
    for (domain, op, since, until), tcs in groups.items():
        s = schema_for(schemas, domain, op, since)
        if s is not None:
            ins, outs, var_in, var_out = schema_signature(s)
        else:
            ins, outs, var_in, var_out = [], [], False, False
        for types in merge_exact(tcs):
            kernels.setdefault("%s::%s" % (domain, op), []).append(
                make_entry(since, until, ins, outs, var_in, var_out, types))
    for v in kernels.values():
        v.sort(key=entry_sort_key)
    build = ""
    try:
        build = onnxruntime.get_build_info()
    except Exception:
        pass
    source = args.source or "kernel registry of the installed onnxruntime %s (get_all_opkernel_def)%s" % (
        onnxruntime.__version__, "; " + build if build else "")
    return {
        "provider": args.provider,
        "onnxruntime": onnxruntime.__version__,
        "source": source,
        "kernels": kernels,
    }


# --------------------------------------------------------------------------

def dump(table, path):
    """Sorted keys; one line per op so diffs stay readable."""
    kernels = table["kernels"]
    head = {k: v for k, v in table.items() if k != "kernels"}
    out = ["{"]
    items = []
    for key in sorted(head):
        items.append("%s: %s" % (json.dumps(key), json.dumps(head[key], ensure_ascii=False)))
    body = ",\n".join(
        "  %s: %s" % (json.dumps(k), json.dumps(kernels[k], sort_keys=True, separators=(",", ":")))
        for k in sorted(kernels))
    # "kernels" sorts first among the top-level keys
    out.append('"kernels": {\n%s\n},' % body)
    out.append(",\n".join(items))
    out.append("}")
    text = "\n".join(out) + "\n"
    json.loads(text)  # sanity check
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)

    d = sub.add_parser("from-docs", help="parse docs/OperatorKernels.md")
    d.add_argument("docs", help="path to OperatorKernels.md")
    d.add_argument("--provider", required=True, help="e.g. CUDAExecutionProvider, DmlExecutionProvider")
    d.add_argument("--ort-version", required=True, help="onnxruntime version the docs describe")
    d.add_argument("--source", default="", help="provenance text stored in the file")
    d.add_argument("--ops", help="ops file: 'domain op_type' per line")
    d.add_argument("--out", default="-")

    i = sub.add_parser("from-installed", help="read the installed onnxruntime's kernel registry")
    i.add_argument("--provider", default="CPUExecutionProvider")
    i.add_argument("--source", default="", help="provenance text (default: version and build info)")
    i.add_argument("--ops", help="ops file: 'domain op_type' per line")
    i.add_argument("--out", default="-")

    args = p.parse_args(argv)
    table = build_from_docs(args) if args.mode == "from-docs" else build_from_installed(args)
    dump(table, args.out)
    if args.out != "-":
        print("%s: %d ops, %d entries" % (args.out, len(table["kernels"]),
                                          sum(len(v) for v in table["kernels"].values())), file=sys.stderr)


if __name__ == "__main__":
    main()
