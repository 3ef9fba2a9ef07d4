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
"""

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
