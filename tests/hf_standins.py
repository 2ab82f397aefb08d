"""Stand-ins for users' Hugging Face checkpoint directories, built at test time.

Each is what `transformers` writes with `save_pretrained`: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with the chat template, or chat_template.jinja as
newer transformers write it), generation_config.json. The tokenizers are small byte-level
BPEs that split and merge as the real ones do (`arl.text.hf_codec.train_bpe_tokenizer`
with split="real": Qwen2's / Llama 3's pre-tokenizer regex, digits one at a time or up
to three, punctuation runs such as " -", ")\n", ".\n", '."' and blank lines "\n\n" one
token) with the family's real special tokens and chat template; the models are tiny and
their vocabularies padded past the tokenizer's, as Qwen's are. Nothing is downloaded.
"""

from __future__ import annotations

import os

# Qwen2.5-Instruct's chat template (the tool-call branches included).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) "
    "or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

# Qwen3's chat template (thinking blocks; tool branches left out).
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string "
    "and not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n")

# Meta-Llama-3-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Llama-3.1-Instruct's chat template (date header, tools, the ipython role).
LLAMA31_TEMPLATE = '{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n{#- This block extracts the system message, so we can slot it into the right place. #}\n{%- if messages[0][\'role\'] == \'system\' %}\n    {%- set system_message = messages[0][\'content\']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = "" %}\n{%- endif %}\n\n{#- System message + builtin tools #}\n{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n{%- if builtin_tools is defined or tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n{%- if builtin_tools is defined %}\n    {{- "Tools: " + builtin_tools | reject(\'equalto\', \'code_interpreter\') | join(", ") + "\\n\\n"}}\n{%- endif %}\n{{- "Cutting Knowledge Date: December 2023\\n" }}\n{{- "Today Date: " + date_string + "\\n\\n" }}\n{%- if tools is not none and not tools_in_user_message %}\n    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n    {{- "Do not use variables.\\n\\n" }}\n    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- "\\n\\n" }}\n    {%- endfor %}\n{%- endif %}\n{{- system_message }}\n{{- "<|eot_id|>" }}\n\n{#- Custom tools are passed in a user message with some extra guidance #}\n{%- if tools_in_user_message and not tools is none %}\n    {#- Extract the first user message so we can plug it in here #}\n    {%- if messages | length != 0 %}\n        {%- set first_user_message = messages[0][\'content\']|trim %}\n        {%- set messages = messages[1:] %}\n    {%- else %}\n        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n{%- endif %}\n    {{- \'<|start_header_id|>user<|end_header_id|>\\n\\n\' -}}\n    {{- "Given the following functions, please respond with a JSON for a function call " }}\n    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n    {{- "Do not use variables.\\n\\n" }}\n    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- "\\n\\n" }}\n    {%- endfor %}\n    {{- first_user_message + "<|eot_id|>"}}\n{%- endif %}\n\n{%- for message in messages %}\n    {%- if not (message.role == \'ipython\' or message.role == \'tool\' or \'tool_calls\' in message) %}\n        {{- \'<|start_header_id|>\' + message[\'role\'] + \'<|end_header_id|>\\n\\n\'+ message[\'content\'] | trim + \'<|eot_id|>\' }}\n    {%- elif \'tool_calls\' in message %}\n        {%- if not message.tool_calls|length == 1 %}\n            {{- raise_exception("This model only supports single tool-calls at once!") }}\n        {%- endif %}\n        {%- set tool_call = message.tool_calls[0].function %}\n        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n            {{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n\' -}}\n            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n            {%- for arg_name, arg_val in tool_call.arguments | items %}\n                {{- arg_name + \'="\' + arg_val + \'"\' }}\n                {%- if not loop.last %}\n                    {{- ", " }}\n                {%- endif %}\n                {%- endfor %}\n            {{- ")" }}\n        {%- else  %}\n            {{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n\' -}}\n            {{- \'{"name": "\' + tool_call.name + \'", \' }}\n            {{- \'"parameters": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- "}" }}\n        {%- endif %}\n        {%- if builtin_tools is defined %}\n            {#- This means we\'re in ipython mode #}\n            {{- "<|eom_id|>" }}\n        {%- else %}\n            {{- "<|eot_id|>" }}\n        {%- endif %}\n    {%- elif message.role == "tool" or message.role == "ipython" %}\n        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n        {%- if message.content is mapping or message.content is iterable %}\n            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n        {%- endif %}\n        {{- "<|eot_id|>" }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n\' }}\n{%- endif %}\n'

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")
LLAMA31_SPECIALS = LLAMA3_SPECIALS + ("<|eom_id|>", "<|python_tag|>")


def _corpus() -> list[str]:
    from arl.data import word_problems
    from arl.data.task_files import read_task_file
    from configs.tokenizer_corpus import env_corpus

    lines = env_corpus(num_expressions=100)
    lines += [t.prompt for t in read_task_file(word_problems.SHIPPED_JSONL)[:200]]
    lines += ["You are a helpful assistant.", "system user assistant", "wrong, try again",
              "no answer", "correct", "The answer is", "<think>", "</think>"]
    # Text across the seams real vocabularies merge (`train_bpe_tokenizer`'s SEAM_MERGES).
    lines += ["wrong: -162", "(no rows)\n", "It ends here.\n", 'He said "stop."', "a\n\nb"]
    return lines


