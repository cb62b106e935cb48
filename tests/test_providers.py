"""Execution providers per role: selection, errors, fallback, and the options each provider's
session is built with. The CPU runs for real; CUDA, DirectML and Core ML are faked as
available (and ort.InferenceSession replaced by a recorder), since this machine has none of
them: construction is checked up to the ONNX Runtime call, execution only on the CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from edge_spec.manifest import BundleError
from runtime import sessions
from runtime.bundle import open_bundle
from runtime.engine import Engine, EngineConfig, GenerateConfig
from runtime.sessions import Device, ProviderError, SessionConfig, resolve_provider, session_device, session_provider

ROOT = Path(__file__).resolve().parent.parent
CPU, CUDA, DML, COREML = "CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "CoreMLExecutionProvider"


class FakeSession:
    """Records what ort.InferenceSession was asked for; registers the providers it was given
    unless one of them is in `fail` (then it raises, as ORT does when an EP cannot start)."""

    created: list["FakeSession"] = []
    fail: set[str] = set()

    def __init__(self, path, sess_options=None, providers=None, provider_options=None, **kwargs):
        if self.fail & set(providers):
            raise RuntimeError(f"fake: {sorted(self.fail & set(providers))[0]} cannot start\nsecond line")
        self.path = Path(path)
        self.options = sess_options
        self.providers = list(providers)
        self.provider_options = [dict(o) for o in provider_options]
        self.kwargs = kwargs
        FakeSession.created.append(self)

    def get_providers(self):
        return self.providers

    def get_provider_options(self):
        return dict(zip(self.providers, self.provider_options))


@pytest.fixture
def fake_ort(monkeypatch):
    """fake_ort(*available): pretend this onnxruntime build lists `available` providers."""
    FakeSession.created, FakeSession.fail = [], set()
    monkeypatch.setattr(sessions.ort, "InferenceSession", FakeSession)

    def set_available(*names):
        monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: list(names))
        return FakeSession

    return set_available


def _engine(bundle, **config) -> Engine:
    return Engine(bundle, EngineConfig(threads=1, calibrate=False, **config))


def _files(bundle, role: str) -> set[str]:
    manifest = open_bundle(bundle, check_hashes=False).manifest
    return {manifest.stages[key].file for key in manifest.models[role].stages}


def _by_file(fake) -> dict[str, FakeSession]:
    return {s.path.name: s for s in fake.created}


# -- the CPU, for real --------------------------------------------------------------------------


def test_cpu_runs_for_real(llama_bundle):
    engine = _engine(llama_bundle, provider="cpu", draft_provider="cpu", drafter="model")
    ids = engine.encode(prompt="the cat sat on the mat")
    speculative = engine.generate(ids, GenerateConfig(max_new_tokens=5))
    plain = engine.generate(ids, GenerateConfig(max_new_tokens=5), speculative=False)
    assert 1 <= len(speculative.token_ids) <= 5
    assert speculative.token_ids == plain.token_ids  # greedy: speculation changes nothing
    assert speculative.stats["drafted_tokens"] > 0  # the draft model's sessions really ran
    assert len(engine.loader.sessions) == len(_files(llama_bundle, "target") | _files(llama_bundle, "draft"))
    for session in engine.loader.sessions.values():
        assert session.get_providers() == [CPU]
        assert session_provider(session) == "cpu" and session_device(session) == Device("cpu", 0)
    report = engine.provider_report()
    assert report["target"]["provider"] == report["draft"]["provider"] == "cpu"
    assert report["target"]["requested"] == "cpu" and report["target"]["fallback_from"] is None
    assert engine.provider_line() == f"provider: cpu (requested; available: {', '.join(ort.get_available_providers())})"


# -- choosing a provider --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "available, expected",
    [
        ((CUDA, DML, COREML, CPU), "cuda"),
        ((COREML, DML, CPU), "dml"),  # the documented order, not the build's listing order
        ((COREML, CPU), "coreml"),
        (("AzureExecutionProvider", CPU), "cpu"),
    ],
)
def test_auto_order(fake_ort, available, expected):
    fake_ort(*available)
    choice = resolve_provider("auto")
    assert choice.provider == expected and choice.requested == "auto" and choice.fallback_from is None
    assert choice.describe() == f"{expected} (auto; available: {', '.join(available)})"


@pytest.mark.parametrize(
    "provider, package",
    [("cuda", "onnxruntime-gpu"), ("dml", "onnxruntime-directml"), ("coreml", "macOS")],
)
def test_unavailable_provider_names_what_to_install(fake_ort, provider, package):
    fake_ort("AzureExecutionProvider", CPU)
    with pytest.raises(ProviderError) as err:
        resolve_provider(provider)
    message = str(err.value)
    assert f"provider {provider!r} ({sessions.PROVIDERS[provider].ort_name}) is not available" in message
    assert package in message and "--allow-fallback" in message
    assert f"installed: {', '.join(sessions.installed_runtimes())}" in message
    assert sessions.installed_runtimes(), "the onnxruntime running this test is installed"
    assert f"available: AzureExecutionProvider, {CPU}" in message


def test_unknown_provider(fake_ort):
    fake_ort(CPU)
    with pytest.raises(ProviderError, match="unknown provider 'tpu'"):
        resolve_provider("tpu")


def test_allow_fallback_runs_on_cpu_and_says_so(fake_ort, llama_bundle):
    fake = fake_ort(CPU)
    engine = _engine(llama_bundle, provider="cuda", allow_fallback=True, drafter="none")
    assert engine.provider == "cpu"
    assert {s.providers[0] for s in fake.created} == {CPU}
    report = engine.provider_report()["target"]
    assert (report["provider"], report["requested"], report["fallback_from"]) == ("cpu", "cuda", "cuda")
    assert engine.provider_line().startswith(f"provider: cpu (fell back from cuda: {CUDA} is not in this ONNX Runtime build; ")


# -- per-role providers and each provider's options ---------------------------------------------------


# Two accelerators, one per role: Core ML, not DirectML, beside CUDA, since DirectML's
# GroupQueryAttention would skip the cuda graphs' rotary and the loader refuses them there.
@pytest.mark.parametrize("target, draft", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "coreml")])
def test_draft_provider_per_role(fake_ort, llama_gpu_bundle, target, draft):
    fake = fake_ort(CUDA, DML, CPU, COREML)
    engine = _engine(llama_gpu_bundle, provider=target, draft_provider=draft, drafter="model")
    target_files, draft_files = _files(llama_gpu_bundle, "target"), _files(llama_gpu_bundle, "draft")
    by_file = _by_file(fake)
    assert set(by_file) == target_files | draft_files  # each stage graph opened once
    for name in target_files:
        assert session_provider(by_file[name]) == target
    for name in draft_files:
        assert session_provider(by_file[name]) == draft
    assert (engine.provider, engine.draft_provider) == (target, draft)
    assert engine.provider_line() == (
        f"provider: {target} (requested; available: {CUDA}, {DML}, {CPU}, {COREML}); "
        f"draft provider: {draft} (requested; available: {CUDA}, {DML}, {CPU}, {COREML})"
    )


def test_layer_skip_draft_runs_on_the_target_provider(fake_ort, llama_gpu_bundle):
    fake = fake_ort(CUDA, CPU)
    engine = _engine(llama_gpu_bundle, provider="cuda", draft_provider="cpu", drafter="layer-skip")
    assert {s.providers[0] for s in fake.created} == {CUDA}  # its sessions are the target's
    assert not _files(llama_gpu_bundle, "draft") & set(_by_file(fake))  # the draft model is not loaded
    assert engine.drafter.runner.sessions[0] is engine.target.sessions[0]


def test_cuda_device_id(fake_ort, llama_gpu_bundle):
    fake = fake_ort(CUDA, CPU)
    _engine(llama_gpu_bundle, provider="cuda", device_id=1, drafter="none")
    assert fake.created
    for session in fake.created:
        # No CPU EP behind it: CPU fallback is disabled, and ORT refuses that beside an explicit CPU EP.
        assert session.providers == [CUDA]
        assert session.provider_options == [{"device_id": "1"}]
        assert session.options.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
        assert session.options.enable_mem_pattern
        assert session_device(session) == Device("cuda", 1)  # where I/O binding must allocate
        assert session.kwargs == {"enable_fallback": 0}  # ORT's own silent retry is off


def test_directml_session_options(fake_ort, llama_gpu_bundle, monkeypatch):
    import runtime.loader as loader_module
    from edge_spec.placement import PlacementReport

    fake = fake_ort(DML, CPU)
    # Options only: the kernel facts refuse these fused graphs on DirectML (tests/test_device_profiles.py).
    monkeypatch.setattr(loader_module, "check_bundle", lambda *a, **k: PlacementReport("dml", ""))
    _engine(llama_gpu_bundle, provider="dml", device_id=2, drafter="none")
    assert fake.created
    for session in fake.created:
        assert session.providers == [DML]
        assert session.provider_options == [{"device_id": "2"}]
        assert session.options.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
        # DirectML refuses memory patterns and parallel execution.
        assert session.options.enable_mem_pattern is False
        assert session.options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        assert session_device(session) == Device("dml", 2)


@pytest.mark.parametrize("units, static", [("CPUAndNeuralEngine", False), ("CPUOnly", True)])
def test_coreml_options(fake_ort, llama_bundle, units, static):
    fake = fake_ort(COREML, CPU)
    _engine(llama_bundle, provider="coreml", coreml_compute_units=units, coreml_static_shapes=static, drafter="none")
    assert fake.created
    for session in fake.created:
        assert session.providers == [COREML, CPU]
        assert session.provider_options == [
            {"ModelFormat": "MLProgram", "MLComputeUnits": units, "RequireStaticInputShapes": "1" if static else "0"}, {},
        ]
        assert session_device(session) == Device("cpu", 0)  # Core ML takes CPU memory


def test_bad_provider_options_fail_before_loading(fake_ort, llama_bundle):
    fake = fake_ort(COREML, CPU)
    with pytest.raises(ValueError, match="unknown Core ML compute units 'NPU'"):
        _engine(llama_bundle, provider="coreml", coreml_compute_units="NPU")
    with pytest.raises(ValueError, match="device id must be 0 or more"):
        SessionConfig(device_id=-1)
    assert fake.created == []


def test_cpu_options_are_the_measured_ones(fake_ort, llama_bundle):
    fake = fake_ort(CPU)
    _engine(llama_bundle, provider="cpu", drafter="none")
    for session in fake.created:
        assert session.providers == [CPU] and session.provider_options == [{}]
        assert session.options.enable_mem_pattern and session.options.intra_op_num_threads == 1
        # Spin within a run, stop when it returns (so no pool spins while the next session runs).
        assert session.options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert session.options.get_session_config_entry("session.force_spinning_stop") == "1"


# -- a provider that is listed but fails to start ---------------------------------------------------


def test_provider_that_fails_to_start(fake_ort, llama_gpu_bundle):
    fake = fake_ort(CUDA, CPU)
    fake.fail = {CUDA}
    with pytest.raises(ProviderError) as err:
        _engine(llama_gpu_bundle, provider="cuda", drafter="none")
    message = str(err.value)
    assert f"{CUDA} failed to start (fake: {CUDA} cannot start)" in message and "second line" not in message
    assert "--allow-fallback" in message and "installed: " in message

    for config in ({"provider": "cuda", "allow_fallback": True}, {"provider": "auto"}):
        fake.created = []
        engine = _engine(llama_gpu_bundle, drafter="none", **config)
        assert fake.created and {s.providers[0] for s in fake.created} == {CPU}
        report = engine.provider_report()["target"]
        assert (report["provider"], report["fallback_from"]) == ("cpu", "cuda")
        assert f"{CUDA} failed to start" in report["reason"]
        assert engine.provider_line().startswith("provider: cpu (fell back from cuda: ")


def test_broken_graph_is_a_bundle_error_not_a_provider_error(fake_ort, llama_gpu_bundle):
    fake = fake_ort(CUDA, CPU)
    fake.fail = {CUDA, CPU}
    with pytest.raises(BundleError, match="ONNX Runtime cannot load .*: fake: CPUExecutionProvider cannot start$"):
        _engine(llama_gpu_bundle, provider="cuda", allow_fallback=True, drafter="none")


def test_ort_device():
    assert sessions.ort_device("cuda", 3) == Device("cuda", 3)
    assert sessions.ort_device("dml", 1) == Device("dml", 1)
    assert sessions.ort_device("coreml", 1) == Device("cpu", 0)
    assert sessions.ort_device("cpu", 1) == Device("cpu", 0)


# -- the command line ---------------------------------------------------------------------------------


def _run(*args, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "runtime", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_cli_provider_error_and_report(llama_bundle):
    if DML in ort.get_available_providers():
        pytest.skip("this machine has DirectML")
    proc = _run("generate", llama_bundle, "--prompt", "hi", "--draft-provider", "dml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: provider 'dml' (DmlExecutionProvider) is not available")
    assert "onnxruntime-directml" in line and "edge-spec[directml]" in line and "--allow-fallback" in line
    assert f"installed: {', '.join(sessions.installed_runtimes())}" in line
    assert proc.stdout == ""

    proc = _run("generate", llama_bundle, "--prompt", "hi", "--max-new-tokens", "3", "--draft", "model", "--json",
                "--draft-provider", "dml", "--allow-fallback")
    assert proc.returncode == 0, proc.stderr
    available = ", ".join(ort.get_available_providers())
    auto_line = f"provider: cpu (auto; available: {available})"
    assert proc.stderr.splitlines() == [
        f"{auto_line}; draft provider: cpu (fell back from dml: {DML} is not in this ONNX Runtime build; available: {available})"
    ]
    out = json.loads(proc.stdout)
    assert 1 <= len(out["token_ids"]) <= 3
    assert out["provider"]["target"] == {
        "provider": "cpu", "requested": "auto", "available": ort.get_available_providers(), "fallback_from": None, "reason": "",
    }
    assert out["provider"]["draft"]["fallback_from"] == "dml"


def test_import_error_without_onnxruntime():
    proc = _run(code="import sys\nsys.modules['onnxruntime'] = None\nimport runtime.sessions")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: edge-spec's runtime needs ONNX Runtime and no onnxruntime package is installed")
    for extra, package in (("cpu", "onnxruntime"), ("cuda", "onnxruntime-gpu"), ("directml", "onnxruntime-directml")):
        assert f'pip install "edge-spec[{extra}]" ({package}:' in last


def test_kv_lives_on_the_gpu_only_for_fused_cuda_stages(fake_ort, llama_bundle):
    """KV buffers go to the device when every layer stage is fused and bindable on CUDA (the
    graphs write them in place there); portable stages or the CPU keep them in host memory."""
    from runtime.sessions import kv_device

    class Bindable(FakeSession):
        def io_binding(self):
            raise AssertionError("not called by kv_device")

    manifest = open_bundle(llama_bundle, check_hashes=False).manifest
    stages = [manifest.stages[key] for key in manifest.target.stages]
    fake_ort(CUDA, CPU)
    options = [{"device_id": "1"}, {}]
    on_cuda = [Bindable(llama_bundle / s.file, providers=[CUDA, CPU], provider_options=options) for s in stages]
    on_cpu = [Bindable(llama_bundle / s.file, providers=[CPU], provider_options=[{}]) for s in stages]
    assert all(s.attention == "fused" for s in stages if s.layers)
    assert kv_device(stages, on_cuda) == Device("cuda", 1)
    assert kv_device(stages, on_cpu) is None
    unbindable = [FakeSession(llama_bundle / s.file, providers=[CUDA, CPU], provider_options=options) for s in stages]
    assert kv_device(stages, unbindable) is None
    portable = [dataclasses.replace(s, attention="portable") for s in stages]
    assert kv_device(portable, on_cuda) is None


# -- CUDA's libraries: preloaded, and named when one is missing ----------------------------------


@pytest.fixture
def preload(monkeypatch):
    """Record calls to onnxruntime.preload_dlls (printing what it prints when set), fresh per test."""
    calls = []

    def fake_preload(printed: str = ""):
        def preload_dlls(*args, **kwargs):
            calls.append((args, kwargs))
            print(printed, end="")
        monkeypatch.setattr(sessions.ort, "preload_dlls", preload_dlls, raising=False)
        return calls

    monkeypatch.setattr(sessions, "_PRELOADED", {})
    return fake_preload


def test_cuda_preloads_its_libraries_once_and_only_for_cuda(fake_ort, preload, llama_gpu_bundle, llama_bundle, capsys):
    calls = preload("Failed to load /site/nvidia/cu13/lib/libcufft.so.12: not found\n")
    fake_ort(CUDA, CPU)
    _engine(llama_bundle, provider="cpu", drafter="none")
    assert calls == []
    _engine(llama_gpu_bundle, provider="cuda", drafter="model")
    assert len(calls) == 1  # once per process, before the first CUDA session
    assert capsys.readouterr().out == ""  # its report stays off stdout


def test_no_preload_where_the_build_has_none(fake_ort, preload, llama_gpu_bundle, monkeypatch):
    """NVIDIA's Jetson builds and older onnxruntime have no preload_dlls."""
    preload()
    monkeypatch.delattr(sessions.ort, "preload_dlls")
    fake_ort(CUDA, CPU)
    assert _engine(llama_gpu_bundle, provider="cuda", drafter="none").provider == "cuda"


