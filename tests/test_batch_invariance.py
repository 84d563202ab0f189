"""Batch-invariant CPU steps: a verify step's rows are bitwise the plain decode steps at the same positions, for
every network a proposer runs and every linear plan batch invariance can choose; through the engine, for each
proposer; and on a checkpoint built full of near-ties, speculative greedy output is plain greedy output where
the per-row kernel dispatch and SDPA flip it (checked by hand: `batch_invariant=False` fails these tests)."""

from __future__ import annotations

import pytest
import torch

from specstep.engine.batch_builder import build_forward_batch
from specstep.engine.cpu_kernels import CpuKernels
from specstep.engine.errors import ConfigError
from specstep.engine.gguf_checkpoint import converted_folder
from specstep.engine.kernels import binding as kernel_layer
from specstep.engine.kv_cache import KVPool
from specstep.engine.model_loader import describe_cpu_kernels, load_model, load_mtp_head
from specstep.engine.models.cpu_linear import onednn_available
from specstep.engine.models.decode_layers import PROMPT_GEMM, prompt_gemm_kind
from specstep.engine.models.gguf_kernel import tiles_unavailable, vnni_unavailable
from specstep.engine.models.gguf_kernel import unavailable as gguf_unavailable
from specstep.engine.models.gguf_linear import GGUFLinear
from specstep.engine.sampling_params import SamplingParams
from specstep.scheduler.core.request import Request
from tests.fixtures_gguf import pin_int8_form, write_gguf
from tests.fixtures_models import make_mtp_head
from tests.helpers import make_core, run_to_completion

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

PAGE = 4
PLANS = ["auto", "onednn"]  # what batch invariance can run (matmul is refused: see the test below)
PROMPT = [5, 17, 99, 3, 41, 8, 230, 12, 77, 64, 1, 2, 3, 4, 150, 9, 30]
NEXT = [11, 250, 7, 7, 199]  # a verify step's k + 1 = 5 tokens


def forward(net, pool, lanes):
    """One forward of `lanes` = [(tokens, start, pages)]; the final hidden states, flat."""
    fb = build_forward_batch([t for t, _, _ in lanes], [s for _, s, _ in lanes], [p for _, _, p in lanes], PAGE,
                             "cpu")
    with torch.inference_mode():
        return net(fb, pool)