def _tokenizer(specials, vocab_size: int, digit_group: int = 1):
    from arl.text.hf_codec import train_bpe_tokenizer
    return train_bpe_tokenizer(_corpus(), vocab_size=vocab_size, special_tokens=specials,
                               digit_group=digit_group, split="real")


def _save_tokenizer(directory, tokenizer, *, template, bos, eos, pad):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                   pad_token=pad)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


def build_standin(directory, family: str = "qwen2", *, seed: int = 0,
                  tokenizer_vocab: int = 360, padded_vocab: int = 384):
    """Writes a stand-in checkpoint directory of `family` ("qwen2": Qwen2.5-style, "qwen3":
    Qwen3-style, "llama3": Llama-3-style, "llama3.1": Llama-3.1-style: its template with
    the date header, BOS, up to three digits per token, eos ids end_of_text, eom and eot)
    and returns it. The model's vocabulary is the tokenizer's rounded up to 64 when the
    tokenizer has more than `padded_vocab` tokens."""
    import torch
    import transformers
    from transformers import GenerationConfig

    os.makedirs(directory, exist_ok=True)
    if family in ("qwen2", "qwen3"):
        tokenizer = _tokenizer(QWEN_SPECIALS, tokenizer_vocab)
        ids = {t: tokenizer.token_to_id(t) for t in QWEN_SPECIALS}
        _save_tokenizer(directory, tokenizer,
                        template=QWEN25_TEMPLATE if family == "qwen2" else QWEN3_TEMPLATE,
                        bos=None, eos="<|im_end|>", pad="<|endoftext|>")
        padded_vocab = max(padded_vocab, -(-tokenizer.get_vocab_size() // 64) * 64)
        common = dict(vocab_size=padded_vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32768, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, tie_word_embeddings=True,
                      bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        if family == "qwen2":
            config = transformers.Qwen2Config(**common)
            model_class = transformers.Qwen2ForCausalLM
        else:
            config = transformers.Qwen3Config(head_dim=16, **common)
            model_class = transformers.Qwen3ForCausalLM
        generation = GenerationConfig(
            bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
            eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], do_sample=True,
            temperature=0.7, top_p=0.8)
    elif family in ("llama3", "llama3.1"):
        specials = LLAMA3_SPECIALS if family == "llama3" else LLAMA31_SPECIALS
        tokenizer = _tokenizer(specials, tokenizer_vocab,
                               digit_group=1 if family == "llama3" else 3)
        ids = {t: tokenizer.token_to_id(t) for t in specials}
        if family == "llama3.1":  # as Meta's tokenizer.json: encode() puts BOS in front
            from tokenizers import processors
            tokenizer.post_processor = processors.TemplateProcessing(
                single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", ids["<|begin_of_text|>"])])
        _save_tokenizer(directory, tokenizer,
                        template=LLAMA3_TEMPLATE if family == "llama3" else LLAMA31_TEMPLATE,
                        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None)
        padded_vocab = max(padded_vocab, -(-tokenizer.get_vocab_size() // 64) * 64)
        config = transformers.LlamaConfig(
            vocab_size=padded_vocab, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=ids["<|begin_of_text|>"],
            eos_token_id=ids["<|eot_id|>"])
        model_class = transformers.LlamaForCausalLM
        eos = ["<|end_of_text|>", "<|eot_id|>"] if family == "llama3" else [
            "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
        generation = GenerationConfig(
            bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids[t] for t in eos],
            do_sample=True, temperature=0.6, top_p=0.9)
    else:
        raise ValueError(f"family must be 'qwen2', 'qwen3', 'llama3' or 'llama3.1', got "
                         f"{family!r}")
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(directory)
    generation.save_pretrained(directory)
    return str(directory)


def build_reward_model_standin(directory, family: str = "qwen2", *, seed: int = 0):
    """Writes a stand-in outcome reward model directory: `build_standin`'s tokenizer and
    chat template over a `{Qwen2,Llama}ForSequenceClassification` with num_labels=1 and
    the tokenizer's pad id (Llama's tokenizer has none: its eos is the pad id, as Llama
    reward models set it), and returns it."""
    import torch
    import transformers

    build_standin(directory, family, seed=seed)
    config = transformers.AutoConfig.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    config.num_labels = 1
    config.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                           else tokenizer.eos_token_id)
    model_class = {"qwen2": transformers.Qwen2ForSequenceClassification,
                   "llama3": transformers.LlamaForSequenceClassification}[family]
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name == "generation_config.json":
            os.remove(os.path.join(directory, name))
    torch.manual_seed(seed + 1)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # a score head of the decoder's scale, so scores differ by row
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    return str(directory)