@pytest.mark.parametrize("error, printed, library", [
    ("[ONNXRuntimeError] : 1 : FAIL : Failed to load library libonnxruntime_providers_cuda.so with error: "
     "libcublasLt.so.13: cannot open shared object file: No such file or directory\nmore", "", "libcublasLt.so.13"),
    ('LoadLibrary failed with error 126 "" when trying to load "C:\\ort\\onnxruntime_providers_cuda.dll"',
     "Failed to load cudnn64_9.dll: [WinError 126] The specified module could not be found\n", "cudnn64_9.dll"),
])
def test_a_provider_that_fails_to_start_names_the_missing_library(fake_ort, preload, llama_gpu_bundle, monkeypatch, error, printed, library):
    """From ONNX Runtime's own message (Linux) or, where that names only the provider library
    (Windows), from what preload_dlls could not load; in one line, with what brings it."""
    preload(printed)
    fake = fake_ort(CUDA, CPU)

    class Failing(fake):
        def __init__(self, path, sess_options=None, providers=None, provider_options=None, **kwargs):
            if CUDA in providers:
                raise RuntimeError(error)
            super().__init__(path, sess_options, providers, provider_options, **kwargs)

    monkeypatch.setattr(sessions.ort, "InferenceSession", Failing)
    with pytest.raises(sessions.ProviderError) as raised:
        _engine(llama_gpu_bundle, provider="cuda", drafter="none")
    message = str(raised.value)
    assert "\n" not in message
    assert f"{CUDA} failed to start: cannot load {library} (" in message and 'pip install "edge-spec[cuda]"' in message


def test_cuda_extra_brings_the_cuda_and_cudnn_libraries():
    """onnxruntime-gpu 1.31.1 declares its CUDA 13 libraries under its `cuda` extra and cuDNN 9
    under `cudnn` (its METADATA); the cuda extra asks for both."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda"] == ["onnxruntime-gpu[cuda,cudnn]==1.31.1"]