def decode_then_verify(net, step):
    """Hidden states of NEXT decoded one token a step, then of NEXT as one verify step over the same cache
    (its look-ahead pages in the table), beside a second lane of another length; `step(pool, lanes)`."""
    pool = KVPool(net.rank_cfg, len(net.layers), 64, PAGE, torch.float32, "cpu")
    pages, other = list(range(1, 21)), list(range(21, 60))
    n = len(PROMPT)
    step(pool, [(PROMPT, 0, pages[: -(-n // PAGE)]), (list(range(100, 140)), 0, other)])
    single = [step(pool, [([t], n + i, pages[: -(-(n + i + 1) // PAGE)])])[0] for i, t in enumerate(NEXT)]
    verify = step(pool, [(NEXT, n, pages), ([9], 140, other)])[: len(NEXT)]
    return torch.stack(single), verify


@pytest.fixture(scope="module")
def tiny_gguf(tiny_target, tmp_path_factory):
    """The tiny target as a Q4_1 GGUF file, converted (its linears read the file's blocks: `GGUFLinear`)."""
    if gguf_unavailable():
        pytest.skip(f"GGUF kernel unavailable: {gguf_unavailable()}")
    tmp = tmp_path_factory.mktemp("gguf")
    return converted_folder(write_gguf(tmp / "t.gguf", tiny_target, qtype="Q4_1"), cache=tmp)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("network", ["target", "draft_model", "gguf_q4_1"])
def test_verify_rows_are_the_decode_steps_bitwise(plan, network, request, tiny_target, tiny_draft):
    model = {"target": tiny_target, "draft_model": tiny_draft}.get(network) or request.getfixturevalue("tiny_gguf")
    net = load_model(model, "cpu", "float32", CpuKernels(plan))
    single, verify = decode_then_verify(net, lambda pool, lanes: forward(net, pool, lanes))
    assert torch.equal(net.compute_logits(verify), net.compute_logits(single))
    assert "batch-invariant" in describe_cpu_kernels(net) and "not batch-invariant" not in describe_cpu_kernels(net)


@pytest.mark.parametrize("plan", PLANS)
def test_mtp_head_rows_are_its_single_rows_bitwise(plan, tiny_target, tmp_path):
    target = load_model(tiny_target, "cpu", "float32", CpuKernels(plan))
    head = load_mtp_head(make_mtp_head(tmp_path / "head", tiny_target), target.cfg, "cpu", torch.float32,
                         CpuKernels(plan))
    g = torch.Generator().manual_seed(0)
    carried = torch.randn(200, target.cfg.hidden_size, generator=g)  # the target's hidden states it is fed

    def step(pool, lanes):
        fb = build_forward_batch([t for t, _, _ in lanes], [s for _, s, _ in lanes], [p for _, _, p in lanes],
                                 PAGE, "cpu")
        rows = torch.cat([carried[s: s + len(t)] for t, s, _ in lanes])
        with torch.inference_mode():
            return head(fb, pool, target.embed_tokens(fb.input_ids), rows)

    single, verify = decode_then_verify(head, step)
    assert torch.equal(target.compute_logits(verify), target.compute_logits(single))


def test_matmul_is_not_batch_invariant_and_refused(tiny_target):
    with pytest.raises(ConfigError, match="not batch-invariant"):
        load_model(tiny_target, "cpu", "float32", CpuKernels("matmul"))
    off = load_model(tiny_target, "cpu", "float32", CpuKernels("matmul", batch_invariant=False))
    assert "not batch-invariant" in describe_cpu_kernels(off) and "SDPA" in describe_cpu_kernels(off)


def record_target_logits(core):
    """position -> [(tokens at positions <= it in this step, logits row)] for every target forward whose logits
    are taken at every row (decode and verify steps of a single request)."""
    target, seen, pending = core.engine.target, {}, []
    compute = target.compute_logits

    def hook(_module, args, _out):
        pending[:] = [args[0].positions.tolist(), args[0].input_ids.tolist()]

    def logits(hidden):
        out = compute(hidden)
        if pending and len(pending[0]) == hidden.shape[0]:
            positions, ids = pending
            for j, p in enumerate(positions):
                seen.setdefault(p, []).append((positions[0], ids[: j + 1], out[j].clone()))
        pending.clear()
        return out

    target.register_forward_hook(hook)
    target.compute_logits = logits
    return seen


@pytest.fixture(scope="module")
def proposers(tiny_target, tmp_path_factory):
    return {"ngram": dict(spec="ngram"), "draft_model": dict(spec="draft_model", draft=str(tiny_target)),
            "mtp": dict(spec="mtp", draft=str(make_mtp_head(tmp_path_factory.mktemp("h") / "h", tiny_target)))}


TILES = pytest.mark.skipif(bool(tiles_unavailable()), reason=f"AMX tiles: {tiles_unavailable()}")
VNNI = pytest.mark.skipif(bool(vnni_unavailable()), reason=f"AVX-512 VNNI: {vnni_unavailable()}")
BF16_DOT = pytest.mark.skipif(bool(gguf_unavailable()) or not kernel_layer.runs_here("BF16", "bf16"),
                              reason="no AVX-512 BF16 dot products here")


@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "mtp", "ngram_gguf_q4_1", "ngram_gguf_q4_1_int8-lanes",
                                      pytest.param("ngram_gguf_q4_1_int8-tiles", marks=TILES),
                                      pytest.param("ngram_gguf_q4_1_int8-vnni", marks=VNNI),
                                      "draft_model_kv-bf16", "mtp_kv-bf16", "ngram_gguf_q4_1_kv-bf16"])
def test_engine_verify_logits_are_plain_decode_logits(proposer, proposers, request, tiny_target, monkeypatch):
    """Each verify row whose inputs are plain decoding's (every earlier draft of its step accepted) has plain
    decoding's logits at that position, bitwise: the target's own draft accepts all (draft_model), n-gram
    drafts from a repetitive prompt, the random MTP head mostly only the first row; and n-gram on a Q4_1 GGUF
    target whose linears read its blocks, with fp32 or int8 activations (in AVX2 lanes; in AMX tiles; in AVX-512
    VNNI lanes); and with every KV pool in bf16 (`--kv-cache-dtype bfloat16`: the torch layers' attention, and the
    C++ layers' on the GGUF target)."""
    kernels = {}
    if proposer.endswith("_kv-bf16"):
        proposer, kernels["kv_cache_dtype"] = proposer.removesuffix("_kv-bf16"), "bfloat16"
    gguf = proposer.startswith("ngram_gguf_q4_1")
    acts = proposer.rpartition("_")[2] if "_int8" in proposer else ""
    if acts:
        kernels["activations"] = pin_int8_form(acts, monkeypatch)
    if gguf:
        tiny_target, proposer = request.getfixturevalue("tiny_gguf"), "ngram"
    prompt = [7, 8, 9, 10] * 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain_core = make_core(tiny_target, page_size=PAGE, **kernels)
    plain_logits = record_target_logits(plain_core)
    (plain,) = run_to_completion(plain_core, [prompt], params)
    core = make_core(tiny_target, page_size=PAGE, num_spec_tokens=4, spec_policy="fixed", **proposers[proposer],
                     **kernels)
    pools = [core.engine.pool] + ([core.engine.proposer.pool] if getattr(core.engine.proposer, "pool", None) else [])
    assert {p.k[0].dtype for p in pools} == {torch.bfloat16 if "kv_cache_dtype" in kernels else torch.float32}
    if acts:
        kind = {"int8-lanes": "int8", "int8-tiles": "int8-tiles", "int8-vnni": "int8-vnni"}[acts]
        assert {m.activations for m in core.engine.target.modules() if isinstance(m, GGUFLinear)} == {kind}
    spec_logits = record_target_logits(core)
    assert gguf == any(isinstance(m, GGUFLinear) for m in core.engine.target.modules())
    (spec,) = run_to_completion(core, [prompt], params)
    assert spec.output_token_ids == plain.output_token_ids
    tokens = prompt + plain.output_token_ids
    compared = 0
    for p, rows in spec_logits.items():
        for start, ids, row in rows:
            if ids == tokens[start: p + 1] and p in plain_logits and p >= len(prompt) - 1:
                assert torch.equal(row, plain_logits[p][0][2]), (proposer, p)
                compared += 1
    assert compared >= len(plain.output_token_ids) - 1
    if proposer != "mtp":
        assert max(len(ids) for rows in spec_logits.values() for _, ids, _ in rows) > 1  # real verify steps


@pytest.mark.parametrize("acts", ["fp32", "int8-lanes", pytest.param("int8-tiles", marks=TILES),
                                  pytest.param("int8-vnni", marks=VNNI), "fp32_kv-bf16"])
def test_gguf_speculation_on_the_overlap_path_is_plain_decoding(acts, tiny_gguf, monkeypatch):
    """The GGUF kernels on the overlap stream path (steps on the worker thread, the next batch built beside them):
    n-gram speculation (a fixed k: an adaptive policy prices steps by wall time and may not speculate at all on a
    loaded host) over a batch of lanes that draft (a match) and lanes that do not gives inline plain
    decoding's tokens, with fp32 and each int8 kernel the host has (the C++ layers keep their scratch per calling
    thread, the thread choice is per call: nothing may depend on which thread runs the step). One prompt is long
    enough (over 17 tokens) for the prompt GEMM (with AMX tiles its AMX-BF16 form, where the host has it). And with
    a bf16 KV cache."""
    prompts = [[7, 8, 9, 10] * 3, [40 + i for i in range(9)], [3, 5] * 5, [60, 61, 62, 60, 61, 62, 63],
               [11, 12, 13, 14, 15, 16] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kernels = dict(activations=pin_int8_form(acts, monkeypatch))
    if acts.endswith("_kv-bf16"):
        acts = acts.removesuffix("_kv-bf16")
        kernels = dict(activations=acts, kv_cache_dtype="bfloat16")
    plain = run_to_completion(make_core(tiny_gguf, page_size=PAGE, **kernels), prompts, params)
    core = make_core(tiny_gguf, page_size=PAGE, num_spec_tokens=4, spec="ngram", spec_policy="fixed",
                     overlap=True, **kernels)
    assert core.overlap
    native = core.engine.target.native
    assert native is not None and native.prompt_gemm == prompt_gemm_kind([acts if acts != "int8-lanes" else "int8"])
    spec = [Request(str(i), list(p), params, seed=i) for i, p in enumerate(prompts)]
    for r in spec:
        core.add_request(r)
    accepted = 0
    try:
        while core.has_unfinished():
            accepted += sum(o.num_accepted for o in core.step())
            core.check_integrity()
    finally:
        core.stream.close()
    assert core.allocator.num_free == core.allocator.num_usable
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert accepted > 0  # it did speculate


def make_near_ties(folder, seed: int = 0):
    """A checkpoint whose lm_head rows come in pairs a relative 2^-22 apart: at every position the top two
    logits nearly tie, so the last bit of a row's hidden state decides greedy output."""
    import transformers

    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0, bos_token_id=0,
              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        w = model.lm_head.weight
        w[1::2] = w[0::2] * (1 + 2.0**-22)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_near_ties_speculative_greedy_is_plain_greedy(proposer, tmp_path):
    target = make_near_ties(tmp_path / "ties")
    spec = dict(spec="ngram") if proposer == "ngram" else dict(spec="draft_model", draft=str(target))
    prompts = [[(13 * i + 7 * j) % 320 for j in range(8)] * 2 for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # One request at a time: plain decoding's steps are then single rows, as far from a verify step as can be.
    plain = run_to_completion(make_core(target, page_size=PAGE, max_batch_size=1), prompts, params)
    reqs = run_to_completion(make_core(target, page_size=PAGE, max_batch_size=1, num_spec_tokens=4,
                                       spec_policy="fixed", **spec), prompts, params)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_target, tmp_path_factory):
    """The tiny target saved in bf16: its linears run the kernel layer's BF16 rows (fp32 activations), prompt rows
    the fp32 GEMM over their dequantised panels."""
    import shutil

    import transformers

    folder = tmp_path_factory.mktemp("bf16")
    transformers.AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16).save_pretrained(folder)
    shutil.copy(tiny_target / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("acts", ["fp32", "int8-lanes", pytest.param("int8-vnni", marks=VNNI), "bf16-folder",
                                  pytest.param("bf16-folder-dot", marks=BF16_DOT)])
def test_a_prompts_rows_do_not_depend_on_its_forwards_company(acts, request, monkeypatch):
    """A prompt's hidden states are the same bits prefilled alone, in a batch with prompts of other lengths, and
    in chunks beside other requests: with int8 activations a rounding difference in a prompt's attention turned
    into other tokens, so whether a prompt was batched (as plain and speculative serving admit differently) or how
    it was chunked changed the output. A bf16 folder's prompt rows take the fp32 GEMM, a 5-row prompt beside them
    the kernel; with bf16 dot products (the default where they run) the bf16 GEMM and the bf16 kernel."""
    if acts == "bf16-folder":
        core = make_core(request.getfixturevalue("tiny_bf16"), page_size=PAGE, activations="fp32")
        assert core.engine.target.native.prompt_gemm == PROMPT_GEMM
    elif acts == "bf16-folder-dot":
        core = make_core(request.getfixturevalue("tiny_bf16"), page_size=PAGE, activations="auto")
        assert {m.activations for m in core.engine.target.modules() if isinstance(m, GGUFLinear)} == {"bf16"}
        assert core.engine.target.native.prompt_gemm == PROMPT_GEMM
    else:
        core = make_core(request.getfixturevalue("tiny_gguf"), page_size=PAGE,
                         activations=pin_int8_form(acts, monkeypatch))
    target, pool = core.engine.target, core.engine.pool
    lens = [30, 5, 70, 18]
    ids = [[(7 * i + 3 * j) % 90 + 5 for j in range(n)] for i, n in enumerate(lens)]
    tables, page = [], 1
    for n in lens:
        k = -(-n // PAGE)
        tables.append(list(range(page, page + k)))
        page += k

    def forward(rows: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """(prompt, first position, positions) runs in one forward; each run's hidden rows."""
        fb = build_forward_batch([ids[p][s: s + n] for p, s, n in rows], [s for _, s, _ in rows],
                                 [tables[p] for p, _, _ in rows], PAGE, "cpu", target.attention, "prefill")
        with torch.inference_mode():
            h = target(fb, pool).clone()
        return list(h.split([n for _, _, n in rows]))

    alone = [forward([(p, 0, n)])[0] for p, n in enumerate(lens)]
    together = forward([(p, 0, n) for p, n in enumerate(lens)])
    for p in range(len(lens)):
        assert torch.equal(together[p], alone[p]), f"prompt {p} batched"
    # Prompt 2 in chunks of 40 and 30 (the first beside prompt 0's whole prefill, the second beside prompt 1)
    first = forward([(0, 0, lens[0]), (2, 0, 40)])[1]
    second = forward([(1, 0, lens[1]), (2, 40, 30)])[1]
    assert torch.equal(torch.cat([first, second]), alone[2]), "prompt 2 chunked"
