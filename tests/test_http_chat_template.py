"""Chat templates: found in tokenizer_config.json or in the GGUF a folder was converted from, rendered exactly as
transformers' `apply_chat_template` renders them; and the typed errors of chat requests the template cannot take,
through the real HTTP server (no scheduler is needed to refuse them)."""

from __future__ import annotations

import json
import shutil

import aiohttp
import pytest

from specstep.scheduler.server.frontend import Frontend, FrontendConfig
from specstep.scheduler.server.http.chat_template import ChatTemplate, chat_messages, load_chat_template
from specstep.scheduler.server.http.openai_requests import ChatMessage
from specstep.scheduler.server.http.server import OpenAIServer
from specstep.scheduler.server.protocol import ProtocolError

# SmolLM2-Instruct's template (as its GGUF carries it), and one using what transformers adds to jinja.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EXTRAS = ("{{ bos_token }}{% for m in messages %}\n  {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
          "  {{ m['role'] | upper }}: {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}\n"
          "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "def fib(n):"}],
    [{"role": "system", "content": "Be brief <&>."}, {"role": "user", "content": "héllo \"there\""},
     {"role": "assistant", "content": "Hi."}, {"role": "tool", "content": "x"}, {"role": "user", "content": "2+2?"}],
]


def folder_with(tiny_target, tmp_path, config: dict):
    folder = tmp_path / "m"
    shutil.copytree(tiny_target, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("template", [SMOLLM2, EXTRAS])
def test_renders_as_transformers_does(tiny_target, tmp_path, template):
    from transformers import AutoTokenizer

    folder = folder_with(tiny_target, tmp_path, {"chat_template": template, "bos_token": "<|endoftext|>",
                                                 "eos_token": "<|endoftext|>"})
    ours = load_chat_template(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.render(messages, gen) == hf.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=gen)


def test_named_templates_and_special_tokens_from_the_vocabulary(tiny_target, tmp_path):
    folder = folder_with(tiny_target, tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                                   {"name": "default", "template": "D{{eos_token}}"}]})
    assert load_chat_template(folder).render([{"role": "user", "content": "x"}]) == "D<|endoftext|>"  # id 0
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{eos_token}}",
                                                              "eos_token": {"content": "</s>"}}))
    assert load_chat_template(folder).render([]) == "</s>"
    assert load_chat_template(tiny_target) is None  # no tokenizer_config.json, no GGUF


def test_the_template_of_the_gguf_a_folder_came_from(tiny_target, tmp_path):
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template(SMOLLM2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    shutil.copytree(tiny_target, folder)
    (folder / "specstep_source.json").write_text(json.dumps({"gguf": str(path)}))
    assert load_chat_template(folder).source == SMOLLM2


def test_content_parts():
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
    assert chat_messages(msgs) == [{"role": "user", "content": "ab"}]
    with pytest.raises(ProtocolError, match=r"messages\[0\].content: only text parts are supported, got 'image_url'"):
        chat_messages([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(ProtocolError, match="messages: must not be empty"):
        chat_messages([])


async def chat_status(server: OpenAIServer, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def test_chat_without_a_template_and_a_template_that_refuses(tiny_target):
    """Refused before anything reaches a scheduler, so the real frontend serves them without one."""
    frontend = Frontend(FrontendConfig(address="tcp://127.0.0.1:0", engine={}), tokenizer=None)
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    for template, message in ((None, "messages: this model has no chat template"),
                              (refusing, "messages: the model's chat template refused them: roles must alternate")):
        server = OpenAIServer(frontend, "m", template)
        await server.start("127.0.0.1", 0)
        try:
            status, body = await chat_status(server, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        finally:
            await server.stop()
        assert status == 400 and body["error"]["message"].startswith(message)
        assert (body["error"]["param"], body["error"]["type"]) == ("messages", "invalid_request_error")
