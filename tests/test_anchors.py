"""The side-by-side runner's parsing of llama.cpp logs and its summary (benchmarks/anchors)."""

import pytest

from benchmarks.anchors.run_anchors import parse_completion_log, parse_speculative_log, report, sampling_args, summarize

COMPLETION_LOG = """
llama_perf_sampler_print:    sampling time =      12.00 ms /   173 runs   (    0.07 ms per token, 14416.67 tokens per second)
llama_perf_context_print:        load time =     900.00 ms
llama_perf_context_print: prompt eval time =    2000.00 ms /    45 tokens (   44.44 ms per token,    22.50 tokens per second)
llama_perf_context_print:        eval time =    6350.00 ms /   127 runs   (   50.00 ms per token,    20.00 tokens per second)
"""

SPECULATIVE_LOG = """
0.05.100.000 I encoded   45 tokens in    2.000 seconds, speed:   22.500 t/s
0.09.100.000 I decoded  128 tokens in    4.000 seconds, speed:   32.000 t/s
0.09.100.100 I n_draft   = 3
0.09.100.200 I n_predict = 128
0.09.100.300 I n_drafted = 90
0.09.100.400 I n_accept  = 72
"""


def test_completion_log_gives_decode_rate_not_prompt_rate():
    row = parse_completion_log(COMPLETION_LOG)
    assert row["tokens_per_s"] == pytest.approx(127 / 6.35) and row["prefill_ms"] == 2000.0 and row["new_tokens"] == 128


def test_speculative_log_gives_rate_and_acceptance():
    row = parse_speculative_log(SPECULATIVE_LOG)
    assert row["tokens_per_s"] == pytest.approx(32.0) and row["acceptance_rate"] == pytest.approx(0.8)
    assert row["prefill_ms"] == pytest.approx(2000.0) and row["drafted"] == 90


def test_a_log_without_timings_is_an_error_that_shows_the_log():
    with pytest.raises(RuntimeError, match="no eval timing"):
        parse_completion_log("error: failed to load model")
    with pytest.raises(RuntimeError, match="failed to initialize"):
        parse_speculative_log("E failed to initialize speculative decoding")


def _runs(category: str, speeds: dict) -> tuple[list[dict], list[str]]:
    """Rows as run_anchors records them, from {prompt: {config: tokens/s}}, and the configs."""
    runs = [{"category": category, "prompt_id": pid, "config": config, "tokens_per_s": v, "acceptance_rate": None}
            for pid, row in speeds.items() for config, v in row.items()]
    return runs, list(next(iter(speeds.values())))


def test_summary_ratios_are_per_prompt_medians():
    runs, configs = _runs("code", {"p1": {"edge-plain": 20.0, "edge-auto": 30.0, "llama-ngram": 25.0},
                                   "p2": {"edge-plain": 18.0, "edge-auto": 20.0, "llama-ngram": 40.0},
                                   "p3": {"edge-plain": 19.0, "edge-auto": 38.0, "llama-ngram": 19.0}})
    summary = summarize(runs, configs)
    assert summary["code"]["llama-ngram"]["tokens_per_s"] == 25.0
    assert summary["code"]["llama-ngram"]["edge_auto_over_this"] == pytest.approx(1.2)  # median of 1.2, 0.5, 2.0
    table = report({"summary": summary, "runs": runs, "configs": configs, "max_new_tokens": 128})
    assert any(line.startswith("| llama-ngram | 25.0") and "| 1.20 |" in line for line in table)


def test_summary_compares_with_the_fastest_llama_configuration_of_each_prompt():
    runs, configs = _runs("edit", {"p1": {"edge-auto": 30.0, "llama-plain": 22.0, "llama-ngram": 25.0},
                                   "p2": {"edge-auto": 20.0, "llama-plain": 15.0, "llama-ngram": 40.0},
                                   "p3": {"edge-auto": 38.0, "llama-plain": 40.0, "llama-ngram": 19.0}})
    best = summarize(runs, configs)["edit"]["llama-best"]
    assert best["tokens_per_s"] == 40.0 and best["runs"] == 3
    assert best["edge_auto_over_this"] == pytest.approx(38 / 40)  # median of 1.2, 0.5, 0.95
    table = report({"summary": summarize(runs, configs), "runs": runs, "configs": configs, "max_new_tokens": 128})
    assert "| best llama.cpp per prompt | 40.0 | – | 0.95 | – |" in table


def test_a_second_bundle_is_compared_with_the_same_best_llama_configuration():
    """--bundle2: edge2-auto's per-prompt ratio to each prompt's fastest llama.cpp run, beside edge-auto's."""
    runs, configs = _runs("code", {"p1": {"edge-auto": 30.0, "edge2-auto": 45.0, "llama-plain": 22.0, "llama-ngram": 25.0},
                                   "p2": {"edge-auto": 20.0, "edge2-auto": 20.0, "llama-plain": 15.0, "llama-ngram": 40.0},
                                   "p3": {"edge-auto": 38.0, "edge2-auto": 60.0, "llama-plain": 40.0, "llama-ngram": 19.0}})
    best = summarize(runs, configs)["code"]["llama-best"]
    assert best["edge_auto_over_this"] == pytest.approx(38 / 40)
    assert best["edge2_auto_over_this"] == pytest.approx(1.5)  # median of 1.8, 0.5, 1.5
    table = report({"summary": summarize(runs, configs), "runs": runs, "configs": configs, "max_new_tokens": 128})
    assert "| best llama.cpp per prompt, edge2-auto ÷ it | 40.0 | – | 1.50 | – |" in table


def test_llama_samples_as_edge_spec_does():
    """Greedy stays greedy; at a temperature only the temperature and then top-p samplers run
    (llama.cpp's default chain would apply top-k 40 and min-p, and top-p before temperature)."""
    assert sampling_args() == ["--temp", "0", "--seed", "0"]
    args = sampling_args(0.7, 0.9, 3)
    assert args[args.index("--samplers") + 1] == "temperature;top_p"
    assert args[args.index("--temp") + 1] == "0.7" and args[args.index("--top-p") + 1] == "0.9" and args[args.index("--seed") + 1] == "3"


def test_at_a_temperature_runs_pair_by_prompt_and_seed():
    runs = [{"category": "code", "prompt_id": "p1", "seed": seed, "config": config, "tokens_per_s": speed, "acceptance_rate": None}
            for seed, row in enumerate([{"edge-auto": 30.0, "llama-ngram": 20.0}, {"edge-auto": 10.0, "llama-ngram": 40.0}])
            for config, speed in row.items()]
    entry = summarize(runs, ["edge-auto", "llama-ngram"])["code"]
    assert entry["llama-ngram"]["runs"] == 2
    assert entry["llama-ngram"]["edge_auto_over_this"] == pytest.approx((1.5 + 0.25) / 2)  # seed 0 with seed 0, 1 with 1
    table = report({"summary": {"code": entry}, "runs": runs, "configs": ["edge-auto", "llama-ngram"], "max_new_tokens": 64,
                    "sampling": {"temperature": 0.7, "top_p": 0.9, "seeds": 2}})
    assert table[0] == "### code (2 prompt-and-seed pairs, 64 new tokens, temperature 0.7, top-p 0.9)"
