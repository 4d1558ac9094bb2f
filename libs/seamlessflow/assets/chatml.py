"""ChatML as the built-in models speak it: special tokens, a prefix-stable chat template,
and the generic text their tokenizers are trained on besides a task's.

The built-in base model (``sf_app.base_model``) and the tiny random models of each family
(``seamlessflow.assets.families``) share these, so a conversation renders to the same
text for both. ``chat_template`` builds every ChatML template of the two: this module's
``CHAT_TEMPLATE`` (also the ``qwen2`` families') and the ``qwen3`` family's.
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
# Every ChatML template here is built by ``chat_template``; what differs between them is
# the tools' wording and whether assistant turns carry reasoning (Qwen3's <think>).

_SYSTEM_TURN_OPEN = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
"""
_TOOL_SIGNATURES = r"""
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
"""
_SYSTEM_TURN_ALONE = r"""
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
"""
# reasoning is kept only for the turns after the last user message
_LAST_USER_MESSAGE = r"""
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
"""
_ASSISTANT_TURN_OPEN = r"""
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
"""
_ASSISTANT_CONTENT = r"""
        {{- '<|im_start|>assistant\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
"""
# the reasoning: ``reasoning_content``, or a leading <think>...</think> block of the content
_ASSISTANT_REASONING_AND_CONTENT = r"""
        {%- set content = message.content or '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string and message.reasoning_content %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning and loop.index0 > ns.last_query_index %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- elif reasoning %}
            {{- content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
"""
_TOOL_CALLS_OPEN = r"""
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
"""
_TOOL_CALLS_REST = r"""
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
"""
# ``enable_thinking=False``: an empty think block ends the generation prompt
_THINKING_OFF = r"""
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
"""
_GENERATION_PROMPT_END = r"""
{%- endif %}
"""


def chat_template(tools_preamble: str, tools_instructions: str, *, reasoning: bool) -> str:
    """A prefix-stable ChatML template. With ``tools``, the system turn holds
    ``tools_preamble``, the tools' signatures, then ``tools_instructions`` (each a Jinja
    statement writing that text, indented as a line of the ``if tools`` block). With
    ``reasoning`` (Qwen3), an assistant message's reasoning is rendered in a
    ``<think>`` block for the turns after the last user message only, and
    ``enable_thinking=False`` appends an empty one to the generation prompt."""
    parts = [
        _SYSTEM_TURN_OPEN,
        tools_preamble,
        _TOOL_SIGNATURES,
        tools_instructions,
        _SYSTEM_TURN_ALONE,
        _LAST_USER_MESSAGE if reasoning else "",
        _ASSISTANT_TURN_OPEN,
        _ASSISTANT_REASONING_AND_CONTENT if reasoning else _ASSISTANT_CONTENT,
        _TOOL_CALLS_OPEN,
        # the first call follows the content on a new line, or opens the turn itself
        "            {%- if loop.first and not "
        + ("content" if reasoning else "message.content")
        + " %}",
        _TOOL_CALLS_REST,
        _THINKING_OFF if reasoning else "",
        _GENERATION_PROMPT_END,
    ]
    return "\n".join(part.strip("\n") for part in parts if part).strip()


CHAT_TEMPLATE = chat_template(
    tools_preamble=r"""
    {{- '# Tools\n\nYou may call one or more functions.'
        + ' Function signatures are within <tools></tools>:\n<tools>' }}
""",
    tools_instructions=r"""
    {{- '\n</tools>\n\nFor each call, return a JSON object within <tool_call></tool_call>:\n'
        + '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        + '</tool_call><|im_end|>\n' }}
""",
    reasoning=False,
)

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
