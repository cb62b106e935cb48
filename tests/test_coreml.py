"""Core ML export for the Apple Neural Engine, tested up to what Linux allows.

Converting and saving packages works on any OS; loading and predicting needs macOS 15+. So:
the saved specs are read back (inputs, outputs, states, enumerated shapes, fp16 types); the
exact torch module that was converted is checked against transformers; and the runtime's Core
ML session is driven through ModelRunner and the speculative loop with a stand-in MLModel that
runs that module, in place of the Core ML runtime this machine lacks.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("coremltools", reason="needs coremltools 9.0 (pip install 'edge-spec[coreml]')")

import torch  # noqa: E402

import real  # noqa: E402
import tiny  # noqa: E402
from edge_spec import manifest as mf  # noqa: E402
from edge_spec import names  # noqa: E402
from edge_spec.manifest import BundleError, load_manifest  # noqa: E402
from edge_spec.sampling import SamplingConfig  # noqa: E402
from export.bundle import ExportConfig, ExportError, export_bundle  # noqa: E402
from export.coreml import CoreMLOptions, StatefulStage, compress, convert_stage  # noqa: E402
from export.static_cache import StageModule  # noqa: E402
from runtime import coreml_backend  # noqa: E402
from runtime.coreml_backend import CoreMLSession, CoreMLUnavailable, plan_blocks  # noqa: E402
from runtime.drafters.layer_skip import LayerSkipDrafter  # noqa: E402
from runtime.gamma import GammaConfig  # noqa: E402
from runtime.kv_cache import KVCache  # noqa: E402
from runtime.loop import decode_steps  # noqa: E402
from runtime.policy import RoundPolicy  # noqa: E402
from runtime.model import ModelRunner  # noqa: E402

BLOCK_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 64)


def _ct():
    import coremltools as ct

    return ct


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 4-layer target and a 2-layer draft with head_dim 32 (hidden 128, 4 heads), a head
    size the Neural Engine takes as real models' 64 and 128 are."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("coreml_models")
    tok = tiny.make_tokenizer("a")
    target = tiny.make_llama(root / "target", tok, n_layers=4, hidden=128, seed=0)
    draft = tiny.make_llama(root / "draft", tok, n_layers=2, hidden=128, seed=5)
    return {"target": target, "draft": draft, "hf": tiny.load_hf(target), "hf_draft": tiny.load_hf(draft)}


def _export(out: Path, model: Path, quant: str, drafts=(), formats=("onnx", "coreml")):
    return export_bundle(ExportConfig(str(model), out, quant, tiny.MAX_CONTEXT, tuple(drafts), formats=formats), log=lambda m: None)


@pytest.fixture(scope="module")
def pair_bundle(tmp_path_factory, models) -> Path:
    """ONNX + Core ML, int8, target with a draft model and a layer-skip draft (1 of 4 layers)."""
    out = tmp_path_factory.mktemp("coreml_bundles") / "pair-int8"
    _export(out, models["target"], "int8", (str(models["draft"]), "layer-skip:1"))
    return out


@pytest.fixture(scope="module")
def coreml_only_bundle(tmp_path_factory, models) -> Path:
    """Through the command line: `python -m export MODEL --format coreml`, no ONNX graphs."""
    from export.__main__ import main

    out = tmp_path_factory.mktemp("coreml_bundles") / "target-fp16"
    argv = [str(models["target"]), "--out", str(out), "--quant", "fp16", "--max-context", str(tiny.MAX_CONTEXT)]
    assert main(argv + ["--draft", "none", "--format", "coreml"]) == 0
    return out


# -- the bundle and its manifest ---------------------------------------------------------


def test_bundle_lists_every_package(pair_bundle):
    manifest = load_manifest(pair_bundle)
    assert set(manifest.coreml) == set(manifest.stages) == {"target.trunk", "target.rest", "target.head", "draft"}
    for key, package in manifest.coreml.items():
        stage = manifest.stages[key]
        assert package.file == f"{key}.mlpackage" and stage.file == f"{key}.onnx"
        inside = mf.package_files(pair_bundle, package.file)
        assert inside and all(rel in manifest.files for rel in inside)
        assert package.block_lengths == BLOCK_LENGTHS
        assert package.compression == "int8-per-channel" and package.compute_precision == "float16"
        assert package.state_length == (tiny.MAX_CONTEXT if stage.layers else 0)
        assert list(package.states) == [f"{kind}_cache_{layer}" for layer in stage.layers for kind in ("key", "value")]
    on_disk = {p.relative_to(pair_bundle).as_posix() for p in pair_bundle.rglob("*") if p.is_file()}
    assert set(manifest.files) == on_disk - {mf.MANIFEST_FILE}
    assert mf.manifest_from_dict(json.loads(manifest.to_json())) == manifest


def test_manifest_without_coreml_field_still_loads(pair_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(pair_bundle, copy)
    data = json.loads((copy / mf.MANIFEST_FILE).read_text())
    for package in data.pop("coreml").values():
        shutil.rmtree(copy / package["file"])
        data["files"] = {rel: h for rel, h in data["files"].items() if not rel.startswith(package["file"] + "/")}
    (copy / mf.MANIFEST_FILE).write_text(json.dumps(data))
    assert load_manifest(copy).coreml == {}


def _spec(path: Path):
    return _ct().utils.load_spec(str(path))


def _array_type(feature):
    return feature.type.multiArrayType


def _op_types(spec) -> dict[str, int]:
    main = spec.mlProgram.functions["main"]
    ops = main.block_specializations[main.opset]
    found: dict[str, int] = {}
    for op in ops.operations:
        found[op.type] = found.get(op.type, 0) + 1
    return found


def _float_compute_types(spec) -> set[int]:
    """Element types of every matmul/linear/softmax result in the program."""
    main = spec.mlProgram.functions["main"]
    types = set()
    for op in main.block_specializations[main.opset].operations:
        if op.type in ("matmul", "linear", "softmax"):
            types.update(out.type.tensorType.dataType for out in op.outputs)
    return types


def test_package_specs_are_fixed_shape_fp16_and_stateful(pair_bundle):
    ct = _ct()
    from coremltools.proto import FeatureTypes_pb2, MIL_pb2

    fp16, int32 = FeatureTypes_pb2.ArrayFeatureType.FLOAT16, FeatureTypes_pb2.ArrayFeatureType.INT32
    manifest = load_manifest(pair_bundle)
    hidden = manifest.target.arch.hidden_size
    arch = manifest.target.arch
    for key, package in manifest.coreml.items():
        stage = manifest.stages[key]
        spec = _spec(pair_bundle / package.file)
        assert spec.specificationVersion == ct.target.iOS18 == 9
        assert _opens_as_mlmodel(pair_bundle / package.file)
        inputs = {f.name: f for f in spec.description.input}
        assert list(inputs) == list(package.inputs)
        block = _array_type(inputs[package.inputs[0]])
        # Enumerated block lengths, never an open range.
        assert block.WhichOneof("ShapeFlexibility") == "enumeratedShapes", key
        shapes = [tuple(s.shape) for s in block.enumeratedShapes.shapes]
        row = (hidden,) if not stage.embed else ()
        assert shapes == [(1, t, *row) for t in BLOCK_LENGTHS]
        assert block.dataType == (int32 if stage.embed else fp16)
        if stage.layers:
            kv_len = _array_type(inputs[names.KV_LEN])
            assert tuple(kv_len.shape) == (1,) and kv_len.dataType == int32 and kv_len.WhichOneof("ShapeFlexibility") is None
        outputs = [f.name for f in spec.description.output]
        assert outputs == list(package.outputs) == [n.replace(".", "_") for n in names.stage_outputs(stage.head, stage.layers, "portable")]
        assert {_array_type(f).dataType for f in spec.description.output} == {fp16}
        states = {s.name: s.type.stateType.arrayType for s in spec.description.state}
        assert list(states) == list(package.states)
        for state in states.values():
            assert tuple(state.shape) == (1, arch.n_kv_heads, tiny.MAX_CONTEXT, arch.head_dim) and state.dataType == fp16
            assert state.shape[2] % 32 == 0
        ops = _op_types(spec)
        if stage.layers:
            n = len(stage.layers)
            assert ops.get("read_state") == 4 * n and ops.get("slice_update") == 2 * n and ops.get("write_state") == 2 * n, ops
        # int8 with per-channel scales: 7 matrices a layer, and the embedding and/or LM head
        # (one table when tied, as here: coremltools folds the head's transposed copy into it).
        assert ops.get("constexpr_blockwise_shift_scale") == 7 * len(stage.layers) + int(stage.embed or stage.head), ops
        assert _float_compute_types(spec) == {MIL_pb2.DataType.FLOAT16}, key


def _opens_as_mlmodel(path: Path) -> bool:
    """The package opens as an MLModel without the (macOS-only) compiler."""
    model = _ct().models.MLModel(str(path), skip_model_load=True)
    return model.get_spec().description.input[0].name in ("input_ids", "hidden_in")


def test_coreml_only_bundle(coreml_only_bundle):
    manifest = load_manifest(coreml_only_bundle)
    assert not list(coreml_only_bundle.glob("*.onnx*"))
    assert manifest.stages["target"].file == "" and manifest.stages["target"].data_files == ()
    package = manifest.coreml["target"]
    assert package.compression == "none"
    ops = _op_types(_spec(coreml_only_bundle / package.file))
    assert "constexpr_blockwise_shift_scale" not in ops and ops["linear"] >= 7 * 4


@pytest.fixture
def only_copy(coreml_only_bundle, tmp_path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(coreml_only_bundle, copy)
    return copy


def _weights(bundle: Path) -> Path:
    (weights,) = bundle.glob("target.mlpackage/Data/com.apple.CoreML/weights/*.bin")
    return weights


def test_altered_package_file_is_found(only_copy):
    path = _weights(only_copy)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="bundle file altered.*weight.bin"):
        load_manifest(only_copy)
    load_manifest(only_copy, check_hashes=False)


def test_unlisted_file_inside_package_is_refused(only_copy):
    (_weights(only_copy).parent / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleError, match="holds files the manifest does not list.*extra.bin"):
        load_manifest(only_copy, check_hashes=False)


def test_missing_package_is_found(only_copy):
    shutil.rmtree(only_copy / "target.mlpackage")
    with pytest.raises(BundleError, match="bundle file missing.*target.mlpackage"):
        load_manifest(only_copy, check_hashes=False)


def test_stage_without_graph_or_package_is_refused(only_copy):
    path = only_copy / mf.MANIFEST_FILE
    data = json.loads(path.read_text())
    data["coreml"] = {}
    path.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="stage 'target' has neither an ONNX graph nor a Core ML package"):
        load_manifest(only_copy, check_hashes=False)


def test_wrong_state_length_is_refused(only_copy):
    path = only_copy / mf.MANIFEST_FILE
    data = json.loads(path.read_text())
    data["coreml"]["target"]["state_length"] = 96
    path.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="KV states hold 96 rows.*max context 64"):
        load_manifest(only_copy, check_hashes=False)


def test_state_length_must_be_a_multiple_of_32(models, tmp_path):
    with pytest.raises(ExportError, match="multiples of 32; pass a multiple such as 128"):
        export_bundle(ExportConfig(str(models["target"]), tmp_path / "b", "fp16", 100, formats=("coreml",)), log=lambda m: None)


def test_cli_rejects_unknown_format(capsys):
    from export.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["smollm2-135m", "--format", "onnx,tflite"])
    assert info.value.code == 2
    assert "choose one or more of onnx, coreml" in capsys.readouterr().err


# -- the converted module against transformers -------------------------------------------

# Measured on this model: max |logit error| / max |logit| = 2e-6 (fp32), 1.1e-3 (fp32 compute,
# fp16 KV states), 5.4e-3 (fp16 throughout, as the package runs); bounds leave 3-4x room.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, 1e-5),
    "fp16-states": (torch.float32, torch.float16, 5e-3),
    "fp16": (torch.float16, torch.float16, 2e-2),
}


def _run_blocks(wrapper: StatefulStage, ids: list[int]) -> np.ndarray:
    """The prompt in blocks of 5, 1, 3 and the rest, with a rejected 4-token block written at
    position 5 first: its rows are left in the states and must be masked by kv_len alone."""
    outs = []
    with torch.no_grad():
        wrapper(torch.tensor([ids[:4][::-1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32))
        at = 0
        for n in (5, 1, 3, len(ids) - 9):
            x = torch.tensor([ids[at : at + n]], dtype=torch.int32)
            outs.append(wrapper(x, torch.tensor([at], dtype=torch.int32))[0][0].float().numpy())
            at += n
    return np.concatenate(outs)  # [T,V]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_stateful_module_matches_transformers(models, precision):
    model, tok = models["hf"]
    dtype, state_dtype, bound = PRECISIONS[precision]
    ids = tok(tiny.PROMPT)["input_ids"] + tok(" sat on the mat")["input_ids"][1:]
    reference = tiny.hf_logits(model, ids)  # [T,V]
    n_layers = model.config.num_hidden_layers
    # StageModule shares the model's layers: cast a copy, not the session's model.
    source = copy.deepcopy(model) if dtype == torch.float16 else model
    stage = StageModule(source, 0, n_layers, True, True, model.config.vocab_size)
    wrapper = StatefulStage(stage, range(n_layers), tiny.MAX_CONTEXT, state_dtype).eval()
    if dtype == torch.float16:
        wrapper = wrapper.half()  # what compute_precision=FLOAT16 makes of the program
    got = _run_blocks(wrapper, ids)
    error = np.abs(got - reference).max() / np.abs(reference).max()
    print(f"{precision}: max |error| / max |logit| = {error:.2e}")
    assert error < bound
    assert (got.argmax(-1) == reference.argmax(-1)).all()


# -- the runtime's Core ML session, up to the Core ML boundary ---------------------------


class FakeState:
    pass


class FakeMLModel:
    """Stands in for coremltools.models.MLModel: predict(data, state=) and make_state(), backed
    by the torch module that was converted, at fp32 with fp16 inputs and outputs as declared."""

    def __init__(self, wrapper: StatefulStage, package: mf.CoreMLPackageInfo):
        self.wrapper = wrapper
        self.package = package
        self.states: list[FakeState] = []
        self.calls: list[dict] = []

    def make_state(self):
        self.states.append(FakeState())
        return self.states[-1]

    def predict(self, data, state=None):
        assert list(data) == list(self.package.inputs)
        if self.package.states:
            assert state is not None and state is self.states[0], "predict without the session's state"
        else:
            assert state is None
        self.calls.append({name: (value.dtype, value.shape) for name, value in data.items()})
        args = [torch.from_numpy(data[self.package.inputs[0]])]
        if args[0].dtype == torch.float16:
            args[0] = args[0].float()
        if len(self.package.inputs) > 1:
            args.append(torch.from_numpy(data[self.package.inputs[1]]))
        with torch.no_grad():
            outs = self.wrapper(*args)
        return {name: out.numpy().astype(np.float16) for name, out in zip(self.package.outputs, outs)}


@pytest.fixture
def fake_engine(pair_bundle, models):
    """Sessions for every stage of the pair bundle, shared between roles as the Engine shares
    them, with one KVCache per KV owner."""
    manifest = load_manifest(pair_bundle)
    hf = {"target": models["hf"][0], "draft": models["hf_draft"][0]}
    sessions, fakes = {}, {}
    for key, stage in manifest.stages.items():
        source = hf["draft" if key == "draft" else "target"]
        module = StageModule(source, stage.layer_start, stage.layer_end, stage.embed, stage.head, manifest.target.arch.vocab_size)
        wrapper = StatefulStage(module, stage.layers, manifest.coreml[key].state_length, torch.float32).eval()
        fakes[key] = FakeMLModel(wrapper, manifest.coreml[key])
        sessions[key] = CoreMLSession(fakes[key], stage, manifest.coreml[key])
    caches, runners = {}, {}
    for role, info in manifest.models.items():
        owner = info.shares_kv_with or role
        arch = manifest.models[owner].arch
        caches.setdefault(owner, KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, arch.kv_dtype))
        stages = [manifest.stages[k] for k in info.stages]
        runners[role] = ModelRunner(role, info, stages, [sessions[k] for k in info.stages], caches[owner])
    return runners, fakes


# fp16 outputs (logits, hidden states between stages) round at 2^-11 relative: measured 5.4e-4.
FP16_OUTPUT_BOUND = 2e-3


def test_runner_over_coreml_sessions_matches_transformers(fake_engine, models):
    runners, fakes = fake_engine
    model, tok = models["hf"]
    ids = tok(tiny.PROMPT)["input_ids"] + tok(" sat on the mat")["input_ids"][1:]
    reference = tiny.hf_logits(model, ids)
    target = runners["target"]
    assert len(ids) == 19
    first = target.forward(ids[:17])  # 17 rows: package calls of 9 and 8 per stage
    assert target.cache.kv_len == 17
    rest = target.forward(ids[17:], n_logits=1)
    got = np.concatenate([first, rest])
    want = np.concatenate([reference[:17], reference[-1:]])
    assert got.dtype == np.float32 and got.shape == want.shape
    error = np.abs(got - want).max() / np.abs(want).max()
    print(f"ModelRunner over Core ML sessions: max |error| / max |logit| = {error:.2e}")
    assert error < FP16_OUTPUT_BOUND
    trunk = fakes["target.trunk"]
    assert [call["input_ids"][1][1] for call in trunk.calls] == [9, 8, 2]
    for fake in fakes.values():
        for call in fake.calls:
            block = call[fake.package.inputs[0]]
            assert block[1][1] in BLOCK_LENGTHS
            assert block[0] == (np.int32 if fake.package.inputs[0] == "input_ids" else np.float16)
            if "kv_len" in call:
                assert call["kv_len"] == (np.dtype(np.int32), (1,))
    # The state is made once per stage package, not per call.
    assert all(len(f.states) == (1 if f.package.states else 0) for f in fakes.values())


def test_speculative_loop_over_coreml_sessions_is_greedy_exact(fake_engine, models):
    """Layer-skip drafting writes the trunk's rows into the target's (shared) trunk state,
    rejected rows stay behind kv_len, and the output equals plain greedy decoding."""
    runners, fakes = fake_engine
    model, tok = models["hf"]
    prompt = tok(tiny.PROMPT)["input_ids"]
    expected = list(prompt)
    for _ in range(16):
        expected.append(int(tiny.hf_logits(model, expected)[-1].argmax()))
    drafter = LayerSkipDrafter(runners["layer_skip"])
    policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=4, max_gamma=8))
    steps, generated = [], []
    for step in decode_steps(runners["target"], drafter, prompt, SamplingConfig(), np.random.default_rng(0), policy):
        steps.append(step)
        generated += step.tokens
        if len(generated) >= 16:
            break
    print(f"layer-skip over Core ML sessions: {sum(s.n_accepted for s in steps)} of {sum(s.n_drafted for s in steps)} drafted accepted")
    assert generated[:16] == expected[len(prompt) :]
    assert any(s.n_accepted < s.n_drafted for s in steps) and any(s.n_accepted for s in steps)
    assert len(fakes["target.trunk"].states) == 1  # one trunk state for the draft and the target


def test_plan_blocks_is_exact():
    for block in range(0, 200):
        plan = plan_blocks(block, BLOCK_LENGTHS)
        assert sum(plan) == block and all(n in BLOCK_LENGTHS for n in plan)
    assert plan_blocks(75, BLOCK_LENGTHS) == [64, 9, 2]


def test_head_session_cuts_logits_to_the_asked_rows():
    vocab = 7
    package = mf.CoreMLPackageInfo("h.mlpackage", ("hidden_in",), ("logits",), (), (1, 2, 4), 0, "none")
    stage = mf.StageInfo("", (), False, True, 0, 0, ("hidden_in", "logit_positions"), ("logits",))

    class Head:
        def make_state(self):
            raise AssertionError("a stateless package needs no state")

        def predict(self, data, state=None):
            x = data["hidden_in"]  # [1,T,1]
            return {"logits": np.repeat(x, vocab, axis=2)}

    session = CoreMLSession(Head(), stage, package)
    hidden = np.arange(7, dtype=np.float32).reshape(1, 7, 1)  # 7 = 4 + 2 + 1
    (logits,) = session.run(["logits"], {"hidden_in": hidden, "logit_positions": np.array([2, 6])})
    assert logits.shape == (1, 2, vocab) and logits.dtype == np.float32
    assert logits[0, :, 0].tolist() == [2.0, 6.0]


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the package loads for real")
def test_loading_a_package_off_macos_names_the_requirement(coreml_only_bundle):
    manifest = load_manifest(coreml_only_bundle)
    with pytest.raises(CoreMLUnavailable, match=r"macOS 15\+.*coremltools 9.0"):
        coreml_backend.load_session(coreml_only_bundle / "target.mlpackage", manifest.stages["target"], manifest.coreml["target"])
    # The boundary itself: coremltools reads the package here but cannot make its state.
    model = _ct().models.MLModel(str(coreml_only_bundle / "target.mlpackage"), skip_model_load=True)
    with pytest.raises(Exception, match="macOS 15"):
        model.make_state()


# -- SmolLM2-135M, real weights ----------------------------------------------------------

# Measured: max |error| / max |logit| = 2e-6 (fp32) and 7.5e-3 (fp16 throughout) on this
# prompt, every position's argmax equal to transformers'.
SMOLLM2_BOUNDS = {"fp32": (torch.float32, 1e-5), "fp16": (torch.float16, 2.5e-2)}
SMOLLM2_CONTEXT = 256  # state length for the test; bundles use --max-context (2048 by default)


def _package_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.real_weights
def test_smollm2_packages(tmp_path):
    """One conversion of the whole model (embedding to head), saved as fp16 and compressed to
    int4 (int8 compression: the tiny pair above); the converted module checked against
    transformers in fp32 and fp16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export.sources import gguf_read_once

    folder = real.need(real.SMOLLM2)
    torch.set_num_threads(1)
    with gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=real.SMOLLM2, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=real.SMOLLM2)
    messages = [{"role": "user", "content": "Write a Python function that returns the nth Fibonacci number."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    reference = tiny.hf_logits(model, ids)
    config = model.config
    n_layers, hidden = config.num_hidden_layers, config.hidden_size

    for precision, (dtype, bound) in SMOLLM2_BOUNDS.items():
        source = copy.deepcopy(model) if dtype == torch.float16 else model
        stage = StageModule(source, 0, n_layers, True, True, config.vocab_size)
        wrapper = StatefulStage(stage, range(n_layers), SMOLLM2_CONTEXT, torch.float16 if dtype == torch.float16 else torch.float32).eval()
        got = _run_blocks(wrapper.half() if dtype == torch.float16 else wrapper, ids)
        error = np.abs(got - reference).max() / np.abs(reference).max()
        print(f"SmolLM2 {precision}: max |error| / max |logit| = {error:.2e}")
        assert error < bound
        assert (got.argmax(-1) == reference.argmax(-1)).all()
        del source, stage, wrapper

    stage = StageModule(model, 0, n_layers, True, True, config.vocab_size)
    converted = convert_stage(stage, range(n_layers), SMOLLM2_CONTEXT, CoreMLOptions(), hidden)
    sizes = {}
    for quant in ("fp16", "int4"):
        path = tmp_path / f"smollm2-{quant}.mlpackage"
        compress(converted, quant).save(str(path))
        sizes[quant] = _package_bytes(path)
    print("SmolLM2-135M Core ML packages: " + ", ".join(f"{q} {b / 2**20:.1f} MiB" for q, b in sizes.items()))
    # Tied embeddings are stored once (coremltools folds the LM head's transposed copy into the
    # embedding), so fp16 is 2 bytes per parameter; int4 adds a scale per 32.
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.9 < sizes["fp16"] / n_params < 2.1
    assert 0.25 < sizes["int4"] / sizes["fp16"] < 0.33

    from coremltools.proto import FeatureTypes_pb2

    fp16 = FeatureTypes_pb2.ArrayFeatureType.FLOAT16
    spec = _spec(tmp_path / "smollm2-int4.mlpackage")
    block = _array_type(spec.description.input[0])
    assert [tuple(s.shape) for s in block.enumeratedShapes.shapes] == [(1, t) for t in BLOCK_LENGTHS]
    states = [s.type.stateType.arrayType for s in spec.description.state]
    assert len(states) == 2 * n_layers
    assert {(tuple(s.shape), s.dataType) for s in states} == {((1, config.num_key_value_heads, SMOLLM2_CONTEXT, 64), fp16)}
    assert [f.name for f in spec.description.output] == mf.coreml_outputs(True, range(n_layers))
    ops = _op_types(spec)
    # Every linear and the tied embedding/head; not the rotary tables, which stay fp16.
    assert ops["constexpr_blockwise_shift_scale"] == 7 * n_layers + 1


def test_engine_runs_stages_without_a_graph_on_their_packages(coreml_only_bundle, models, monkeypatch):
    """The Engine routes a stage with no ONNX graph to the Core ML backend (here with the
    stand-in MLModel, as packages load only on macOS 15+) and decodes greedily as transformers."""
    import runtime.coreml_backend as backend
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    model, tok = models["hf"]
    loaded = []

    def fake_load(path, stage, package, compute_units="CPUAndNeuralEngine"):
        loaded.append((Path(path).name, compute_units))
        module = StageModule(model, stage.layer_start, stage.layer_end, stage.embed, stage.head, package_vocab)
        wrapper = StatefulStage(module, stage.layers, package.state_length, torch.float32).eval()
        return backend.CoreMLSession(FakeMLModel(wrapper, package), stage, package)

    package_vocab = load_manifest(coreml_only_bundle).target.arch.vocab_size
    monkeypatch.setattr(backend, "load_session", fake_load)
    engine = Engine(coreml_only_bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False, coreml_compute_units="CPUOnly"))
    assert loaded == [("target.mlpackage", "CPUOnly")]
    prompt = tok(tiny.PROMPT)["input_ids"]
    expected = list(prompt)
    for _ in range(8):
        expected.append(int(tiny.hf_logits(model, expected)[-1].argmax()))
    assert engine.generate(prompt, GenerateConfig(max_new_tokens=8)).token_ids == expected[len(prompt) :]
