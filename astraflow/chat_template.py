"""The chat template of the file-free byte-level tokenizer (``byt5``), with tools, as a Jinja template like any model's.

A model's chat template turns OpenAI messages (and the ``tools`` a call declares) into the text the model
reads; the OpenAI-compatible facade renders every chat through it (``tokenizer.apply_chat_template``), so a
pretrained model's own template and this one take the same path. This one is short because every byte is a
token:

    <|tools|>                                       (only when tools are declared: one signature per line,
    calc(expression: string) — Evaluate arithmetic.  "?" marks an optional argument)
    <|system|>
    You are a calculator agent.
    <|user|>
    Compute 3*4+5.
    <|assistant|>
    <tool_call>{"name": "calc", "arguments": {"expression": "3*4+5"}}</tool_call>
    <|tool|>
    17
    <|assistant|>
    17

A message is ``<|role|>``, a newline, its text and its tool calls, and a newline; the generation prompt is
``<|assistant|>`` and a newline. Tool calls are written as Qwen's templates teach them (the Hermes format),
so one parser (``tool_calls.read_calls``) reads what either kind of model writes.
"""

from __future__ import annotations

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_NL = "{{ '\\n' }}"
_TOOLS = (
    "{%- if tools -%}<|tools|>" + _NL +
    "{%- for tool in tools -%}"
    "{%- set f = tool.function if tool.function is defined else tool -%}"
    "{%- set params = f.parameters if f.parameters is defined and f.parameters else {} -%}"
    "{%- set required = params.required if params.required is defined and params.required else [] -%}"
    "{{ f.name }}("
    "{%- for name, schema in (params.properties if params.properties is defined and params.properties else {}).items() -%}"
    "{{ ', ' if not loop.first }}{{ name }}{{ '?' if name not in required }}: "
    "{{ schema.type if schema.type is defined and schema.type is string else 'any' }}"
    "{%- endfor -%})"
    "{{ ' — ' ~ f.description if f.description is defined and f.description }}" + _NL +
    "{%- endfor -%}{%- endif -%}"
)
_MESSAGE = (
    "{%- for m in messages -%}<|{{ m.role }}|>" + _NL +
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content -%}{%- for part in m.content -%}{{ part.text }}{%- endfor -%}{%- endif -%}"
    "{%- for call in (m.tool_calls if m.tool_calls is defined and m.tool_calls else []) -%}"
    + CALL_OPEN + '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments }}}' + CALL_CLOSE +
    "{%- endfor -%}" + _NL + "{%- endfor -%}"
)
CHAT_TEMPLATE = _TOOLS + _MESSAGE + "{%- if add_generation_prompt -%}<|assistant|>" + _NL + "{%- endif -%}"
"""The template ``models.load_tokenizer("byt5")`` sets on the tokenizer."""
