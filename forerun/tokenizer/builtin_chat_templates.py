"""Chat templates for GGUF files that carry none, by architecture.

Some GGUF conversions leave out ``tokenizer.chat_template`` (the Gemma 3
270M preset's does).  llama.cpp then falls back on templates it knows by
name; forerun does the same for the architectures listed here, with the
template the model's own ``tokenizer_config.json`` ships, and refuses a
chat for any other file without one (``--raw`` still works).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# google/gemma-3-270m-it's tokenizer_config.json (text parts; an image is
# its start marker, as there).
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

BUILTIN_CHAT_TEMPLATES = {"gemma3": GEMMA3}


def gguf_chat_template(meta: Mapping[str, Any]) -> str | None:
    """The GGUF's own chat template, else the built-in one of its
    architecture, else None."""
    return (meta.get("tokenizer.chat_template")
            or BUILTIN_CHAT_TEMPLATES.get(meta.get("general.architecture", "")))
