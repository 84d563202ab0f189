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


BATCHED_LOG = """
llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     96 |    1 |    224 |    0.366 |   350.10 |    0.902 |   106.43 |    1.268 |   176.66 |
|   128 |     96 |    8 |   1792 |    2.922 |   350.41 |    3.288 |   233.60 |    6.210 |   288.57 |
"""


def test_batched_bench_times_come_from_the_row_of_the_batch():
    from benchmarks import peer_llamacpp

    assert peer_llamacpp.batched_times(BATCHED_LOG, 128, 8) == (6.210, 2.922)
    assert peer_llamacpp.batched_times(BATCHED_LOG, 128, 1) == (1.268, 0.366)


def test_a_llamacpp_batch_row_is_compared_with_specstep_plain(monkeypatch):
    res = results()
    res["batches"] = [1, 8]
    res["specstep"]["plain/code/b8"] = run(200.0, [[1, 2]] * 8)
    # llama-batched-bench prints no tokens: 8 prompts' 10 tokens at 100 tok/s
    res["llamacpp"]["plain/code/b8"] = {"seconds": 0.8, "seconds_all": [0.8], "tokens": 80, "outputs": []}
    rows = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line
            for line in peers_report.markdown(res).splitlines()[2:]}
    assert "| 100.0 |" in rows["| llama.cpp, 2 threads | plain"]
    lines = []
    monkeypatch.setattr(peers_report.console, "print", lines.append)  # (the ratio lines go to the console)
    peers_report.ratios(res)
    assert "code b8: specstep plain / llama.cpp, 2 threads plain = 2.00" in lines


def test_vllm_runs_a_folder_in_the_dtype_its_weights_are_stored_in(tmp_path):
    import json

    from benchmarks.bench_peers import folder_dtype

    for config, dtype in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                          ({}, "float32")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert folder_dtype(str(tmp_path)) == dtype


def test_every_activation_run_is_labelled_as_specsteps():
    """`--activations auto` (or any other) reports as specstep with those activations, never as a llama.cpp run."""
    labels = peers_report.engines({"specstep-auto": {"plain/code/b1": run(60.0, [[1]])},
                                   "llamacpp-1t": {"threads": 1, "plain/code/b1": run(20.0, [[1]])}})
    assert labels == {"specstep-auto": "specstep, auto activations", "llamacpp-1t": "llama.cpp, 1 thread"}
