"""``forerun bench``: decoding methods side by side on a prompt set.

Every method runs on every prompt, interleaved prompt by prompt (for each
prompt, every method in turn), at fixed seeds after a warm-up, so the drift
of a noisy machine hits all of them alike.  Greedy runs check each method's
tokens against plain decoding of the same engine.

Python use::

    from forerun.bench import BenchSettings, run_bench, write_reports
    report = run_bench(BenchSettings(methods=["plain", "draft-k4"], limit=2),
                       model=forerun.load("smollm2-135m"), draft=...)
    write_reports(report, "bench-out/x")

New methods plug in with one :func:`register_method` entry (see
:mod:`forerun.bench.registry`).
"""

from forerun.bench import methods, peers  # noqa: F401  (they register their methods)
from forerun.bench.errors import BenchError, MethodUnavailable
from forerun.bench.method import BenchMethod, MethodOutput
from forerun.bench.methods import ForerunMethod
from forerun.bench.prompts import DEFAULT_PROMPTS, Prompt, load_prompts, select_prompts
from forerun.bench.registry import available_methods, make_method, register_method, register_pattern
from forerun.bench.report import print_report, write_reports
from forerun.bench.runner import BenchSettings, run_bench
from forerun.bench.summary import BenchReport

__all__ = [
    "BenchError", "BenchMethod", "BenchReport", "BenchSettings", "DEFAULT_PROMPTS",
    "ForerunMethod", "MethodOutput", "MethodUnavailable", "Prompt", "available_methods",
    "load_prompts", "make_method", "print_report", "register_method", "register_pattern",
    "run_bench", "select_prompts", "write_reports",
]
