"""`python -m benchmarks bench` (benchmarks/bench/) on a tiny bundle: the results schema and its
arithmetic, the committed summary, the report and plots, prompts-file validation, and the
--micro pass timings and bandwidth floor."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench import BenchConfig, PromptsError, load_prompts, run_bench
from benchmarks.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "lookup", "model")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Two categories, two prompts each, raw and chat, short enough for the tiny bundle's 64 tokens.
PROMPTS = [
    {"id": "story-1", "category": "story", "prompt": "the quick brown fox jumps over the lazy dog and"},
    {"id": "story-2", "category": "story", "messages": [{"role": "user", "content": "the cat sat on the mat"}]},
    {"id": "code-1", "category": "code", "prompt": "def print value return self value for x in list"},
    {"id": "code-2", "category": "code", "messages": [{"role": "user", "content": "import dict class self"}]},
]
RUN_FIELDS = {"mode", "category", "prompt_id", "repeat", "tokens_per_s", "prefill_ms", "acceptance_rate", "alpha",
              "tokens_per_pass", "tokens_per_pass_predicted", "gamma_histogram", "cost_ratio", "target_pass_ms",
              "speedup", "bound", "bound_fraction", "python_overhead_ms_per_pass", "identical_to_plain"}


def _write_prompts(path: Path, items) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def _valid_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, (path, image.shape)


@pytest.fixture(scope="module")
def bench_out(llama_bundle, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bench")
    prompts = _write_prompts(folder / "prompts.jsonl", PROMPTS)
    out = folder / "out"
    argv = ["bench", str(llama_bundle), "--prompts", str(prompts), "--modes", ",".join(MODES), "--repeat", "2",
            "--max-new-tokens", "8", "--gamma", "2", "--threads", "1", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_results_runs(bench_out):
    results = json.loads((bench_out / "results.json").read_text())
    runs = results["runs"]
    assert sorted((r["mode"], r["prompt_id"], r["repeat"]) for r in runs) == sorted(
        (m, p["id"], r) for m in MODES for p in PROMPTS for r in range(2))
    category = {p["id"]: p["category"] for p in PROMPTS}
    plain = {(r["prompt_id"], r["repeat"]): r for r in runs if r["mode"] == "plain"}
    for run in runs:
        assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
        assert run["category"] == category[run["prompt_id"]]
        assert 1 <= run["new_tokens"] <= 8 and run["tokens_per_s"] > 0 and run["prefill_ms"] > 0
        # Every round is accounted for: γ histogram and per-γ rounds both sum to the target passes.
        assert sum(run["gamma_histogram"].values()) == run["target_passes"]
        assert {g: row["rounds"] for g, row in run["rounds_by_gamma"].items()} == run["gamma_histogram"]
        assert sum(row["tokens"] for row in run["rounds_by_gamma"].values()) >= run["new_tokens"]
        paired = plain[run["prompt_id"], run["repeat"]]
        assert run["speedup"] == pytest.approx(run["tokens_per_s"] / paired["tokens_per_s"])
        if "1" in run["target_pass_ms"]:  # drift divided out through the same 1-token pass
            assert run["speedup_same_pass_speed"] == pytest.approx(
                run["speedup"] * run["target_pass_ms"]["1"] / paired["target_pass_ms"]["1"])
        else:
            assert run["speedup_same_pass_speed"] is None
        assert run["identical_to_plain"] is True  # fp32 greedy: speculation changes nothing
        assert run["ort_ms_per_pass"] > 0 and run["python_overhead_ms_per_pass"] >= 0
        if run["mode"] == "plain":
            assert run["gamma_histogram"] == {"0": run["target_passes"]} and run["bound"] == 1.0
    for run in (r for r in runs if r["mode"] == "model"):
        # γ fixed at 2: the draft model drafts every round (fewer only at the context's end).
        assert set(run["gamma_histogram"]) <= {"1", "2"} and run["cost_ratio"] > 0
        assert 0 <= run["alpha"] <= 1 and run["tokens_per_pass"] >= 1 and run["bound"] > 0
        assert run["bound_fraction"] == pytest.approx(run["speedup"] / run["bound"])
        assert run["bound_measured_verify_fraction"] == pytest.approx(run["speedup"] / run["bound_measured_verify"])
        assert "3" in run["target_pass_ms"]
        # Each round: γ draft forwards, the first over the pending token, plus at most one catch-up
        # forward; the draft's prompt prefill lies outside the decode window.
        drafted = sum(int(g) * n for g, n in run["gamma_histogram"].items())
        assert drafted <= run["draft_model_forwards"] <= drafted + run["target_passes"]
        # Equal when no catch-up forward ran; the two are summed in different orders.
        assert run["cost_ratio_per_drafted_token"]["model"] >= run["cost_ratio"] * (1 - 1e-12)
    assert all(r["draft_model_forwards"] == 0 for r in runs if r["mode"] != "model")
    assert "1" in results["verify_cost"] and "3" in results["verify_cost"]


def test_results_summary(bench_out):
    results = json.loads((bench_out / "results.json").read_text())
    runs, summary = results["runs"], results["summary"]
    assert list(summary) == list(MODES)
    for mode in MODES:
        assert sorted(summary[mode]) == ["code", "story"]
        for category, s in summary[mode].items():
            rows = [r for r in runs if r["mode"] == mode and r["category"] == category]
            plain_rows = [r for r in runs if r["mode"] == "plain" and r["category"] == category]
            assert s["runs"] == 4
            assert s["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in rows))
            per_prompt = [statistics.median(r["speedup"] for r in rows if r["prompt_id"] == p) for p in {r["prompt_id"] for r in rows}]
            assert s["speedup"] == pytest.approx(statistics.median(per_prompt))
            same_speed = [statistics.median(v) for v in ([r["speedup_same_pass_speed"] for r in rows if r["prompt_id"] == p
                                                          and r["speedup_same_pass_speed"] is not None] for p in {r["prompt_id"] for r in rows}) if v]
            assert s["speedup_same_pass_speed"] == (pytest.approx(statistics.median(same_speed)) if same_speed else None)
            assert s["speedup_ratio_of_medians"] == pytest.approx(
                statistics.median(r["tokens_per_s"] for r in rows) / statistics.median(r["tokens_per_s"] for r in plain_rows))
            assert s["tokens_per_s_spread"]["min"] <= s["tokens_per_s"] <= s["tokens_per_s_spread"]["max"]
    for s in summary["plain"].values():
        assert s["speedup"] == 1.0 and s["speedup_ratio_of_medians"] == 1.0 and s["speedup_same_pass_speed"] == pytest.approx(1.0)
    assert "median over prompts" in results["definitions"]["speedup"]


def test_committed_summary(bench_out, tmp_path):
    """summary.json: results.json without its runs, plus the spreads BENCHMARKS.md cites from them;
    `python -m benchmarks summary` writes the same from a results.json alone."""
    results = json.loads((bench_out / "results.json").read_text())
    summary = json.loads((bench_out / "summary.json").read_text())
    assert "runs" not in summary and summary["summary"] == results["summary"] and summary["verify_cost"] == results["verify_cost"]
    runs = results["runs"]
    for mode in MODES:
        assert list(summary["pairs"][mode]) == ["code", "story", "all"]
        for category, pair in summary["pairs"][mode].items():
            rows = [r for r in runs if r["mode"] == mode and category in (r["category"], "all")]
            spread = pair["speedup_spread"]
            assert spread["min"] == min(r["speedup"] for r in rows) and spread["max"] == max(r["speedup"] for r in rows)
            assert spread["min"] <= spread["q1"] <= spread["q3"] <= spread["max"]
            t1 = [r["target_pass_ms"]["1"] for r in rows if "1" in r["target_pass_ms"]]  # none where every round drafted
            assert (pair["target_t1_ms"] and pair["target_t1_ms"]["median"]) == (pytest.approx(statistics.median(t1)) if t1 else None)
            assert pair["sequences_under_1_1_tokens_per_pass"] == sum(r["tokens_per_pass"] < 1.1 for r in rows)
            assert sum(pair["drafter_rounds"].values()) == sum(r["target_passes"] for r in rows)
    assert set(summary["speedup_by_prompt"]) == set(MODES) - {"plain"}
    for mode, prompts in summary["speedup_by_prompt"].items():
        assert prompts == {p["id"]: [r["speedup"] for r in sorted(runs, key=lambda r: r["repeat"]) if r["mode"] == mode and r["prompt_id"] == p["id"]]
                           for p in PROMPTS}
    folder = tmp_path / "again"
    folder.mkdir()
    (folder / "results.json").write_text((bench_out / "results.json").read_text())
    done = subprocess.run([sys.executable, "-m", "benchmarks", "summary", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (folder / "summary.json").read_text() == (bench_out / "summary.json").read_text()


def test_report_and_plots(bench_out):
    report = (bench_out / "report.md").read_text()
    for mode in MODES:
        assert f"| {mode} | code |" in report and f"| {mode} | story |" in report
    assert "ratio of medians" in report and "Verify cost" in report
    for name in ("tokens_per_s.png", "alpha_tokens_vs_gamma.png", "verify_cost.png"):
        _valid_png(bench_out / name)
        assert f"({name})" in report


def test_micro(llama_bundle, bench_out, capsys):
    assert main(["bench", str(llama_bundle), "--micro", "--threads", "1", "--out", str(bench_out)]) == 0
    micro = json.loads((bench_out / "micro.json").read_text())
    assert [row["T"] for row in micro["target_pass"]] == list(range(1, 17))
    assert all(row["ms_min"] <= row["ms"] <= row["ms_max"] and row["ms"] > 0 for row in micro["target_pass"])
    assert micro["kv_len"] == 64 - 16 - 1  # 512 asked, clamped to the tiny bundle's context
    assert set(micro["draft_step"]) == {"draft", "layer_skip"}
    assert all(row["ms"] > 0 and row["cost_ratio"] > 0 for row in micro["draft_step"].values())
    manifest = json.loads((llama_bundle / "manifest.json").read_text())
    stage_files = [f for key in manifest["models"]["target"]["stages"]
                   for f in [manifest["stages"][key]["file"], *manifest["stages"][key]["data_files"]]]
    memory = micro["memory"]
    assert memory["weight_bytes"] == sum((llama_bundle / f).stat().st_size for f in stage_files)
    assert memory["floor_ms"] > 0 and memory["copy_gb_s"] > 0.1
    assert memory["gap"] == pytest.approx(micro["target_pass"][0]["ms"] / memory["floor_ms"])
    # The report of the folder now holds the bench and the micro benchmark.
    report = (bench_out / "report.md").read_text()
    assert "Micro benchmark" in report and "| story |" in report and "the floor" in report
    assert report in capsys.readouterr().out
    _valid_png(bench_out / "verify_cost.png")


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "category": "x", "prompt": "hi"}', '{"id": "b", "category": "x", "prompt": '], "line 2: not valid JSON"),
    (['{"category": "x", "prompt": "hi"}'], "line 1: missing field 'id'"),
    (['{"id": "a", "prompt": "hi"}'], "line 1: missing field 'category'"),
    (['{"id": "a", "category": "x"}'], "line 1: give exactly one of 'prompt' (raw text), 'messages' (chat) or 'turns' (a conversation), not none"),
    (['{"id": "a", "category": "x", "prompt": "hi", "messages": []}'], "not both"),
    (['{"id": "a", "category": "x", "messages": [{"role": "user"}]}'], "line 1: messages[0] must be an object"),
    (['{"id": "a", "category": "x", "messages": []}'], "'messages' must be a non-empty list"),
    (['["a", "x", "hi"]'], "line 1: expected a JSON object"),
    (['{"id": "a", "category": "", "prompt": "hi"}'], "'category' must be a non-empty string"),
    (['{"id": "a", "category": "x", "prompt": "hi"}', "", '{"id": "a", "category": "y", "prompt": "ho"}'], "appears twice"),
    ([""], "has no prompts"),
])
def test_prompts_file_errors(tmp_path, lines, message):
    path = _write_prompts(tmp_path / "p.jsonl", lines)
    with pytest.raises(PromptsError) as error:
        load_prompts(str(path))
    assert message in str(error.value) and str(path) in str(error.value)


def test_prompts_specs(tmp_path):
    with pytest.raises(PromptsError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PromptsError, match="positive integer"):
        load_prompts("humaneval:zero")
    a = _write_prompts(tmp_path / "a.jsonl", PROMPTS[:2])
    b = _write_prompts(tmp_path / "b.jsonl", PROMPTS[2:])
    prompts = load_prompts(f"{a},{b}")
    assert [p.id for p in prompts] == [p["id"] for p in PROMPTS]
    assert prompts[0].prompt == PROMPTS[0]["prompt"] and prompts[0].messages is None
    assert prompts[1].messages == tuple(PROMPTS[1]["messages"]) and prompts[1].prompt is None


@pytest.mark.parametrize("name, category", [("edit.jsonl", "edit"), ("prose.jsonl", "prose")])
def test_shipped_prompt_sets(name, category):
    prompts = load_prompts(str(ROOT / "benchmarks" / "prompts" / name))
    assert len(prompts) == 10 and {p.category for p in prompts} == {category}
    assert all(p.messages and p.messages[-1]["role"] == "user" for p in prompts)


def test_cli_prompt_errors(llama_bundle, tmp_path, capsys):
    bad = _write_prompts(tmp_path / "bad.jsonl", ['{"id": "a", "category": "x"}'])
    assert main(["bench", str(llama_bundle), "--prompts", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "line 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused by argparse, before the prompts are read
        main(["bench", str(llama_bundle), "--prompts", str(bad), "--gamma", "two", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "--gamma" in capsys.readouterr().err
    assert main(["bench", str(llama_bundle), "--prompts", str(bad), "--modes", "plain,copy", "--out", str(tmp_path / "out")]) == 2
    assert "unknown mode(s) ['copy']" in capsys.readouterr().err
    long = load_prompts(str(_write_prompts(tmp_path / "long.jsonl", [{"id": "long-one", "category": "x", "prompt": "the cat " * 80}])))
    with pytest.raises(PromptsError, match="'long-one' has .* max context is 64"):
        run_bench(llama_bundle, long, BenchConfig(modes=("plain",), max_new_tokens=2))
    assert not (tmp_path / "out").exists()


def test_bench_module_is_light():
    """The runtime loads bench without matplotlib: plots import it only when drawn."""
    script = "import sys, benchmarks.bench, runtime.__main__\nprint('matplotlib' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_ab_passes_cli(llama_bundle, tmp_path):
    """`python -m benchmarks ab`: both bundles' passes timed, a ratio per pass, JSON written;
    the draft step is compared only when both bundles have a draft model."""
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "ab", str(llama_bundle), str(llama_bundle), "--blocks", "1,3", "--kv-len", "8",
         "--repeats", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["passes"]) == {"T=1", "T=3", "draft"}
    for row in result["passes"].values():
        assert row["old_ms"] > 0 and row["new_ms"] > 0
        assert row["new_over_old"] == pytest.approx(row["new_ms"] / row["old_ms"])
    assert "T=3: old" in done.stdout


def test_context_curve_cli(llama_bundle, tmp_path):
    """`python -m benchmarks context_curve`: each bundle timed in its own process every round,
    kv_lens past a bundle's context skipped, the median of the rounds written; a folder that is
    not a bundle is refused in one line before anything runs."""
    out = tmp_path / "curve.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "context_curve", str(llama_bundle), "--kv-lens", "4,8,100000",
                           "--blocks", "1,2", "--repeats", "2", "--rounds", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())["bundles"][str(llama_bundle)]
    assert set(row["ms"]) == {"4/1", "4/2", "8/1", "8/2"} and len(row["rounds"]) == 2
    assert all(row["ms"][k] == pytest.approx(statistics.median(r[k] for r in row["rounds"])) for k in row["ms"])
    refused = subprocess.run([sys.executable, "-m", "benchmarks", "context_curve", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "not a bundle" in refused.stderr.strip().splitlines()[-1]


def test_spinning_cli(llama_bundle, tmp_path):
    """`python -m benchmarks spinning`: both settings timed on every pass, ratios written."""
    out = tmp_path / "spin.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "spinning", str(llama_bundle), "--repeats", "3", "--kv-len", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["passes"]) == {"T=1", "T=5", "draft"}
    for row in result["passes"].values():
        assert row["spin_stop_over_off"] == pytest.approx(row["spin_stop_ms"] / row["off_ms"])


def test_spinning_engine_restores_the_runtime_options(llama_bundle):
    import runtime.sessions as sessions
    from benchmarks.spinning import _engine

    shipped = sessions.session_options
    _engine(str(llama_bundle), spin=False)
    assert sessions.session_options is shipped


def test_conversations_temperature_and_suffix_modes(llama_bundle, tmp_path):
    conversation = {"id": "conv", "category": "multi-turn", "turns": ["the cat sat on the", "and then the cat"]}
    prompts = load_prompts(str(_write_prompts(tmp_path / "conv.jsonl", [conversation, PROMPTS[0]])))
    greedy = run_bench(llama_bundle, prompts, BenchConfig(modes=("plain", "lookup", "suffix", "auto+suffix"), max_new_tokens=6,
                                                          gamma=2, threads=1))
    rows = {(r["prompt_id"], r["mode"]): r for r in greedy["runs"]}
    assert {pid for pid, _ in rows} == {"conv#1", "conv#2", "story-1"}
    # The second turn is asked after the first turn's (plain) reply: a longer prompt.
    assert rows["conv#2", "plain"]["prompt_tokens"] > rows["conv#1", "plain"]["prompt_tokens"] + 6
    assert all(r["identical_to_plain"] for r in greedy["runs"])  # greedy, fp32: copying never changes the output
    assert greedy["summary"]["suffix"]["multi-turn"]["runs"] == 2
    sampled = run_bench(llama_bundle, prompts[1:], BenchConfig(modes=("plain", "lookup"), max_new_tokens=6, gamma=2, threads=1,
                                                               temperature=0.8, top_p=0.9, seeds=2))
    assert sampled["sampling"] == {"temperature": 0.8, "top_p": 0.9, "seeds": 2}
    assert sorted((r["mode"], r["seed"]) for r in sampled["runs"]) == [("lookup", 0), ("lookup", 1), ("plain", 0), ("plain", 1)]


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="no seeds or top-p"):
        BenchConfig(seeds=3)
    with pytest.raises(ValueError, match="top_p"):
        BenchConfig(temperature=0.7, top_p=0.0)


def test_more_prompt_specs(tmp_path):
    with pytest.raises(PromptsError, match="humaneval:A-B"):
        load_prompts("humaneval:9-3")
    edits = load_prompts("stdlib-edit:3")
    assert len(edits) == 3 and {p.category for p in edits} == {"edit"}
    assert all("```python\ndef " in p.messages[0]["content"] for p in edits)
    assert [p.id for p in load_prompts("stdlib-edit:3")] == [p.id for p in edits]  # the same set every time
    assert [p.id for p in load_prompts("stdlib-edit:1-3")] == [p.id for p in edits[1:]]  # a later slice of the same order
    with pytest.raises(PromptsError, match="stdlib-edit:A-B"):
        load_prompts("stdlib-edit:3-3")
    with pytest.raises(PromptsError, match="at least two non-empty strings"):
        load_prompts(str(_write_prompts(tmp_path / "t.jsonl", [{"id": "a", "category": "x", "turns": ["only one"]}])))
    with pytest.raises(PromptsError, match="exactly one of"):
        load_prompts(str(_write_prompts(tmp_path / "u.jsonl", [{"id": "a", "category": "x", "prompt": "p", "turns": ["a", "b"]}])))


def test_shipped_conversations():
    conversations = load_prompts(str(ROOT / "benchmarks" / "prompts" / "multi-turn.jsonl"))
    assert len(conversations) == 6 and {p.category for p in conversations} == {"multi-turn"}
    assert all(p.turns and len(p.turns) == 3 for p in conversations)


def test_c_per_mode_is_the_model_parts_not_a_copiers():
    """A mixed mode's c is its model part's, whichever copier (lookup or the suffix cache) is
    listed first; a mode that only copied reports its copier's."""
    from benchmarks.bench.stats import _mode_cost

    assert _mode_cost({"suffix": 0.004, "model": 0.31}) == 0.31
    assert _mode_cost({"lookup": 0.005, "suffix": 0.004, "model": 0.29}) == 0.29
    assert _mode_cost({"lookup": 0.005}) == 0.005
    assert _mode_cost({}) is None


