"""The documents stay a usable entry point and name only what exists.

README.md is the entry point (short, the two set-up commands first, the test command the one CI
runs); docs/ is the manual. Links, command-line flags and repository paths written in them must
exist, so that a renamed flag or a moved file fails here instead of misleading a reader.

Fast, no models: reads files only.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200
SETUP_WITHIN_LINES = 40

# Where a flag written in a document must occur: the sources of the commands the documents describe.
SOURCE_DIRS = ("edge_spec", "export", "runtime", "benchmarks", "android_bridge/tools")

# Flags of other tools that the documents quote, each with why it is not ours.
OTHER_TOOLS_FLAGS = {
    "--dist": "pytest-xdist's scheduling option in the test command",
    "--durations": "pytest's slowest-tests report, set by .ci/run",
    "--kl-divergence": "llama.cpp's llama-perplexity option, the KL reference's command",
}

# Repository paths and dotted module names are checked under these top-level folders.
CHECKED_ROOTS = ("edge_spec", "export", "runtime", "benchmarks", "tests")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
PATH = re.compile(r"(?<![\w./-])(?:%s)/[\w./-]*" % "|".join(CHECKED_ROOTS))
DOTTED = re.compile(r"(?<![\w./-])(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(CHECKED_ROOTS))


def _documents() -> dict[str, str]:
    paths = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "android_bridge" / "README.md"]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths if p.is_file()}


def _code(text: str) -> list[str]:
    """The text of fenced blocks and inline code spans: where flags and paths are written."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + SPAN.findall(prose)


def _bash_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line inside a ```bash block."""
    out, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            inside = (not inside) and line.strip() == "```bash"
            continue
        if inside:
            out.append((number, line))
    return out


def _setup_commands() -> tuple[tuple[int, str] | None, tuple[int, str] | None]:
    main = tests = None
    for number, line in _bash_lines(README.read_text(encoding="utf-8")):
        if line.startswith("python3 -m venv .venv && ") and "python -m export " in line and main is None:
            main = (number, line)
        elif line.startswith("python3 -m venv .venv && ") and "python -m pytest " in line and tests is None:
            tests = (number, line)
    return main, tests


def test_readme_is_short_and_starts_with_the_two_setup_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, over {MAX_README_LINES}: move reference text into docs/"
    )
    main, tests = _setup_commands()
    assert main is not None, "README.md has no one-line ```bash main-job command (venv, pip install, python -m export, ...)"
    assert tests is not None, "README.md has no one-line ```bash test command (venv, pip install, python -m pytest ...)"
    late = [f"line {n}" for n, _ in (main, tests) if n > SETUP_WITHIN_LINES]
    assert not late, f"the set-up commands must come within README.md's first {SETUP_WITHIN_LINES} lines: {late}"
    assert main[0] < tests[0], "the main-job command comes before the test command"
    assert "python -m runtime generate" in main[1], "the main-job command ends by generating"


