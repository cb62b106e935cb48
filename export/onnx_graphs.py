"""Trace a StageModule to an ONNX graph with a variable block length T."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from edge_spec import names
from export.static_cache import StageModule


class _NamedInputs(nn.Module):
    """Presents exactly the stage's named inputs to the exporter (a head-only stage has no
    kv_len, a stage without the head has no logit_positions), mapped onto StageModule.forward."""

    def __init__(self, stage: StageModule, input_names: list[str]):
        super().__init__()
        self.stage = stage
        self.input_names = input_names

    def forward(self, *args):
        by_name = dict(zip(self.input_names, args))
        x = by_name.get(names.INPUT_IDS, by_name.get(names.HIDDEN_IN))
        past = args[len(self.input_names) - 2 * len(self.stage.layers) :] if len(self.stage.layers) else ()
        return self.stage(x, by_name.get(names.KV_LEN), by_name.get(names.LOGIT_POSITIONS), *past)


def export_stage(stage: StageModule, layers: range, max_context: int, hidden_size: int) -> onnx.ModelProto:
    """Trace one stage and return the ONNX model (weights inline, possibly > 2 GB: save with
    external data)."""
    input_names = names.stage_inputs(stage.embed, stage.head, layers)
    output_names = names.stage_outputs(stage.head, layers, stage.attention)
    block = 3  # any T > 1 so the exporter keeps T symbolic
    kv_len = 2
    example = {
        names.INPUT_IDS: torch.zeros((1, block), dtype=torch.int64),
        names.HIDDEN_IN: torch.zeros((1, block, hidden_size), dtype=torch.float32),
        names.KV_LEN: torch.tensor([kv_len], dtype=torch.int64),
        names.LOGIT_POSITIONS: torch.arange(block, dtype=torch.int64),
    }
    kv_shape = (1, stage.n_kv_heads, max_context, stage.head_dim)
    args = []
    for name in input_names:
        args.append(example[name] if name in example else torch.zeros(kv_shape, dtype=torch.float32))
    dynamic_axes = {names.INPUT_IDS: {1: "T"}, names.HIDDEN_IN: {1: "T"}, names.LOGIT_POSITIONS: {0: "N"}}
    dynamic_axes.update({n: {1: "N"} for n in (names.LOGITS,)})
    dynamic_axes.update({names.HIDDEN_OUT: {1: "T"}})
    dynamic_axes.update({n: {2: "T"} for n in output_names if n.startswith("new_")})
    dynamic_axes = {k: v for k, v in dynamic_axes.items() if k in input_names or k in output_names}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "stage.onnx"
        with torch.no_grad():
            torch.onnx.export(
                _NamedInputs(stage, input_names).eval(),
                tuple(args),
                str(path),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=20,  # ≥ 18 so reductions take axes as inputs, as the int4 quantizer (opset 21) expects
                do_constant_folding=True,
                dynamo=False,
                custom_opsets={"com.microsoft": 1},
            )
        model = onnx.load(str(path), load_external_data=True)
    got_inputs = [i.name for i in model.graph.input]
    if got_inputs != input_names:
        raise RuntimeError(f"exported graph inputs {got_inputs} differ from the contract {input_names}")
    return model
