"""`bench_peers`' report: engines beside specstep's fp32 runs (int8 activations, llama.cpp) are compared with
their own plain decoding and with specstep's, in the markdown table and in the ratio lines."""

from __future__ import annotations

from benchmarks import peers_report


def run(tok_s: float, outputs: list[list[int]], new_tokens: int = 10) -> dict:
    seconds = len(outputs) * new_tokens / tok_s
    return {"seconds": seconds, "seconds_all": [seconds], "tokens": len(outputs) * new_tokens, "outputs": outputs}


def results() -> dict:
    fp32, int8 = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    return {
        "machine": "test", "model": "/m", "new_tokens": 10, "repeats": 1, "sets": ["code"], "batches": [1],
        "specstep": {"plain/code/b1": run(50.0, fp32), "ngram/code/b1": run(60.0, fp32)},
        "specstep-int8": {"plain/code/b1": run(60.0, int8), "ngram/code/b1": run(90.0, int8)},
        "llamacpp": {"threads": 2, "plain/code/b1": run(75.0, [[9, 9], [9, 9]])},
        "vllm": {"plain/code/b1": run(10.0, fp32), "ngram k=4/code/b1": run(20.0, fp32)},
    }


def test_markdown_compares_int8_with_specstep_plain_and_its_own_plain():
    rows = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line
            for line in peers_report.markdown(results()).splitlines()[2:]}
    int8_ngram = rows["| specstep, int8 activations | ngram"]
    assert "90.0 (1.50x)" in int8_ngram  # against its own plain (60), not specstep's (50)
    assert int8_ngram.endswith("| 1/2 | 2/2 |")  # tokens: 1 of 2 equal fp32 plain's, both its own plain's


def test_ratio_lines_cover_each_specstep_engine(monkeypatch):
    lines = []
    monkeypatch.setattr(peers_report.console, "print", lambda s: lines.append(s))
    peers_report.ratios(results())
    assert "code b1: specstep-int8 plain / specstep plain = 1.20" in lines
    assert "code b1: best specstep-int8 (ngram) / specstep-int8 plain = 1.50" in lines
    assert "code b1: fastest specstep-int8 (ngram) / fastest llama.cpp, 2 threads (plain) = 1.20" in lines
    assert "code b1: fastest specstep (ngram) / fastest llama.cpp, 2 threads (plain) = 0.80" in lines
    assert "code b1: specstep plain / vLLM plain = 5.00" in lines
