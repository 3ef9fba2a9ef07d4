"""Chat templates for tests, written in the style of three model families (not copies):

SMOLLM2   : the template of SmolLM2-135M-Instruct (as shipped in its GGUF): ChatML with a
            default system prompt when the first message is not a system message.
QWEN_LIKE : ChatML with a default system prompt, a tools block rendered with `tojson`,
            a `namespace` scan over reversed messages with `{% break %}` (loop controls),
            `| trim`, tool-call and tool-response turns and `{% generation %}` around
            assistant content.
LLAMA3_LIKE: `bos_token` + header tokens, a date line from `strftime_now` unless
            `date_string` is passed, system message extraction and `raise_exception`
            on non-alternating user/assistant turns.
`bpe_backend` trains a small byte-level BPE with given control tokens (no download).
"""

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers


def bpe_backend(control: list[str], corpus: list[str], vocab_size: int = 400) -> Backend:
    """A byte-level BPE trained on `corpus`, with `control` as special added tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=control, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- else %}
        {{- 'You are a careful assistant.\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a careful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = messages | length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content | trim + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content | default('', true) }}{%- endgeneration %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {{- '\\n<tool_call>\\n' + call | tojson + '\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user %}{{- '<!--after last user-->' }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_LIKE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ---------------------------------------------------------------------------------------------
# Tool-use templates for the multi-turn rollout tests (written for these tests, in the style of
# the families; not copies). Each renders an assistant turn as its generation prompt plus the
# content plus the end token, so a tool loop renders append-only -- except where noted.
#
# QWEN25_TOOLS: ChatML; tools listed in the system turn; `tool_calls` rendered as Hermes
#               <tool_call> JSON; consecutive 'tool' messages share one user turn of
#               <tool_response> blocks.
# QWEN3_THINK : QWEN25_TOOLS plus Qwen3's reasoning rules: assistant turns after the last
#               real user query keep their <think> block (the last one gets an empty block if
#               it has none), earlier ones lose it; enable_thinking=false puts an empty block
#               in the generation prompt. Append-only for tool loops with thinking on; NOT
#               append-only once a new user message follows, or with thinking off.
# LLAMA31_TOOLS: Llama-3.1 headers; 'tool' messages rendered as 'ipython' turns; tool calls
#               as a bare {"name", "parameters"} JSON object; content trimmed.
# ---------------------------------------------------------------------------------------------

_CHATML_SYSTEM_AND_TOOLS = """{%- set sys = messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' + sys + '\\n\\n# Tools\\nCall a function by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}
{%- endif %}
"""

_CHATML_TOOL_TURN = """    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
"""

_CHATML_CALLS = """{%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}
        {%- endfor %}"""

QWEN25_TOOLS = _CHATML_SYSTEM_AND_TOOLS + """{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role in ('user', 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        """ + _CHATML_CALLS + """
        {{- '<|im_end|>\\n' }}
""" + _CHATML_TOOL_TURN + """    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

QWEN3_THINK = _CHATML_SYSTEM_AND_TOOLS + """{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set i = messages | length - 1 - loop.index0 %}
    {%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = i %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role in ('user', 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        """ + _CHATML_CALLS + """
        {{- '<|im_end|>\\n' }}
""" + _CHATML_TOOL_TURN + """    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

LLAMA31_TOOLS = """{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system_message }}
{%- if tools %}
    {{- '\\n\\nTo call a function, answer with only {"name": function name, "parameters": {argument: value}}. Functions:' }}
    {%- for t in tools %}{{- '\\n' + t | tojson }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role in ('tool', 'ipython') %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + {'name': call.name, 'parameters': call.arguments} | tojson + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
