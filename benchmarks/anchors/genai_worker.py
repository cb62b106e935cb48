"""onnxruntime-genai 0.18 side of benchmarks/anchors/run_anchors.py; runs in its own environment.

    python genai_worker.py --make-spec TARGET_DIR DRAFT_DIR OUT_DIR
        a model folder whose genai_config.json adds the draft's decoder as `model.draft`
        (draft-model speculative decoding); the draft graph is re-saved under its own name so
        its external data does not collide with the target's model.onnx.data.
    python genai_worker.py
        reads one JSON request per stdin line ({model, prompt, mode: plain|ngram|draft,
        max_new_tokens, ngram_size, max_draft_tokens}) and writes one JSON result per line.
"""

import json
import sys
import time
from pathlib import Path


def make_spec(target: Path, draft: Path, out: Path) -> None:
    import onnx

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "genai_config.json").read_text())
    draft_config = json.loads((draft / "genai_config.json").read_text())
    for item in target.iterdir():
        if item.name != "genai_config.json" and not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())
    decoder = dict(draft_config["model"]["decoder"])
    source = draft / decoder["filename"]
    if not (out / "draft.onnx").exists():
        model = onnx.load(str(source), load_external_data=True)
        onnx.save_model(model, str(out / "draft.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="draft.onnx.data")
    decoder["filename"] = "draft.onnx"
    config["model"]["draft"] = decoder
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    print(f"spec model folder: {out}")


def serve() -> None:
    import numpy as np
    import onnxruntime_genai as og

    models, tokenizers = {}, {}
    for line in sys.stdin:
        request = json.loads(line)
        path = request["model"]
        if path not in models:
            models[path] = og.Model(path)
            tokenizers[path] = og.Tokenizer(models[path])
        model, tokenizer = models[path], tokenizers[path]
        ids = np.asarray(tokenizer.encode(request["prompt"]), dtype=np.int32)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + request["max_new_tokens"])
        if request["mode"] == "ngram":
            params.set_speculative_options(ngram_size=request["ngram_size"], max_draft_tokens=request["max_draft_tokens"])
        elif request["mode"] == "draft":
            params.set_speculative_options(max_draft_tokens=request["max_draft_tokens"])
        generator = og.Generator(model, params)
        began = time.perf_counter()
        generator.append_tokens(ids[None, :])
        start = generator.token_count()  # forces the prefill to finish
        prefilled = time.perf_counter()
        while not generator.is_done() and generator.token_count() < start + request["max_new_tokens"]:
            generator.generate_next_token()
        done = time.perf_counter()
        new_tokens = generator.token_count() - start
        stats = dict(generator.get_speculative_stats()) if request["mode"] != "plain" else {}
        sequence = [int(t) for t in generator.get_sequence(0)][start:]
        result = {
            "prompt_tokens": int(len(ids)), "new_tokens": int(new_tokens), "prefill_ms": (prefilled - began) * 1e3,
            "decode_s": done - prefilled, "tokens_per_s": new_tokens / (done - prefilled),
            "acceptance_rate": stats.get("acceptance_rate"),
            "target_passes": stats.get("target_forward_passes"),
            "tokens": sequence,
        }
        print(json.dumps(result), flush=True)
        del generator


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--make-spec":
        make_spec(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        serve()
