"""Chat templates with tool formats, in the shapes of real ones (Qwen 2.5 / Hermes and Llama 3.1), for tiny models."""

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{%- for message in messages %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}"
    "<|end_header_id|>\n\n"
    "{%- if message.role == 'user' and tools and loop.last %}Given the following functions, respond with a JSON for a "
    "function call with its proper arguments.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{%- if message.tool_calls %}{% for tc in message.tool_calls %}<|python_tag|>{\"name\": \"{{ tc.function.name }}\", "
    "\"parameters\": {{ tc.function.arguments | tojson }}}{% endfor %}{% else %}{{ message.content }}{% endif %}"
    "<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
