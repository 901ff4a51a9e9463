"""The chat_template key (vLLM's --chat-template): a Jinja file or text replaces the model's template, and one that
cannot be used fails the start in one line, before the weights load."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from tests.support.engine_helpers import make_llm

TEMPLATE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"


@pytest.mark.parametrize("as_file", [True, False])
def test_a_configured_template_replaces_the_models(tiny_llama_dir: Path, tmp_path: Path, as_file: bool) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    llm = make_llm(tiny_llama_dir, chat_template=str(path) if as_file else TEMPLATE)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == "[USER] hi\n[ASSISTANT]"


@pytest.mark.parametrize(
    "value, message",
    [
        ("no/such/template.jinja", "chat_template: no file 'no/such/template.jinja'"),
        ("{% for m in messages %}unclosed", "chat_template: the text given is not a Jinja template"),
    ],
)
def test_a_template_that_cannot_be_used_fails_the_start(tiny_llama_dir: Path, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama_dir, chat_template=value)


def test_a_template_file_that_is_not_text_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "binary.jinja"
    path.write_bytes(b"\xff\xfe\x00 {{ x }}")
    with pytest.raises(ValueError, match="binary.jinja cannot be read as UTF-8 text"):
        make_llm(tiny_llama_dir, chat_template=str(path))


def test_a_templates_long_refusal_is_cut_at_a_words_end(tiny_llama_dir: Path) -> None:
    refusing = "{{ raise_exception('no: ' + messages[0]['content']) }}"
    llm = make_llm(tiny_llama_dir, chat_template=refusing)
    with pytest.raises(ValueError, match="the chat template rejected the messages") as raised:
        llm.chat([{"role": "user", "content": "word " * 100}], use_tqdm=False)
    message = str(raised.value)
    assert message.endswith("word ...") and len(message) < 300, message