def _ci_commands() -> tuple[str, list[str]]:
    """.ci/run's pip install extras and its pytest arguments (PYTEST_ADDOPTS=... prefix allowed)."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install = [ln for ln in text.splitlines() if re.search(r"pip install .*-e \"\.\[", ln)]
    pytest_lines = [ln for ln in text.splitlines()
                    if re.match(r"^\s*(?:[A-Z_]+=\S+\s+)*python -m pytest .*\btests\s*$", ln)]
    assert len(install) == 1, f".ci/run: expected one `pip install -e \".[...]\"` line, found {install}"
    assert len(pytest_lines) == 1, f".ci/run: expected one `python -m pytest ... tests` line, found {pytest_lines}"
    extras = re.search(r"-e \"\.\[([^\]]*)\]\"", install[0]).group(1)
    words = shlex.split(pytest_lines[0])
    return extras, words[words.index("pytest") + 1:]


def test_readme_test_command_is_what_ci_runs():
    """A newcomer who runs README's test command runs what CI runs: same extras, same pytest
    arguments (CI only adds PYTEST_ADDOPTS, which reports and does not select)."""
    ci_extras, ci_args = _ci_commands()
    _, tests = _setup_commands()
    assert tests is not None
    command = tests[1]
    readme_extras = re.search(r"pip install -e \"\.\[([^\]]*)\]\"", command)
    assert readme_extras, f"README's test command installs no extras: {command}"
    assert set(readme_extras.group(1).split(",")) == set(ci_extras.split(",")), (
        f"README installs .[{readme_extras.group(1)}], .ci/run installs .[{ci_extras}]"
    )
    words = shlex.split(command.split("python -m pytest", 1)[1])
    assert words == ci_args, f"README runs pytest {words}, .ci/run runs pytest {ci_args}"
    assert ci_args == ["-q", "-n", "2", "--dist", "loadscope", "tests"], ci_args


def test_relative_links_point_to_files_that_exist():
    missing = []
    for name, text in _documents().items():
        base = (ROOT / name).parent
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s), mailto: not ours to check; pure anchors: within the page
            path = target.split("#", 1)[0]
            if not (base / path).exists():
                missing.append(f"{name}: ({target})")
    assert not missing, f"{len(missing)} relative links point nowhere:\n" + "\n".join(missing)


def test_no_link_into_a_section_of_benchmarks_md():
    """BENCHMARKS.md's dated sections move (to benchmarks/notes/): link the file, quote the
    section title in words."""
    anchored = [f"{name}: ({target})" for name, text in _documents().items()
                for target in LINK.findall(text) if re.search(r"BENCHMARKS\.md#", target)]
    assert not anchored, "links into BENCHMARKS.md's sections:\n" + "\n".join(anchored)


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_anchors_into_readme_and_docs_name_a_heading():
    """Links to a section of README.md or docs/ (moved text leaves these behind)."""
    docs = _documents()
    broken = []
    for name, text in docs.items():
        base = (ROOT / name).parent
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            page = (base / path).resolve() if path else (ROOT / name).resolve()
            try:
                rel = str(page.relative_to(ROOT))
            except ValueError:
                continue
            if rel in docs and anchor not in _anchors(docs[rel]):
                broken.append(f"{name}: ({target})")
    assert not broken, f"{len(broken)} links name no heading of their page:\n" + "\n".join(broken)


def _source_text() -> str:
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                     for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")))
    return text + "\n" + " ".join(_generated_flags())


def _generated_flags() -> list[str]:
    """The request-setting flags runtime/__main__.py generates (`_request_args(parser, "top_k")`
    adds --top-k, unless the setting's Param names its own `cli=` flag), which occur nowhere
    literally."""
    main = (ROOT / "runtime" / "__main__.py").read_text(encoding="utf-8")
    own_cli = set(re.findall(r"^\s*(\w+):[^\n]*\bcli=\"--", (ROOT / "runtime" / "requests.py").read_text(encoding="utf-8"), re.M))
    names = {name for call in re.findall(r"_request_args\(\w+,([^)]*)\)", main)
             for name in re.findall(r"(?<![\w=])\"(\w+)\"", call)}
    return sorted("--" + name.replace("_", "-") for name in names - own_cli)


def test_every_flag_in_the_documents_exists_in_the_sources():
    source = _source_text()
    unknown: dict[str, list[str]] = {}
    for name, text in _documents().items():
        if name.startswith("android_bridge/"):
            continue  # the Android page documents its own tools; README and docs/ are checked here
        for code in _code(text):
            for flag in FLAG.findall(code):
                if flag in OTHER_TOOLS_FLAGS:
                    continue
                if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", source):
                    unknown.setdefault(flag, []).append(name)
    assert not unknown, (
        f"{len(unknown)} flags in the documents occur in no Python source under {', '.join(SOURCE_DIRS)} "
        "(renamed or removed? another tool's? then add it to OTHER_TOOLS_FLAGS with why):\n"
        + "\n".join(f"{flag}: {', '.join(sorted(set(where)))}" for flag, where in sorted(unknown.items()))
    )


def _module_file(parts: list[str]) -> Path | None:
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def test_every_repository_path_and_module_named_exists():
    missing: dict[str, list[str]] = {}
    for name, text in _documents().items():
        if name.startswith("android_bridge/"):
            continue  # its paths are relative to android_bridge/ as often as to the root
        for code in _code(text):
            for raw in PATH.findall(code):
                path = raw.rstrip(".,;:")
                if not (ROOT / path).exists() and not (ROOT / (path + ".py")).is_file():  # runtime/loop: the module
                    missing.setdefault(path, []).append(name)
            for dotted in DOTTED.findall(code):
                parts = dotted.split(".")
                # the longest prefix that is a module or package, then the first name read from it
                for cut in range(len(parts), 0, -1):
                    module = _module_file(parts[:cut])
                    if module is not None:
                        break
                if module is None or cut < len(parts) and not _defines(module, parts[cut]):
                    missing.setdefault(dotted, []).append(name)
    assert not missing, (
        f"{len(missing)} repository paths or modules named in the documents do not exist:\n"
        + "\n".join(f"{p}: {', '.join(sorted(set(where)))}" for p, where in sorted(missing.items()))
    )


def _defines(module: Path, name: str) -> bool:
    """The name occurs as a word in the module (defined, imported or assigned there)."""
    return re.search(r"\b" + re.escape(name) + r"\b", module.read_text(encoding="utf-8")) is not None