def test_results_record_the_cpu_features_that_set_multi_token_pass_costs(bench_out):
    from benchmarks.bench.run import cpu_features

    x86 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 fma avx512f avx512_vnni\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert cpu_features(x86) == {"cpu": "AMD EPYC 9654", "isa": ["avx2", "fma", "avx512f", "avx512_vnni"]}
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimddp i8mm\n"
    assert cpu_features(arm) == {"cpu": "", "isa": ["asimddp", "i8mm"]}
    machine = json.loads((bench_out / "results.json").read_text())["machine"]
    if Path("/proc/cpuinfo").exists():
        assert machine["isa"] == cpu_features()["isa"] and "cpu" in machine


def test_policy_trace_replays_the_same_rounds_and_compare_finds_where_they_part(llama_bundle, tmp_path, capsys):
    """`policy_trace` under its virtual clock: the same code and costs play the same rounds (so two
    commits can be compared round for round), and other costs (a draft model dearer than the
    target pass) change them, which --compare reports with exit 1."""
    prompts = _write_prompts(tmp_path / "p.jsonl", PROMPTS)
    runs = {}
    for name, draft_ms in (("a", "0.5,0.1"), ("b", "0.5,0.1"), ("dear", "50,1")):
        runs[name] = tmp_path / f"{name}.json"
        argv = ["policy_trace", str(llama_bundle), "--prompts", str(prompts), "--max-new-tokens", "30", "--target-ms", "10,1.5",
                "--draft-ms", draft_ms, "--out", str(runs[name])]
        assert main(argv) == 0
    rounds = json.loads(runs["a"].read_text())["rounds"]
    assert set(rounds) == {p["id"] for p in PROMPTS}
    assert any(r[1] > 0 and r[0] == "model" for played in rounds.values() for r in played)  # the cheap draft model drafts
    assert main(["policy_trace", "--compare", str(runs["a"]), str(runs["b"])]) == 0
    assert "4/4 prompts play the same rounds" in capsys.readouterr().out
    assert main(["policy_trace", "--compare", str(runs["a"]), str(runs["dear"])]) == 1
    report = json.loads(capsys.readouterr().out.rsplit("\n", 2)[0])
    assert any(r["first_difference"] is not None for r in report.values())
