"""The decode benchmark (`python -m benchmarks bench`): every mode on every prompt side by side,
and a micro benchmark of single passes. It times the Engine from outside, through the session
hook the Engine accepts (timing.py); it is not part of the installed package.

prompts.py reads prompt sets, timing.py times sessions and single passes, run.py runs both
benchmarks, stats.py turns rounds into per-run rows and summaries, report.py writes the files
(results.json, summary.json, report.md, PNG plots) and summary.py the committed summary.
"""

from benchmarks.bench.prompts import BenchPrompt, PromptsError, load_prompts
from benchmarks.bench.report import render_report, save_micro, save_results
from benchmarks.bench.run import MODES, BenchConfig, MicroConfig, run_bench, run_micro
from benchmarks.bench.timing import PassTimer, SessionClock

__all__ = ["BenchConfig", "BenchPrompt", "MODES", "MicroConfig", "PassTimer", "PromptsError", "SessionClock", "load_prompts",
           "render_report", "run_bench", "run_micro", "save_micro", "save_results"]
