package dev.edgespec.core

/** Graph input/output names: a port of edge_spec/names.py (the exporter's contract). */
object Names {
    const val INPUT_IDS = "input_ids"
    const val HIDDEN_IN = "hidden_in"
    const val KV_LEN = "kv_len"
    const val LOGIT_POSITIONS = "logit_positions"
    const val LOGITS = "logits"
    const val HIDDEN_OUT = "hidden_out"

    fun pastKey(layer: Int) = "past_key.$layer"
    fun pastValue(layer: Int) = "past_value.$layer"
    fun newKey(layer: Int) = "new_key.$layer"
    fun newValue(layer: Int) = "new_value.$layer"

    fun stageInputs(embed: Boolean, head: Boolean, layers: IntRange): List<String> {
        val names = mutableListOf(if (embed) INPUT_IDS else HIDDEN_IN)
        if (!layers.isEmpty()) names.add(KV_LEN)
        if (head) names.add(LOGIT_POSITIONS)
        for (layer in layers) { names.add(pastKey(layer)); names.add(pastValue(layer)) }
        return names
    }

    fun stageOutputs(head: Boolean, layers: IntRange): List<String> {
        val names = mutableListOf(if (head) LOGITS else HIDDEN_OUT)
        for (layer in layers) { names.add(newKey(layer)); names.add(newValue(layer)) }
        return names
    }
}
