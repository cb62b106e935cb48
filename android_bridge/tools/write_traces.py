"""Golden traces from the Python runtime (the reference) for the Kotlin conformance tests.

    python android_bridge/tools/write_traces.py OUT_DIR [--no-real]

Writes JSON files into OUT_DIR:
  rng.json         np.random.default_rng(seed).random() streams (the uniform stream definition)
  sampling.json    process_logits / sample cases: logits, config, probabilities, drawn tokens
  verify.json      verify_greedy / verify_stochastic / verify_deterministic cases
  gamma.json       GammaController decisions for fixed cost tables and outcomes
  tok_<name>.json  tokenizer cases: text -> ids (with and without special tokens) -> decoded text,
                   plus decodes of random id sequences; the tokenizer.json beside it
  model_<name>.json  a bundle path, prompt ids, logits, and generations per (drafter, γ, sampling):
                   emitted tokens, per-round drafted/accepted counts, the uniforms consumed
Tiny random-weight bundles are built with tests/tiny.py (llama with a draft model and layer skip,
qwen2); the real one is tests/real.py's smollm2-fp32 (SmolLM2-135M from $EDGE_SPEC_MODELS).
The Qwen2 tokenizer comes from any qwen bundle present, else from the official GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

from edge_spec.sampling import SamplingConfig, process_logits, sample  # noqa: E402
from edge_spec.verify import verify_deterministic, verify_greedy, verify_stochastic  # noqa: E402


def log(message: str) -> None:
    print(f"write_traces: {message}", file=sys.stderr, flush=True)


def dump(path: Path, data) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))


class RecordingRng:
    """np.random.default_rng(seed) that records every uniform drawn (the loop only calls random())."""

    def __init__(self, seed):
        self.inner = np.random.default_rng(seed)
        self.drawn: list[float] = []

    def random(self):
        u = float(self.inner.random())
        self.drawn.append(u)
        return u


# -- pure functions -----------------------------------------------------------------------------


def rng_traces() -> list[dict]:
    seeds = [0, 1, 7, 42, 123456789, 2**32 - 1, 2**32, 2**63 - 1]
    return [{"seed": str(s), "uniforms": np.random.default_rng(s).random(64).tolist()} for s in seeds]


def sampling_traces() -> list[dict]:
    gen = np.random.default_rng(2024)
    configs = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (0.8, 0, 0.9), (0.8, 40, 0.95), (1.0, 1, 1.0), (2.0, 0, 0.5)]
    cases = []
    for vocab in (7, 50, 400, 10000):
        for temperature, top_k, top_p in configs:
            logits = (gen.standard_normal(vocab) * 3.0).astype(np.float32)
            if vocab <= 50:
                logits[3] = logits[1]  # ties at the cut
            config = SamplingConfig(temperature, top_k, top_p)
            probs = process_logits(logits, config)
            seed = int(gen.integers(0, 2**31))
            rng = np.random.default_rng(seed)
            draws = [sample(probs, rng) for _ in range(20)]
            nonzero = np.flatnonzero(probs)
            cases.append({
                "logits": logits.tolist(), "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "nonzero": nonzero.tolist(), "probs": probs[nonzero].tolist(), "draws": draws,
            })
    return cases


def verify_traces() -> list[dict]:
    gen = np.random.default_rng(99)
    cases = []
    for i in range(60):
        vocab, gamma = int(gen.integers(3, 40)), int(gen.integers(0, 6))
        sharp = 1.0 + 3.0 * gen.random()
        p = process_logits(gen.standard_normal((gamma + 1, vocab)) * sharp, SamplingConfig(1.0))
        q = process_logits(gen.standard_normal((gamma, vocab)) * sharp, SamplingConfig(1.0)) if gamma else np.zeros((0, vocab))
        if i % 3 == 0 and gamma:
            q = 0.5 * q + 0.5 * p[:gamma]  # closer draft: more acceptances
        seed = int(gen.integers(0, 2**31))
        draft = np.array([sample(q[j], np.random.default_rng(seed + j)) for j in range(gamma)], dtype=np.int64)
        logits = gen.standard_normal((gamma + 1, vocab)).astype(np.float32)
        # The greedy case drafts the argmax for a prefix, then diverges.
        greedy_draft = np.argmax(logits[:gamma], axis=-1) if gamma else np.zeros(0, dtype=np.int64)
        if gamma and i % 2:
            greedy_draft[int(gen.integers(0, gamma))] = (greedy_draft[0] + 1) % vocab
        cases.append({
            "p": p.tolist(), "q": q.tolist(), "draft": draft.tolist(), "seed": seed,
            "stochastic": list(verify_stochastic(p, q, draft, np.random.default_rng(seed))),
            "deterministic": list(verify_deterministic(p, draft, np.random.default_rng(seed))),
            "logits": logits.tolist(), "greedy_draft": greedy_draft.tolist(), "greedy": list(verify_greedy(logits, greedy_draft)),
        })
    return cases


def gamma_traces() -> list[dict]:
    from runtime.gamma import CostModel, GammaConfig, GammaController

    gen = np.random.default_rng(5)
    cases = []
    for i in range(12):
        costs = CostModel()
        target = {b: 0.01 * (1.0 + 0.05 * b * (1 + i % 3)) for b in (1, 2, 3, 5, 9)}
        for block, seconds in target.items():
            costs.record_target(block, seconds)
        step_cost = [0.0, 0.001, 0.004, 0.02][i % 4]
        config = GammaConfig(probe_first=2, probe_every=5, max_failed_probes=[2, 3, 100][i % 3], max_loss=[0.01, 0.05, 1.0, 0.2][i % 4])
        controller = GammaController(config, costs, prior_alpha=[0.6, 0.2, 0.9][i % 3])
        horizon = [64, 128, 256][i % 3]
        controller.start(horizon)
        rounds = []
        replay = [0.0, 0.02, 0.2][(i // 4) % 3]
        for _ in range(40):
            gamma = controller.choose(step_cost, replay)
            accepted = int(gen.integers(0, gamma + 1)) if gamma else 0
            # Rounds that take longer than predicted (every other case 3x) run the loss ledger dry.
            slow = 3.0 if i % 2 else 1.0
            seconds = float((gamma * step_cost + target[min(target, key=lambda b: abs(b - gamma - 1))]) * gen.uniform(0.8, 1.6) * slow)
            if gamma:
                controller.update(gamma, accepted)
                controller.record_round(seconds, accepted + 1)
            rounds.append([gamma, accepted, seconds])
        cases.append({"target_costs": {str(k): v for k, v in target.items()}, "step_cost": step_cost,
                      "prior_alpha": [0.6, 0.2, 0.9][i % 3], "probe_first": config.probe_first, "probe_every": config.probe_every,
                      "max_failed_probes": config.max_failed_probes, "max_loss": config.max_loss, "horizon": horizon, "replay": replay,
                      "rounds": rounds})
    return cases


# -- tokenizers ----------------------------------------------------------------------------------


def tokenizer_strings() -> list[str]:
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "a\r\nb\r\n\r\n", "hello", " hello", "Hello world!",
        "The quick brown fox jumps over the lazy dog.", "I'm sure you've heard they'll say it's 'fine' — we'd've.",
        "DON'T SHOUT: IT'S LOUD, WE'LL SEE", "numbers 1234567890 and 3.14159 and 1,000,000 and ٣٤٥ and ①②",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
        "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot",
        "    indented\n        more\n            most   \n", "trailing spaces    ", "   leading", "a    b     c      d",
        "x = 1;;\ny=2 ;  \n\n\tz   =   3", "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
        "SELECT * FROM t WHERE id = 5 AND name LIKE '%ab%';", "<div class=\"x\">&amp; &lt;tag&gt;</div>",
        "https://example.com/path?q=1&r=two#frag", "email: someone@example.org", "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧‍👦",
        "中文分词测试：你好，世界！", "日本語のテキスト、カタカナとひらがな。", "한국어 문장입니다.", "Ελληνικά κείμενα", "Русский текст, ёлка.",
        "العربية نص", "עברית טקסט", "हिन्दी पाठ", "ไทยภาษา", "café naïve résumé Ångström", "e\u0301 combining accent, n\u0303",
        "nbsp\u00a0here and\u3000ideographic space", "zero\u200bwidth\u200djoiner", "line\u2028sep\u2029para", "\u0085next line",
        "tab\tand\u000bvertical\u000cform feed", "mixed 中文 and English 123 ！？", "ALLCAPS lower MiXeD", "snake_case camelCase kebab-case",
        "....!!!???,,,;;;", "$$$ %%% ^^^ &&& *** ((( )))", "a'b'c 's 't 're", "'S 'T 'RE 'VE 'M 'LL 'D", "'ſ long s",
        "\u001c\u001d\u001e\u001f unit separators", "\x00\x01\x02 controls", "\U0001F600\U0001F9E0\U00010348 astral",
        "<|endoftext|>", "before<|im_start|>user\nhi<|im_end|>after", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
        "<s>hi</s><pad>", "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "2024-01-01T12:34:56Z",
        "      \n      \n", "\n \n \n", " \n\n ", "  \t\t  \n\n  x", "ends with newline\n", "ends with spaces   \n   ",
    ]
    rng = random.Random(1234)
    pieces = [
        "the", " cat", " sat", "Hello", "世界", "😀", " ", "  ", "\n", "\t", "def", "(", ")", ":", "    ", "123", "4", "'s", "'ll",
        "é", "ß", "Ω", "ж", "ع", "\u00a0", "\u3000", "{", "}", "[", "]", "=", "==", "->", "//", "#", "\"", "'", "\r\n", "x", "_",
        "<|im_end|>", "ŉ", "İ", "ﬁ", "①", "٣", "Ⅻ", "🇫🇷", "\u200b", "…", "—", "«", "»", "¿", "¡",
    ]
    generated = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(200)]
    alphabet = [chr(c) for c in list(range(32, 127)) + list(range(0xA0, 0x250)) + list(range(0x370, 0x400)) + list(range(0x4E00, 0x4E80))]
    noise = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(60)]
    whitespace = ["".join(rng.choice([" ", "\t", "\n", "\r", "\u00a0", "a", "1"]) for _ in range(rng.randint(1, 20))) for _ in range(40)]
    return fixed + generated + noise + whitespace


def tokenizer_trace(name: str, tokenizer_json: Path, out: Path) -> None:
    from tokenizers import Tokenizer

    shutil.copyfile(tokenizer_json, out / f"tok_{name}.tokenizer.json")
    tok = Tokenizer.from_file(str(tokenizer_json))
    cases = []
    for text in tokenizer_strings():
        with_special = tok.encode(text, add_special_tokens=True).ids
        plain = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text, "ids": with_special, "ids_plain": plain,
            "decoded": tok.decode(with_special, skip_special_tokens=True),
            "decoded_special": tok.decode(with_special, skip_special_tokens=False),
        })
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    decodes = []
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        decodes.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
    dump(out / f"tok_{name}.json", {"tokenizer": f"tok_{name}.tokenizer.json", "cases": cases, "decodes": decodes})
    log(f"tokenizer {name}: {len(cases)} strings, {len(decodes)} random decodes")


def qwen_tokenizer_json(out: Path) -> Path:
    from real import bundles_root

    for root in (bundles_root(), Path("/work/bundles")):
        for candidate in sorted(root.glob("qwen*/tokenizer.json")) if root.is_dir() else []:
            if (candidate.parent / "manifest.json").is_file():
                return candidate
    from transformers import AutoTokenizer

    from edge_spec.catalog import CATALOG, models_dir

    gguf = CATALOG["qwen2.5-coder-0.5b"].gguf_file
    if not (models_dir() / gguf).is_file():
        raise SystemExit(f"write_traces: needs a qwen bundle or {gguf} in {models_dir()} (shared/models/fetch.sh)")
    log("building the Qwen2 tokenizer from the GGUF")
    backend = AutoTokenizer.from_pretrained(str(models_dir()), gguf_file=gguf).backend_tokenizer
    path = out / "qwen-from-gguf.tokenizer.json"
    backend.save(str(path))
    return path


# -- models --------------------------------------------------------------------------------------


def generation_trace(engine, prompt_ids, drafter: str, gamma: int, sampling: SamplingConfig, max_new: int) -> dict:
    """Python's engine loop with a fixed γ (adaptive γ depends on measured time, so traces fix it)."""
    from runtime.loop import decode_steps

    engine.use_drafter(drafter, gamma)
    engine.target.cache.reset()
    if engine.drafter is not None:
        engine.drafter.reset()
    rng = RecordingRng(sampling.seed)
    eos = engine.tokenizer.eos_token_ids
    steps, generated = [], []
    for step in decode_steps(engine.target, engine.drafter, prompt_ids, sampling, rng, engine._controllers(max_new), engine.costs):
        steps.append({"tokens": list(step.tokens), "gamma": step.gamma, "drafted": step.n_drafted, "accepted": step.n_accepted,
                      "drafter": step.drafter})
        new = list(step.tokens)
        hit = next((i for i, t in enumerate(new) if t in eos), None)
        if hit is not None:
            new = new[: hit + 1]
        generated += new[: max_new - len(generated)]
        if hit is not None or len(generated) >= max_new:
            break
    expected = generated  # what Engine.generate returns for these settings (no stop strings)
    return {"drafter": drafter, "gamma": gamma, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "seed": sampling.seed, "max_new_tokens": max_new, "token_ids": expected,
            "steps": steps, "uniforms": rng.drawn}


