"""Session fixtures: tiny random-weight HF folders and the bundles exported from them.

Building every folder takes a few seconds and each fp32 export a second or two, so they are
made once per session and shared (read-only: tests that alter a bundle copy it first).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Two cores shared with other jobs: keep torch and ONNX Runtime from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


FAMILIES = ("qwen", "smollm2", "gemma3")  # test_real_weights.py's tests go to workers by the model they load
# Under README's -n 2 --dist loadscope: a file the controller names, into which each worker writes
# the node ids of the real-weight tests it collected (the controller collects nothing itself).
REAL_IDS = "EDGE_SPEC_XDIST_REAL_IDS"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("dist", None) == "loadscope":
        fd, path = tempfile.mkstemp(prefix="edge-spec-real-ids-")
        os.close(fd)
        os.environ[REAL_IDS] = path  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    path = os.environ.get(REAL_IDS)
    if path and not hasattr(config, "workerinput"):
        del os.environ[REAL_IDS]
        for written in Path(path).parent.glob(Path(path).name + "*"):
            written.unlink(missing_ok=True)


# -- tiers: one marker per test, one axis (README.md "Tests", docs/testing.md) -------------------------
#
#   unit          no model files, no export, no torch or transformers: fast
#   law           statistical tests of the sampling law (thousands of samples): marked by hand
#   export        tiny random-weight models built or exported (torch, transformers): derived here
#   real_weights  the official model files: marked by hand
TIERS = ("unit", "law", "export", "real_weights")
TESTS_DIR = Path(__file__).resolve().parent
# What building a model or a bundle touches: torch and transformers (imports or global names) and
# the exporter's entry point. Functions of tests/ (tiny.py, real.py, the test modules, this file)
# that a test calls are followed, so tiny.make_llama or tiny.export count and tiny.PROMPT does not.
BUILDS = {"torch", "transformers", "export_bundle"}


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _builds_in(obj, why: list[str], memo: dict) -> bool:
    """Whether obj (a function, or a class of tests/) names torch, transformers or export_bundle,
    itself or through the functions and classes of tests/ that it names; why gets the path."""
    if isinstance(obj, type):
        return any(_builds_in(value, why, memo) for value in vars(obj).values()
                   if isinstance(value, (types.FunctionType, staticmethod, classmethod, property)))
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return any(_builds_in(f, why, memo) for f in (obj.fget, obj.fset) if f is not None)
    obj = inspect.unwrap(obj)
    code = getattr(obj, "__code__", None)
    if code is None or not code.co_filename.startswith(str(TESTS_DIR)):
        return False  # only tests/'s own code is read: the runtime and exporter are what is tested
    if code in memo:
        return memo[code] is not None and (why.append(memo[code]) or True)
    memo[code] = None  # a cycle answers "no" while it is being read
    scope = getattr(obj, "__globals__", {})
    for inner in _code_objects(code):
        names = set(inner.co_names)
        found = sorted(names & BUILDS)
        if found:
            memo[code] = f"{obj.__qualname__} names {', '.join(found)}"
            break
        for name in names:
            value = scope.get(name)
            if value is None and (TESTS_DIR / f"{name}.py").is_file():  # a module of tests/ imported inside a function
                value = sys.modules.get(name) or importlib.import_module(name)
            # a function or class of tests/, or one reached as an attribute of a module of tests/ (tiny.export)
            targets = [value] if isinstance(value, (types.FunctionType, type)) else []
            if isinstance(value, types.ModuleType) and str(getattr(value, "__file__", "")).startswith(str(TESTS_DIR)):
                targets = [getattr(value, attr) for attr in names if isinstance(getattr(value, attr, None), (types.FunctionType, type))]
            for target in targets:
                path: list[str] = []
                if target is not obj and _builds_in(target, path, memo):
                    memo[code] = f"{obj.__qualname__} -> {path[0]}"
                    break
            if memo[code] is not None:
                break
        if memo[code] is not None:
            break
    if memo[code] is None:
        return False
    why.append(memo[code])
    return True


def export_reason(item, memo: dict) -> str | None:
    """Why item builds tiny models or exports bundles, or None: its fixtures (pytest's closure,
    the session fixtures of this file and every test module's own, like test_layer_subset.py's
    `folders`), the test function and the functions it is parametrized with, each read as code
    (_builds_in). Reading code rather than listing fixtures or node ids keeps a new test that calls
    tiny.export, imports torch or asks for a new model-building fixture out of the unit tier
    without anyone updating a list; a module-level `import tiny` alone would move fast tests of
    the same file (spec parsing, kernel emulations) with them."""
    fixturenames = getattr(item, "fixturenames", ())
    if "tiny_models" in fixturenames:
        return "uses the tiny_models fixture"
    candidates = [getattr(item, "function", None)]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    candidates += [fixturedef.func for name in fixturenames for fixturedef in defs.get(name, ())]
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        candidates += [value for value in callspec.params.values() if isinstance(value, types.FunctionType)]
    for candidate in candidates:
        why: list[str] = []
        if candidate is not None and _builds_in(candidate, why, memo):
            return why[0]
    return None


def assign_tiers(items) -> list[str]:
    """Every test gets exactly one tier marker: law and real_weights as written, export where
    export_reason finds one, unit otherwise. Returns the tests that are marked with two tiers, or
    marked unit while they build models, each with why."""
    memo: dict = {}
    offenders = []
    for item in items:
        marked = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        reason = export_reason(item, memo) if not marked or marked == ["unit"] else None
        if len(marked) > 1:
            offenders.append(f"{item.nodeid}: marked {' and '.join(marked)}")
        elif marked == ["unit"] and reason:
            offenders.append(f"{item.nodeid}: marked unit, but {reason}")
        elif not marked:
            item.add_marker("export" if reason else "unit")
    return offenders


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the tiers given here
def pytest_collection_modifyitems(session, config, items):
    """Every test gets its tier (assign_tiers), or collection fails naming the tests marked with
    two, or with unit while they build models. Tests on real weights run last: the bundles they need are exported in the
    background while the other tests run (pytest_collection_finish)."""
    offenders = assign_tiers(items)
    if offenders:
        # A failed collection report, not an exception, so that pytest-xdist's workers pass it on
        # to the controller, which prints it and fails the run; without -n pytest stops before
        # running anything ("1 error during collection").
        message = (f"every test needs exactly one tier marker of {', '.join(TIERS)} (tests/conftest.py, "
                   "docs/testing.md):\n  " + "\n  ".join(offenders))
        where = Path(__file__).resolve().relative_to(config.rootpath).as_posix()
        session.ihook.pytest_collectreport(report=pytest.CollectReport(where, "failed", message, []))
    real_items = [item for item in items if item.get_closest_marker("real_weights")]
    items[:] = [item for item in items if not item.get_closest_marker("real_weights")] + real_items
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(REAL_IDS):
        Path(f"{os.environ[REAL_IDS]}.{worker}").write_text("\n".join(item.nodeid for item in real_items))


def scope_of(nodeid: str, real: set[str]) -> str:
    """What one pytest-xdist worker runs together, in order: a file's other tests (its module
    fixtures are made once), apart from its real-weight tests (`real`), which wait for their
    bundles and go last; test_real_weights.py's by model family, so the longest file is not one
    worker's tail."""
    path, _, name = nodeid.partition("::")
    if nodeid not in real:
        return path
    if path.endswith("test_real_weights.py"):
        return f"{path}::{next((f for f in FAMILIES if f in name), 'other')}"
    return f"{path}::real"


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """README's test command (-n 2 --dist loadscope) schedules by scope_of, in collection order
    (real weights last). xdist's own loadgroup marks do not reach pytest 9's node ids, and its
    loadscope would group a file's unit and real-weight tests and reorder scopes by size."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    written = Path(os.environ[REAL_IDS])

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "_real"):  # every worker has collected (and written) by the time scopes are split
                files = sorted(written.parent.glob(written.name + ".*"))
                self._real = set(files[0].read_text().split("\n")) if files else set()
            return scope_of(nodeid, self._real)

    config.option.loadscopereorder = False
    return ByScope(config, log)


def pytest_collection_finish(session):
    """After deselection (-m, -k): only a session that will run real-weight tests exports."""
    if any(item.get_closest_marker("real_weights") for item in session.items):
        import real

        real.start_exports()


def pytest_sessionfinish(session, exitstatus):
    import real

    real.stop_exports(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop)


@dataclass(frozen=True)
class TinyModels:
    root: Path
    llama: Path  # target: llama3 rope, GQA, tied embeddings, 4 layers
    qwen2: Path  # target: q/k/v biases, GQA, untied, 3 layers
    llama_quant: Path  # untied llama with gentler weights (quantization noise grows less)
    draft: Path  # 2-layer llama, same tokenizer
    draft_padded: Path  # 2-layer llama, same tokenizer, LM head padded by 64 rows
    draft_other_vocab: Path  # 2-layer llama with another tokenizer
    gemma2: Path  # config + tokenizer only (unsupported architecture)
    gpt2: Path  # config + tokenizer only (unsupported architecture)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    import torch

    torch.set_num_threads(1)
    import tiny

    root = tmp_path_factory.mktemp("tiny_models")
    tok = tiny.make_tokenizer("a")
    other = tiny.make_tokenizer("b")
    return TinyModels(
        root=root,
        llama=tiny.make_llama(root / "llama", tok, n_layers=4, seed=0),
        qwen2=tiny.make_qwen2(root / "qwen2", tok, n_layers=3, seed=1),
        llama_quant=tiny.make_llama(root / "llama_quant", tok, n_layers=4, seed=3, weight_scale=0.5, tie=False),
        draft=tiny.make_llama(root / "draft", tok, n_layers=2, seed=5),
        draft_padded=tiny.make_llama(root / "draft_padded", tok, n_layers=2, extra_rows=64, seed=7),
        draft_other_vocab=tiny.make_llama(root / "draft_other", other, n_layers=2, seed=8),
        gemma2=tiny.make_unsupported(root / "gemma2", tok, "gemma2"),
        gpt2=tiny.make_unsupported(root / "gpt2", tok, "gpt2"),
    )


def _export(tmp_path_factory, name, model, **kwargs) -> Path:
    import tiny

    out = tmp_path_factory.mktemp("bundles") / name
    tiny.export(model, out, **kwargs)
    return out


@pytest.fixture(scope="session")
def llama_bundle(tmp_path_factory, tiny_models) -> Path:
    """fp32 llama target with a draft model and a layer-skip draft (1 of 4 layers)."""
    return _export(tmp_path_factory, "llama-fp32", tiny_models.llama, drafts=(str(tiny_models.draft), "layer-skip:1"))


@pytest.fixture(scope="session")
def llama_gpu_bundle(tmp_path_factory, tiny_models) -> Path:
    """llama_bundle's roles exported for --device cuda (float16 weights, activations and KV), which
    CUDA and DirectML can place node for node: the fake GPU sessions open it."""
    return _export(tmp_path_factory, "llama-cuda", tiny_models.llama, quant="fp16", drafts=(str(tiny_models.draft), "layer-skip:1"), device="cuda")


@pytest.fixture(scope="session")
def qwen2_bundle(tmp_path_factory, tiny_models) -> Path:
    """fp32 qwen2 target with the (llama, same tokenizer) draft and a layer-skip draft."""
    return _export(tmp_path_factory, "qwen2-fp32", tiny_models.qwen2, drafts=(str(tiny_models.draft), "layer-skip:2"))


@pytest.fixture(scope="session")
def portable_bundle(tmp_path_factory, tiny_models) -> Path:
    """The llama bundle of llama_bundle with portable attention (standard ops, new KV rows out)."""
    return _export(tmp_path_factory, "llama-portable", tiny_models.llama, drafts=(str(tiny_models.draft), "layer-skip:1"), attention="portable")


@pytest.fixture(scope="session")
def bundles(llama_bundle, qwen2_bundle) -> dict[str, Path]:
    return {"llama": llama_bundle, "qwen2": qwen2_bundle}


@pytest.fixture(scope="session")
def hf_models(tiny_models) -> dict:
    """transformers (model, tokenizer) for each target folder, float32, eval mode."""
    import tiny

    return {"llama": tiny.load_hf(tiny_models.llama), "qwen2": tiny.load_hf(tiny_models.qwen2)}


@pytest.fixture(scope="session")
def quant_bundles(tmp_path_factory, tiny_models) -> dict[str, Path]:
    """fp32, int8 and int4 bundles (target only) of the gentler llama, for smoke tests."""
    return {q: _export(tmp_path_factory, f"llama-{q}", tiny_models.llama_quant, quant=q) for q in ("fp32", "int8", "int4")}


# --device dml bundles of the tiny qwen2 (layer-skip draft): today's int4 and fp16 graphs, and the
# int4 graphs as the profile wrote them before the kernel facts (tests/test_device_profiles.py,
# tests/test_provider_emulation.py).
@pytest.fixture(scope="session")
def dml_bundle(tmp_path_factory, tiny_models) -> Path:
    return _dml_export(tmp_path_factory, tiny_models, "qwen2-int4-dml", "int4")


@pytest.fixture(scope="session")
def dml_fp16_bundle(tmp_path_factory, tiny_models) -> Path:
    return _dml_export(tmp_path_factory, tiny_models, "qwen2-fp16-dml", "fp16")


@pytest.fixture(scope="session")
def old_dml_bundle(tmp_path_factory, tiny_models) -> Path:
    """Fused GroupQueryAttention (rotary inside) and 3-input MatMulNBits."""
    import tiny

    with tiny.old_dml_profile():
        return _dml_export(tmp_path_factory, tiny_models, "qwen2-int4-dml-fused", "int4")


def _dml_export(tmp_path_factory, tiny_models, name: str, quant: str) -> Path:
    import tiny

    out = tmp_path_factory.mktemp("dml_bundle") / name
    tiny.export(tiny_models.qwen2, out, quant=quant, drafts=("layer-skip:1",), attention=None, device="dml")
    return out
