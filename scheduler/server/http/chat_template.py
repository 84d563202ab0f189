"""A model's chat template: found where transformers and llama.cpp keep it, rendered the way transformers does.

Sources, first found wins: `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates, of
which "default"), `chat_template.jinja` beside it, then the GGUF the folder was converted from (its
`tokenizer.chat_template`, named in `specstep_source.json`). Rendering follows transformers'
`apply_chat_template`: a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, the loop-controls
extension, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML, with the special tokens
(`bos_token`, `eos_token`) as variables. The text is then tokenized without special tokens added, as
transformers does, so a client gets the prompt a transformers user would get.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from specstep.scheduler.server.protocol import ErrorCode, ProtocolError


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str  # the jinja text
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token (their text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return _compile(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ProtocolError(ErrorCode.INVALID_PARAMS, f"messages: the model's chat template refused them: {e}") \
                from None


def no_template_error() -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_PARAMS, "messages: this model has no chat template (neither its "
                         "tokenizer_config.json nor its GGUF metadata holds one); use /v1/completions with a prompt")


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a model folder (see the module's docstring), or None when it has none."""
    folder = Path(folder)
    config = _json(folder / "tokenizer_config.json")
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not source and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    if not source:
        source = _gguf_template(folder)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _special_tokens(folder, config))


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _gguf_template(folder: Path) -> str | None:
    gguf_path = _json(folder / "specstep_source.json").get("gguf")
    if not gguf_path or not Path(gguf_path).is_file():
        return None
    import gguf

    f = gguf.GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if f is None else f.contents()


def _special_tokens(folder: Path, config: dict) -> dict[str, str]:
    """bos_token / eos_token as text: from tokenizer_config.json, else their ids (config.json) in the vocabulary."""
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    missing = [n for n in ("bos_token", "eos_token") if n not in out]
    model_config = _json(folder / "config.json")
    if missing and (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        for name in missing:
            tid = model_config.get(f"{name}_id")
            tid = tid[0] if isinstance(tid, list) and tid else tid
            text = tok.id_to_token(tid) if isinstance(tid, int) else None
            if text is not None:
                out[name] = text
    return out


_compiled: dict[str, Any] = {}


def _compile(source: str):
    """The compiled template (cached: one model, one template, compiled once)."""
    if source not in _compiled:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _compiled[source] = env.from_string(source)
    return _compiled[source]


def chat_messages(messages: list) -> list[dict[str, Any]]:
    """The request's messages as the plain dicts a template reads: content parts joined into one text."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ProtocolError(ErrorCode.INVALID_PARAMS, f"messages[{i}].content: only text parts are "
                                        f"supported, got {kind!r}")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ProtocolError(ErrorCode.INVALID_PARAMS, f"messages[{i}].content: must be a string or a list of "
                                "text parts")
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    if not out:
        raise ProtocolError(ErrorCode.INVALID_PARAMS, "messages: must not be empty")
    return out
