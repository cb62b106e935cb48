"""load_manifest finds every problem a bundle can have, up front, with a specific message.

Each test edits a copy of a tiny exported bundle (the session bundle stays untouched).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edge_spec import manifest as mf
from edge_spec.manifest import BundleError, load_manifest, manifest_from_dict, validate


@pytest.fixture
def bundle(llama_bundle, tmp_path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(llama_bundle, copy)
    return copy


def _edit(bundle: Path, change) -> dict:
    path = bundle / mf.MANIFEST_FILE
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return data


def _raises(bundle, *fragments, **kwargs) -> str:
    with pytest.raises(BundleError) as info:
        load_manifest(bundle, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_intact_copy_loads(bundle):
    manifest = load_manifest(bundle)
    assert manifest.schema_version == mf.SCHEMA_VERSION
    assert set(manifest.models) == {"target", "draft", "layer_skip"}
    assert manifest.default_draft == "draft"
    assert set(manifest.files) == {p.name for p in bundle.iterdir()} - {mf.MANIFEST_FILE}
    # JSON round trip is lossless.
    assert manifest_from_dict(json.loads(manifest.to_json())) == manifest


@pytest.mark.parametrize("version", [mf.SCHEMA_VERSION + 1, mf.SCHEMA_VERSION - 1, 0, None, str(mf.SCHEMA_VERSION)])
def test_wrong_schema_version(bundle, version):
    _edit(bundle, lambda d: d.update(schema_version=version))
    _raises(bundle, f"schema version {version!r} is not supported", f"reads version {mf.SCHEMA_VERSION}", "re-export")


def test_unknown_attention_kind(bundle):
    _edit(bundle, lambda d: d["stages"]["target.trunk"].update(attention="flash"))
    _raises(bundle, "unknown attention kind 'flash'")


def test_missing_file(bundle):
    (bundle / "draft.onnx.data").unlink()
    _raises(bundle, "bundle file missing", "draft.onnx.data", "re-export")


def test_missing_file_found_even_without_hash_check(bundle):
    (bundle / "target.head.onnx").unlink()
    _raises(bundle, "bundle file missing", "target.head.onnx", check_hashes=False)


def test_altered_file(bundle):
    path = bundle / "target.rest.onnx.data"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    _raises(bundle, "bundle file altered", "target.rest.onnx.data", "SHA-256", "restore the file")
    load_manifest(bundle, check_hashes=False)  # only the hash check sees it


def test_altered_tokenizer(bundle):
    path = bundle / mf.TOKENIZER_FILE
    path.write_text(path.read_text().replace('"<pad>"', '"<PAD>"'))
    _raises(bundle, "bundle file altered", "tokenizer.json")


def test_unknown_field_top_level(bundle):
    _edit(bundle, lambda d: d.update(shiny_new_field=1))
    _raises(bundle, "top level", "unknown field(s) ['shiny_new_field']")


def test_unknown_field_in_stage_and_arch(bundle, tmp_path):
    _edit(bundle, lambda d: d["stages"]["target.head"].update(fused=True))
    _raises(bundle, "stage 'target.head'", "unknown field(s) ['fused']")
    _edit(bundle, lambda d: (d["stages"]["target.head"].pop("fused"), d["models"]["draft"]["arch"].update(rope="x")))
    _raises(bundle, "model 'draft' arch", "unknown field(s) ['rope']")


def test_missing_field(bundle):
    _edit(bundle, lambda d: d["models"]["target"].pop("quant"))
    _raises(bundle, "model 'target'", "quant")


def test_missing_manifest(bundle):
    (bundle / mf.MANIFEST_FILE).unlink()
    _raises(bundle, "is not a bundle", "no manifest.json", "python -m export")


def test_missing_folder(tmp_path):
    _raises(tmp_path / "nowhere", "bundle folder not found")


def test_invalid_json(bundle):
    (bundle / mf.MANIFEST_FILE).write_text('{"schema_version": 1,')
    _raises(bundle, "is not valid JSON")
    (bundle / mf.MANIFEST_FILE).write_bytes(b"\xff\xfe\x00garbage")
    _raises(bundle, "is not valid JSON")
    (bundle / mf.MANIFEST_FILE).write_text("[1, 2]")
    _raises(bundle, "must hold a JSON object")


def test_vocab_mismatch_between_roles(bundle):
    data = _edit(bundle, lambda d: d["models"]["draft"]["arch"].update(vocab_size=d["models"]["draft"]["arch"]["vocab_size"] + 64))
    target_rows = data["models"]["target"]["arch"]["vocab_size"]
    _raises(bundle, "vocabulary mismatch", "draft 'draft'", f"target scores {target_rows}", "shares the target's tokenizer")
    # validate() alone, on the edited dict, says the same.
    with pytest.raises(BundleError, match="vocabulary mismatch"):
        validate(manifest_from_dict(data), bundle, check_hashes=False)


def test_lm_head_smaller_than_tokenizer(bundle):
    def shrink(d):
        for model in d["models"].values():
            model["arch"]["vocab_size"] = d["tokenizer"]["n_real_tokens"] - 1

    data = _edit(bundle, shrink)
    n_real = data["tokenizer"]["n_real_tokens"]
    _raises(bundle, "vocabulary mismatch", f"has {n_real - 1} LM-head rows but the tokenizer has {n_real} tokens")


@pytest.mark.parametrize(
    "change,fragment",
    [
        (lambda d: d.update(default_draft="medusa"), "default_draft 'medusa' is not one of its models"),
        (lambda d: d["models"].pop("target"), "no 'target' model"),
        (lambda d: d["models"]["draft"].update(quant="int2"), "unknown quantization 'int2'"),
        (lambda d: d["models"]["draft"]["arch"].update(kv_dtype="bfloat16"), "unknown KV dtype 'bfloat16'"),
        (lambda d: d["models"]["layer_skip"].update(shares_kv_with="draft2"), "shares KV with 'draft2', which owns none"),
        (lambda d: d["models"]["layer_skip"]["arch"].update(max_context=128), "disagree on max context"),
        (lambda d: d["models"]["target"].update(stages=["target.trunk", "target.head"]), "stages run 1 layers, arch says 4"),
        (lambda d: d["models"]["target"].update(stages=["target.rest", "target.trunk", "target.head"]), "out of place"),
        (lambda d: d["models"]["target"].update(stages=["target.trunk", "target.lost", "target.head"]), "'target.lost', which the manifest does not list"),
        (lambda d: d["models"]["target"].update(stages=[]), "has no stages"),
        (lambda d: d["stages"]["target.rest"].update(layer_start=2), "starts at layer 2, expected 1"),
        (lambda d: d["stages"]["target.head"].update(outputs=["logits_renamed"]), "do not follow edge_spec.names"),
        (lambda d: d["files"].pop("draft.onnx"), "manifest lists no hash for ['draft.onnx']"),
    ],
    ids=[
        "default-draft", "no-target", "quant", "kv-dtype", "shares-kv", "max-context", "layer-count",
        "stage-order", "unknown-stage", "no-stages", "layer-gap", "io-names", "unhashed-file",
    ],
)
def test_inconsistent_manifest(bundle, change, fragment):
    _edit(bundle, change)
    _raises(bundle, fragment, check_hashes=False)


def test_engine_refuses_altered_bundle_before_loading(bundle):
    from runtime.engine import Engine, EngineConfig

    path = bundle / "draft.onnx"
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(BundleError, match="bundle file altered: .*draft.onnx"):
        Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False, check_hashes=False))
    assert engine.target.cache.max_context == 64


def test_engine_names_a_missing_role(tiny_models, tmp_path):
    from runtime.engine import Engine, EngineConfig
    from tiny import export

    out = tmp_path / "plain"
    export(tiny_models.llama, out)
    with pytest.raises(BundleError, match="has no 'draft' model.*it has: target"):
        Engine(out, EngineConfig(drafter="model", calibrate=False))
    with pytest.raises(BundleError, match="has no 'layer_skip' model"):
        Engine(out, EngineConfig(drafter="layer-skip", calibrate=False))
    # auto without any draft model: prompt lookup only.
    engine = Engine(out, EngineConfig(drafter="auto", calibrate=False))
    assert [part.name for part in engine.drafter.parts()] == ["lookup"]


# -- untrusted bundles: links out of the folder, ids outside the vocabulary, unreadable files ------

def test_a_file_linked_outside_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (bundle / mf.TOKENIZER_FILE).rename(outside / mf.TOKENIZER_FILE)
    (bundle / mf.TOKENIZER_FILE).symlink_to(outside / mf.TOKENIZER_FILE)  # same bytes: the hash matches
    _raises(bundle, "tokenizer.json is a link to", "outside the bundle folder")
    _raises(bundle, "outside the bundle folder", check_hashes=False)


def test_a_manifest_linked_outside_the_bundle_is_refused(bundle, tmp_path):
    (bundle / mf.MANIFEST_FILE).rename(tmp_path / "manifest.json")
    (bundle / mf.MANIFEST_FILE).symlink_to(tmp_path / "manifest.json")
    _raises(bundle, "manifest.json is a link to", "outside the bundle folder")


def test_links_inside_the_bundle_and_a_linked_bundle_folder_load(bundle, tmp_path):
    (bundle / "tok-real.json").write_bytes((bundle / mf.TOKENIZER_FILE).read_bytes())
    (bundle / mf.TOKENIZER_FILE).unlink()
    (bundle / mf.TOKENIZER_FILE).symlink_to("tok-real.json")
    (tmp_path / "alias").symlink_to(bundle)
    assert load_manifest(tmp_path / "alias").target.arch.max_context == 64


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["tokenizer"].update(eos_token_ids=[10**9]), "tokenizer.eos_token_ids 1000000000 is outside the vocabulary"),
    (lambda d: d["tokenizer"].update(eos_token_ids=[2, d["tokenizer"]["n_real_tokens"]]), "eos_token_ids"),
    (lambda d: d["tokenizer"].update(bos_token_id=10**6), "tokenizer.bos_token_id 1000000 is outside the vocabulary"),
])
def test_special_ids_outside_the_vocabulary_are_refused(bundle, change, fragment):
    _edit(bundle, change)
    _raises(bundle, fragment, check_hashes=False)


def _rehash(bundle: Path, rel: str) -> None:
    _edit(bundle, lambda d: d["files"].update({rel: mf.sha256_file(bundle / rel)}))


def test_a_tokenizer_file_that_is_not_json_is_one_line(bundle):
    from runtime.engine import Engine, EngineConfig

    (bundle / mf.TOKENIZER_FILE).write_bytes(b"\x00\xffnot json at all\n{")
    _rehash(bundle, mf.TOKENIZER_FILE)
    with pytest.raises(BundleError, match="is not a tokenizer the tokenizers library can read") as caught:
        Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**10 }}",
    "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{{ 'x' | center(10**10) }}",
    "{{ 7 ** (10 ** 8) }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
])
def test_a_chat_template_past_its_limits_is_refused_at_load_in_one_line(bundle, template, monkeypatch):
    import runtime.tokenizer as tokenizer_module
    from runtime.engine import Engine, EngineConfig
    from runtime.tokenizer import ChatTemplateError

    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)
    _edit(bundle, lambda d: d["tokenizer"].update(chat_template=template))
    with pytest.raises(ChatTemplateError, match="chat template") as caught:
        Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


BOMB_ON_REQUEST = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ 'x' * 10**10 }}{% endif %}"
                   "{% if m['content'] == 'loop' %}{% for i in range(10**9) %}{% endfor %}{% endif %}"
                   "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def test_a_chat_template_past_its_limits_on_one_request_is_a_value_error(bundle):
    from runtime.api import Model
    from runtime.tokenizer import ChatTemplateError

    _edit(bundle, lambda d: d["tokenizer"].update(chat_template=BOMB_ON_REQUEST))
    model = Model.load(bundle, provider="cpu", threads=1, drafter="none")
    try:
        for content in ("boom", "loop"):
            with pytest.raises(ChatTemplateError, match="over its limit") as caught:
                model.generate(messages=[{"role": "user", "content": content}], max_tokens=2)
            assert "\n" not in str(caught.value)
        assert model.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2).prompt_ids
    finally:
        model.close()


# -- the manifest covered by a pinned digest: bundle_sha256 / --bundle-sha256 ---------------------

def test_a_pinned_digest_refuses_an_edited_manifest_that_otherwise_loads(bundle):
    digest = mf.bundle_digest(bundle)
    assert load_manifest(bundle, expected_sha256=digest.upper()).tokenizer.chat_template is not None
    _edit(bundle, lambda d: d["tokenizer"].update(chat_template="{{ messages[0]['content'] }} (edited)"))
    assert load_manifest(bundle).tokenizer.chat_template.endswith("(edited)")  # every consistency check passes
    message = _raises(bundle, f"pinned bundle SHA-256 is {digest[:16]}", "manifest was edited", expected_sha256=digest)
    assert "\n" not in message
    assert mf.read_manifest(bundle, expected_sha256=mf.bundle_digest(bundle))[1] == mf.bundle_digest(bundle)


@pytest.mark.parametrize("value", ["", "abc", "g" * 64, "a" * 65, 12])
def test_a_malformed_digest_is_one_line(bundle, value):
    with pytest.raises(ValueError, match="must be 64 hexadecimal digits"):
        load_manifest(bundle, expected_sha256=value)


def test_a_pinned_digest_needs_the_file_hashes(bundle):
    from runtime.engine import EngineConfig

    digest = mf.bundle_digest(bundle)
    _raises(bundle, "needs the file hashes checked", check_hashes=False, expected_sha256=digest)
    with pytest.raises(ValueError, match="needs check_hashes=True"):
        EngineConfig(bundle_sha256=digest, check_hashes=False)
    with pytest.raises(ValueError, match="64 hexadecimal digits"):
        EngineConfig(bundle_sha256="sha256:" + digest)
    assert EngineConfig(bundle_sha256=" " + digest.upper()).bundle_sha256 == digest


def test_engine_model_and_command_line_refuse_another_bundle_before_loading(bundle, capsys):
    from runtime.__main__ import main
    from runtime.api import Model
    from runtime.engine import Engine, EngineConfig

    digest = mf.bundle_digest(bundle)
    other = ("0" if digest[0] != "0" else "1") + digest[1:]
    engine = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False, bundle_sha256=digest))
    assert engine.bundle.digest == digest
    main(["check", str(bundle), "--provider", "cpu", "--json"])  # where a user reads the digest to pin
    assert json.loads(capsys.readouterr().out)["bundle_sha256"] == digest
    with pytest.raises(BundleError, match="pinned bundle SHA-256"):
        Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False, bundle_sha256=other))
    with pytest.raises(BundleError, match="pinned bundle SHA-256"):
        Model.load(bundle, provider="cpu", drafter="none", bundle_sha256=other)
    assert main(["generate", str(bundle), "--provider", "cpu", "--draft", "none", "--prompt", "hi", "--bundle-sha256", other]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"pinned bundle SHA-256 is {other[:16]}" in err
    with pytest.raises(SystemExit) as exited:
        main(["generate", str(bundle), "--prompt", "hi", "--bundle-sha256", "nope"])
    assert exited.value.code == 2 and "--bundle-sha256: the bundle SHA-256 must be 64 hexadecimal digits" in capsys.readouterr().err
