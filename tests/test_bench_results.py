"""Benchmark tables run as scripts are appended to a dated results file naming the host and the command; from
anywhere else (tests, library callers) nothing is written."""

from __future__ import annotations

import sys

from benchmarks import common


def test_a_script_run_appends_each_table_under_one_header(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_RESULTS_DIR", str(tmp_path))
    monkeypatch.delenv("SPECSTEP_CPU_ISA", raising=False)
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/bench_demo.py", "--modes", "plain,ngram k=4"])
    monkeypatch.setattr(common, "cpu", lambda: ("AMD EPYC 9B14", ["avx2", "fma", "avx512f", "avx512_vnni"]))
    common.table("first", ["mode", "tok/s"], [["plain", 12.345]])
    common.table("second", ["mode", "tok/s"], [["ngram", 20.0]])
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.endswith("-bench_demo-amd-avx512.md")
    text = files[0].read_text()
    assert text.count("# bench_demo on AMD EPYC 9B14") == 1
    assert "flags avx2 fma avx512f avx512_vnni" in text and text.count(", load average ") == 2
    assert text.count("- Command: `python -m benchmarks.bench_demo --modes 'plain,ngram k=4'`") == 2
    assert "| plain | 12.35 |" in text and "| ngram | 20.00 |" in text
    assert text.index("## first") < text.index("## second")


def test_a_pinned_isa_is_part_of_the_command(tmp_path, monkeypatch):
    """A run with the kernels pinned to an ISA (SPECSTEP_CPU_ISA) records it: its figures are not the host's."""
    monkeypatch.setenv("SPECSTEP_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("SPECSTEP_CPU_ISA", "avx2")
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/bench_demo.py", "--reps", "3"])
    monkeypatch.setattr(common, "cpu", lambda: ("AMD EPYC 9B14", ["avx2", "avx512f"]))
    path = common.record("t", ["a"], [[1]])
    assert "- Command: `SPECSTEP_CPU_ISA=avx2 python -m benchmarks.bench_demo --reps 3`" in path.read_text()


def test_other_callers_and_an_empty_dir_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTEP_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest", "-q"])
    assert common.record("t", ["a"], [[1]]) is None
    monkeypatch.setenv("SPECSTEP_RESULTS_DIR", "")
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/bench_demo.py"])
    assert common.record("t", ["a"], [[1]]) is None
    assert list(tmp_path.iterdir()) == []


def test_the_host_tag_is_the_widest_isa():
    assert common.results_file("bench_x", "Intel Xeon", ["avx2", "avx512f", "amx_int8"], "2026-12-07").name == \
        "2026-12-07-bench_x-intel-amx.md"
    assert common.results_file("bench_x", "AMD EPYC", ["avx2", "fma"], "2026-12-07").name == \
        "2026-12-07-bench_x-amd-avx2.md"