def model_trace(name: str, bundle: Path, prompt: str, runs: list[tuple[str, bool]], out: Path, max_new: int, full_logits: bool) -> None:
    from runtime.engine import Engine, EngineConfig

    began = time.perf_counter()
    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    prompt_ids = engine.encode(prompt)
    engine.target.cache.reset()
    logits = engine.target.forward(prompt_ids)  # [T, V]
    rows = list(range(len(prompt_ids))) if full_logits else [len(prompt_ids) - 1]
    stride = 1 if full_logits else 97
    samples = {"rows": rows, "stride": stride, "values": [logits[r, ::stride].tolist() for r in rows]}
    engine.target.cache.reset()
    gens = []
    greedy = SamplingConfig()
    sampled = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    for drafter, stochastic in runs:
        gens.append(generation_trace(engine, prompt_ids, drafter, 3, sampled if stochastic else greedy, max_new))
    gens.append(generation_trace(engine, prompt_ids, "none", 0, SamplingConfig(temperature=1.0, seed=7), max_new))
    dump(out / f"model_{name}.json", {"bundle": str(bundle), "prompt": prompt, "prompt_ids": prompt_ids, "logits": samples,
                                      "generations": gens})
    log(f"model {name}: {len(gens)} generations in {time.perf_counter() - began:.1f}s")


