"""The wire protocol, request validation and streaming text, without processes (fast)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstep.engine.tokenizer import Tokenizer
from specstep.scheduler.server.detokenize import TextStream
from specstep.scheduler.server.protocol import (
    CLIENT_TYPES,
    FROM_ENGINE_TYPES,
    MAX_FRAME_BYTES,
    SERVER_TYPES,
    TO_ENGINE_TYPES,
    AbortRequest,
    Delta,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    MsgType,
    ProtocolError,
    Ready,
    SpecStats,
    StatsReply,
    Timings,
    Usage,
    decode_client,
    decode_from_engine,
    decode_server,
    decode_to_engine,
    encode,
    encode_engine,
)
from specstep.scheduler.server.validate import Limits, validate_generate
from tests.helpers import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def test_type_codes_are_one_byte_and_unique():
    codes = [*CLIENT_TYPES, *SERVER_TYPES]
    assert len(set(codes)) == len(codes) and all(0 < c < 256 for c in codes)
    assert len(set(TO_ENGINE_TYPES) | set(FROM_ENGINE_TYPES)) == len(TO_ENGINE_TYPES) + len(FROM_ENGINE_TYPES)


def test_round_trips():
    final = Final("r", "length", [1, 2], "ab", Usage(3, 2), SpecStats(4, 2, 2, 0.5, 2.0, [0.5, 0.5]),
                  Timings(0.001, 0.01, 0.002, 0.003, 0.02), 1)
    for msg in (GenerateRequest("r", prompt="hi", stop=["\n"], num_spec_tokens=0), AbortRequest("r"),
                HealthRequest()):
        assert decode_client(encode(msg)) == msg
    for msg in (Delta("r", [1], "a"), final, Error(ErrorCode.MALFORMED, "bad", None),
                Error(ErrorCode.DUPLICATE_REQUEST_ID, "dup", "r", True), HealthReply(1, "ok", "m"),
                HealthReply(1, "ok", "m", "mtp", 512, 500, 400, 320, "tcp://127.0.0.1:5555"),
                StatsReply(1, "ok", 0, 0, None)):
        assert decode_server(encode(msg)) == msg
    assert decode_to_engine(encode_engine(EngineRequest("1", [1, 2], seed=5))) == EngineRequest("1", [1, 2], seed=5)
    outs = EngineOutputs([EngineOutput("1", [3]), EngineOutput("2", [4, 5], "stop", 3, 2, 0.1, 1)])
    assert decode_from_engine(encode_engine(outs)) == outs
    ready = Ready(1, 2, 3, 16, 512, 500, 320, 8, "cpu", "float32", "none", 0, [0])
    assert decode_from_engine(encode_engine(ready)) == ready


def test_wire_format_is_positional_arrays_with_trailing_defaults_optional():
    """What docs/protocol.md promises a client in another language."""
    frames = encode(GenerateRequest("r", prompt_token_ids=[1, 2], max_tokens=4, temperature=0.0))
    assert frames[0] == b"\x01"
    body = msgspec.msgpack.decode(frames[1])
    assert body[:5] == ["r", None, [1, 2], 4, 0.0]
    # A minimal client sends only the leading fields it needs.
    short = decode_client([b"\x01", msgspec.msgpack.encode(["r", "hello"])])
    assert short == GenerateRequest("r", prompt="hello")
    # Integers are accepted where floats are expected.
    assert decode_client([b"\x01", msgspec.msgpack.encode(["r", "x", None, 4, 0])]).temperature == 0.0


def test_an_extra_element_after_valid_fields_is_malformed():
    req = GenerateRequest("a", prompt_token_ids=[1])
    full = [msgspec.to_builtins(getattr(req, f)) for f in GenerateRequest.__struct_fields__]
    assert decode_client([bytes([MsgType.GENERATE]), msgspec.msgpack.encode(full)]) == req
    with pytest.raises(ProtocolError) as e:
        decode_client([bytes([MsgType.GENERATE]), msgspec.msgpack.encode(full + ["extra"])])
    assert e.value.code == ErrorCode.MALFORMED and e.value.request_id == "a"


@pytest.mark.parametrize("frames, code, rid", [
    ([b"\x01"], ErrorCode.MALFORMED, None),
    ([b"\x01", b"", b""], ErrorCode.MALFORMED, None),
    ([b"\x09", b"\x90"], ErrorCode.UNKNOWN_TYPE, None),
    ([b"\x81", b"\x90"], ErrorCode.UNKNOWN_TYPE, None),  # a server message sent by a client
    ([b"", b"\x90"], ErrorCode.UNKNOWN_TYPE, None),
    ([b"\x01", b"\xc1"], ErrorCode.MALFORMED, None),  # not msgpack
    ([b"\x01", msgspec.msgpack.encode({"request_id": "a"})], ErrorCode.MALFORMED, None),  # a map, not an array
    ([b"\x01", msgspec.msgpack.encode(["a", None, ["x"]])], ErrorCode.MALFORMED, "a"),  # wrong element type
    ([b"\x01", msgspec.msgpack.encode(["a"] + [None] * 20)], ErrorCode.MALFORMED, "a"),  # too many fields
    ([b"\x02", msgspec.msgpack.encode([])], ErrorCode.MALFORMED, None),  # abort without an id
])
def test_decode_errors(frames, code, rid):
    with pytest.raises(ProtocolError) as e:
        decode_client(frames)
    assert (e.value.code, e.value.request_id) == (code, rid)


def test_the_request_id_is_read_from_a_body_that_does_not_decode():
    """Only the id's own bytes are read: the rest may be what is broken, or too large to decode."""
    def rid(body: bytes) -> str | None:
        with pytest.raises(ProtocolError) as e:
            decode_client([bytes([MsgType.GENERATE]), body])
        return e.value.request_id

    enc = msgspec.msgpack.encode
    assert rid(enc(["a", None, ["x"]]) + b"\x00") == "a"  # trailing bytes
    assert rid(enc(["é" * 40, b"\xff"]).replace(b"\xc4\x01\xff", b"\xa1\xff")) == "é" * 40  # str8 id, bad UTF-8 later
    assert rid(enc(["a" * 256] * 17)) == "a" * 256  # array16 header, str16 id
    assert rid(enc(["a" * 257, None, "x"])) is None  # not an id check_request_id accepts
    assert rid(enc([b"ab", None, "x"])) is None  # bin, not str
    assert rid(b"\x92\xa5ab") is None  # truncated
    assert rid(b"\x92\xa2\xff\xfe\xc0") is None  # the id itself is not UTF-8
    big = enc(["huge", "x" * MAX_FRAME_BYTES])
    with pytest.raises(ProtocolError) as e:
        decode_client([bytes([MsgType.GENERATE]), big])
    assert (e.value.code, e.value.request_id) == (ErrorCode.TOO_LARGE, "huge")
    with pytest.raises(ProtocolError) as e:  # a message type without an id reports none
        decode_client([bytes([MsgType.STATS]), enc(["x"])])
    assert e.value.request_id is None


