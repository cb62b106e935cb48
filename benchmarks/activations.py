"""The largest |activation| a checkpoint produces, per kind, on a few prompts (transformers fp32):
does a float16 graph hold it? float16's largest value is 65504.

    python -m benchmarks activations MODEL [--out FILE.json]

Per projection and norm, the largest |input| and |output|; for the residual stream, its largest
|value| and the largest per-token mean square (what an RMS norm computed in float16 squares)."""

from __future__ import annotations

from collections import defaultdict

PROMPTS = (
    "def quicksort(xs):\n    ",
    "The three primary colors are",
    "Write a Python function that checks whether a number is prime.",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
)
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm", "post_attention_layernorm", "norm", "lm_head")


def measure(model_spec: str) -> dict:
    import torch

    from export.sources import load_checkpoint

    checkpoint = load_checkpoint(model_spec)
    model, tokenizer = checkpoint.model.eval(), checkpoint.tokenizer
    stats: dict[str, float] = defaultdict(float)

    def hook(kind):
        def record(module, inputs, output):
            output = output[0] if isinstance(output, tuple) else output
            stats[kind + ".in"] = max(stats[kind + ".in"], inputs[0].abs().max().item())
            stats[kind + ".out"] = max(stats[kind + ".out"], output.abs().max().item())
        return record

    for name, module in model.named_modules():
        if name.split(".")[-1] in KINDS:
            module.register_forward_hook(hook(name.split(".")[-1]))
    residual = mean_square = 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            for h in model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states:
                residual = max(residual, h.abs().max().item())
                mean_square = max(mean_square, h.pow(2).mean(-1).max().item())
    return {"model": model_spec, "residual_max_abs": residual, "residual_max_mean_square": mean_square, **dict(sorted(stats.items()))}