def tiny_bundles(out: Path) -> dict[str, Path]:
    import torch

    import tiny

    torch.set_num_threads(1)
    root = out / "tiny"
    if root.exists():
        shutil.rmtree(root)
    tok = tiny.make_tokenizer("a")
    llama = tiny.make_llama(root / "hf-llama", tok, n_layers=4, seed=0)
    qwen2 = tiny.make_qwen2(root / "hf-qwen2", tok, n_layers=3, seed=1)
    draft = tiny.make_llama(root / "hf-draft", tok, n_layers=2, seed=5)
    bundles = {"llama": root / "llama", "qwen2": root / "qwen2"}
    # Portable graphs: the Kotlin core runs standard ONNX ops and copies new KV rows itself.
    tiny.export(llama, bundles["llama"], drafts=(str(draft), "layer-skip:1"), attention="portable")
    tiny.export(qwen2, bundles["qwen2"], drafts=(str(draft), "layer-skip:2"), attention="portable")
    return bundles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--no-real", action="store_true", help="skip the SmolLM2/Qwen parts (says so in index.json)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    dump(out / "rng.json", rng_traces())
    dump(out / "sampling.json", sampling_traces())
    dump(out / "verify.json", verify_traces())
    dump(out / "gamma.json", gamma_traces())
    log(f"pure traces in {time.perf_counter() - began:.1f}s")

    import tiny

    bundles = tiny_bundles(out)
    log(f"tiny bundles in {time.perf_counter() - began:.1f}s")
    tokenizer_trace("tiny", bundles["llama"] / "tokenizer.json", out)
    prompt = tiny.PROMPT + " the quick brown fox jumps over the"
    both = lambda drafters: [(d, s) for d in drafters for s in (False, True)]  # noqa: E731
    model_trace("tiny_llama", bundles["llama"], prompt, both(["none", "model", "layer-skip", "lookup", "auto"]), out, 24, True)
    model_trace("tiny_qwen2", bundles["qwen2"], prompt, both(["model", "layer-skip", "auto"]), out, 24, True)
    index = {"tiny": True, "real": not args.no_real}
    if not args.no_real:
        from real import bundle

        smollm2 = bundle("smollm2-fp32")
        tokenizer_trace("smollm2", smollm2 / "tokenizer.json", out)
        tokenizer_trace("qwen2", qwen_tokenizer_json(out), out)
        code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
        # A 135M model on a 2-core CI box: few, short runs (greedy plain/layer-skip/auto, sampled layer-skip).
        runs = [("none", False), ("layer-skip", False), ("auto", False), ("layer-skip", True)]
        model_trace("smollm2", smollm2, code, runs, out, 12, False)
    dump(out / "index.json", index)
    log(f"done in {time.perf_counter() - began:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
