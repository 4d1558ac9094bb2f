"""ChatML as the built-in models speak it: special tokens, a prefix-stable chat template,
and the generic text their tokenizers are trained on besides a task's.

The built-in base model (``sf_app.base_model``) and the tiny random models of each family
(``seamlessflow.assets.families``) share these, so a conversation renders to the same
text for both.
"""

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END)

# Qwen2.5-style ChatML, changed in two places so that it is prefix-stable:
# - no default system prompt is invented when there is neither a system message nor tools;
# - every tool message is its own turn (Qwen2.5 merges consecutive tool messages into one
#   user turn, whose closing tag then depends on the message that follows).
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions.'
        + ' Function signatures are within <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each call, return a JSON object within <tool_call></tool_call>:\n'
        + '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        + '</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if loop.first and not message.content %}
                {{- '<tool_call>\n' }}
            {%- else %}
                {{- '\n<tool_call>\n' }}
            {%- endif %}
            {{- '{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments + '}' }}
            {%- else %}
                {{- (tool_call.arguments | tojson) + '}' }}
            {%- endif %}
            {{- '\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content
            + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()

# Generic text for the tokenizer besides the task: roles, tool-call scaffolding, digits.
GENERIC_TEXT = (
    "system user assistant tool\n",
    "You are a helpful assistant.\n",
    "<tool_response>\n</tool_response>\n<tools>\n</tools>\n",
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n',
    '{"type": "function", "function": {"name": "calculator", "description": "Add numbers.",'
    ' "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}\n',
    "0 1 2 3 4 5 6 7 8 9 10 100 -1 + - * / = ? . , : ; ( ) [ ] { }\n",
    "The answer is 42. What is the sum? Compute the result.\n",
    "Please think step by step, then give only the final answer.\n",
    "Call the calculator tool when you need it; its response follows.\n",
    "I added the two numbers together and checked my work.\n",
    "Sorry, I cannot help with that request. Thank you!\n",
    "Here is the error message returned by the function call.\n",
)