def test_decode_errors_name_the_field():
    def message(kind: MsgType, body: list) -> str:
        with pytest.raises(ProtocolError) as e:
            decode_client([bytes([kind]), msgspec.msgpack.encode(body)])
        return e.value.message

    assert message(MsgType.GENERATE, ["r", None, None, "4"]) == "max_tokens: expected int, got str"
    assert message(MsgType.GENERATE, ["r", None, None, 4, 1.0, 1.0, 0, None, ["a", 3]]) == \
        "stop[1]: expected str, got int"
    assert message(MsgType.GENERATE, ["r", None, None, 4, 1.0, 1.0, 0, None, [], [], "no"]) == \
        "ignore_eos: expected bool, got str"
    assert message(MsgType.GENERATE, []) == "request_id: required field missing"
    assert message(MsgType.ABORT, [None]) == "request_id: expected str, got nil"
    assert message(MsgType.GENERATE, {"request_id": "r"}) == \
        "the body must be a msgpack array of GenerateRequest's fields, got map"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=4))
def test_decode_client_only_ever_raises_protocol_error(frames):
    try:
        decode_client(frames)
    except ProtocolError as e:
        assert e.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE)


LIMITS = Limits(vocab_size=320, max_prompt_len=50, max_tokens=100)


def test_validate_builds_the_engine_request(tokenizer):
    req = validate_generate(GenerateRequest("r", prompt="def f():", max_tokens=7, temperature=0, top_k=5,
                                            stop_token_ids=[3], num_spec_tokens=2), LIMITS, tokenizer, "42")
    assert req.request_id == "42" and req.prompt_token_ids == tokenizer.encode("def f():")
    assert (req.max_tokens, req.temperature, req.top_k, req.stop_token_ids, req.num_spec_tokens) == (7, 0.0, 5, [3], 2)
    assert req.client_seed is None and 0 <= req.seed < 2**63  # drawn when the client gives none
    assert validate_generate(GenerateRequest("r", prompt_token_ids=[1], seed=9), LIMITS, None, "1").seed == 9


