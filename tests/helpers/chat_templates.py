"""Published chat templates (copied from the models' tokenizer_config.json; nothing downloaded), their twins that
mark the assistant turns with {% generation %} for transformers' own mask, and a small local fast tokenizer that
holds every special token they use."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen/Qwen2-7B-Instruct
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML (teknium/OpenHermes-2.5-Mistral-7B)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == "
    "'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# (template, its generation-marked twin, the end-of-turn token, whether the template trims contents)
TEMPLATES = {
    "llama3": (LLAMA3, LLAMA3_MARKED, "<|eot_id|>", True),
    "qwen2": (QWEN2, QWEN2_MARKED, "<|im_end|>", False),
    "chatml": (CHATML, CHATML_MARKED, "<|im_end|>", False),
}

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHARS = [chr(code) for code in range(32, 127)] + ["\n", "\t"]


def save_tokenizer(directory: Path, template: str | None = None, bos: str | None = None, eos: str = "<|im_end|>",
                   extra: int = 0) -> Path:
    """A character-level fast tokenizer (printable ASCII, newline and tab, then SPECIALS, then `extra` filler
    tokens) saved in `directory`: it puts `bos` before every text when given, ends with `eos`, pads with <pad>, and
    renders chats by `template`."""
    vocab = {token: index for index, token in enumerate([*SPECIALS, *CHARS, *(f"<x{i}>" for i in range(extra))])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                               special_tokens=[(bos, vocab[bos])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token=eos, bos_token=bos)
    if template is not None:
        tokenizer.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory
