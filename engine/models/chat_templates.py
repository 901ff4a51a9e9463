"""Chat templates and end-of-turn tokens for models whose file carries none (a GGUF converted without its
tokenizer_config, such as the packaged Gemma 3 270M): the model family's own published template, by model_type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatFormat:
    template: str
    end_of_turn: tuple[str, ...]  # tokens that end the model's turn: generation stops at them like at EOS


# Gemma 3's instruction-tuned template (system prompt folded into the first user turn, "model" as the
# assistant's role), text parts only.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHAT_FORMATS: dict[str, ChatFormat] = {
    "gemma3_text": ChatFormat(GEMMA3_TEMPLATE, ("<end_of_turn>",)),
}


def chat_format(model_type: str) -> ChatFormat | None:
    return CHAT_FORMATS.get(model_type)


def read_chat_template(value: str) -> str:
    """The configured chat_template: a Jinja file's path or the template's own text, checked as Jinja (a template
    that cannot parse would fail every chat request; here it fails the start, in one line)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    is_text = "{{" in value or "{%" in value
    path = Path(value).expanduser()
    if not is_text:
        if not path.is_file():
            raise ValueError(f"chat_template: no file {value!r} (a Jinja template's path, or its text)")
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"chat_template: {path} cannot be read as UTF-8 text: {error}") from None
    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(value)  # transformers renders it so
    except jinja2.TemplateSyntaxError as error:
        where = "the text given" if is_text else str(path)
        raise ValueError(f"chat_template: {where} is not a Jinja template: {error} (line {error.lineno})") from None
    return value