@pytest.mark.parametrize("fields, code, field", [
    (dict(prompt_token_ids=[1] * 51), ErrorCode.PROMPT_TOO_LONG, "prompt_token_ids"),
    (dict(prompt="x" * 400), ErrorCode.PROMPT_TOO_LONG, "prompt"),
    (dict(prompt=""), ErrorCode.INVALID_PARAMS, "prompt"),
    (dict(prompt_token_ids=[1], max_tokens=101), ErrorCode.INVALID_PARAMS, "max_tokens"),
    (dict(prompt_token_ids=[1], top_p=float("inf")), ErrorCode.INVALID_PARAMS, "top_p"),
    (dict(prompt_token_ids=[1], seed=2**63), ErrorCode.INVALID_PARAMS, "seed"),
    (dict(prompt_token_ids=[1], stop=["a"] * 17), ErrorCode.INVALID_PARAMS, "stop"),
    (dict(prompt_token_ids=[1], num_spec_tokens=-1), ErrorCode.INVALID_PARAMS, "num_spec_tokens"),
    (dict(prompt_token_ids=[1], top_k=-2), ErrorCode.INVALID_PARAMS, "top_k"),
    (dict(prompt_token_ids=[1], stop_token_ids=[320]), ErrorCode.INVALID_PARAMS, "stop_token_ids"),
])
def test_validate_rejects_naming_the_field(tokenizer, fields, code, field):
    with pytest.raises(ProtocolError) as e:
        validate_generate(GenerateRequest("r", **fields), LIMITS, tokenizer, "1")
    assert e.value.code == code and e.value.request_id == "r"
    assert e.value.message.startswith(f"{field}: "), e.value.message


def test_top_k_minus_one_is_off_and_above_the_vocabulary_is_allowed():
    for top_k, sent in ((-1, 0), (0, 0), (7, 7), (LIMITS.vocab_size + 5, LIMITS.vocab_size + 5)):
        req = validate_generate(GenerateRequest("r", prompt_token_ids=[1], top_k=top_k), LIMITS, None, "1")
        assert req.top_k == sent


def test_text_requests_need_a_tokenizer():
    with pytest.raises(ProtocolError, match="no tokenizer"):
        validate_generate(GenerateRequest("r", prompt="hi"), LIMITS, None, "1")


def stream_all(tokenizer, prompt_ids, out_ids, stop, chunk=1):
    ts = TextStream(tokenizer, prompt_ids, stop)
    text, used = "", 0
    for i in range(0, len(out_ids), chunk):
        for tok in out_ids[i:i + chunk]:
            used += 1
            if ts.add(tok):
                return text + ts.take(final=True), used, True
        text += ts.take()
    return text + ts.take(final=True), used, False


def test_text_stream_is_utf8_safe_and_complete(tokenizer):
    prompt = tokenizer.encode("x = ")
    out = tokenizer.encode("'héllo wörld ✓ ünïcode' + \"日本\"\n")
    text, used, stopped = stream_all(tokenizer, prompt, out, [])
    assert (text, used, stopped) == (tokenizer.decode(out), len(out), False)
    ts = TextStream(tokenizer, prompt, [])
    for tok in out:
        ts.add(tok)
        assert "\ufffd" not in ts.take()


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings_cut_text_even_across_tokens(tokenizer, chunk):
    out = tokenizer.encode("return value\n\ndef next_function():\n    pass\n")
    full = tokenizer.decode(out)
    text, used, stopped = stream_all(tokenizer, [], out, ["\n\ndef", "zzz"], chunk)
    assert stopped and text == full[: full.index("\n\ndef")]
    assert "\n\ndef" in tokenizer.decode(out[:used]) and "\n\ndef" not in tokenizer.decode(out[:used - 1])
    # Text that only starts like a stop string is held back, then released.
    ts = TextStream(tokenizer, [], ["abcdef"])
    for tok in tokenizer.encode("abc"):
        assert not ts.add(tok)
    assert ts.take() == ""  # 3 characters < the 5 held back
    for tok in tokenizer.encode("xyz0123"):
        assert not ts.add(tok)
    assert ts.take() + ts.take(final=True) == "abcxyz0123"


def test_frontend_process_imports_no_torch():
    code = ("import sys; import scheduler.server.frontend, scheduler.serve_cmd, scheduler.server.supervisor, "
            "loadgen.client; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_prompt_too_long_for_any_tokenization_is_rejected_before_encoding(tiny_target):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from specstep.scheduler.server.validate import Limits, validate_generate

    tok = Tokenizer.from_folder(tiny_target)  # byte-level BPE
    assert tok.max_token_chars is not None
    limits = Limits(vocab_size=tok.vocab_size, max_prompt_len=8, max_tokens=16)
    calls = []
    tok.encode = lambda text: calls.append(text) or [1]
    with pytest.raises(ProtocolError) as e:
        validate_generate(GenerateRequest("r", prompt="x" * (8 * tok.max_token_chars + 1)), limits, tok, "1")
    assert e.value.code == ErrorCode.PROMPT_TOO_LONG and not calls
    # An unknown token may stand for any run of characters: no such bound for WordPiece-style models.
    wordpiece = Tokenizer(HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))
    assert wordpiece.max_token_chars is None
