"""The default model's tokenizer: one token per byte (ids 0..255) plus chat specials.

Built with the `tokenizers` library (byte-level BPE with no merges, so every byte is its
own token and `id == byte value`) and saved as `tokenizer.json` + `tokenizer_config.json`,
which `transformers.AutoTokenizer.from_pretrained(dir)` and the sglang-router load
offline. Deliberately left out: merges, normalisation, a BOS token (prompts are raw bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIALS = (EOS, IM_START, IM_END, PAD)  # ids 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIALS)

# ChatML; a generation prompt opens the assistant turn, which ends with <|im_end|>. OpenAI tool
# calling in the hermes format (Qwen2.5's): the tools in a system turn first, each as its name and
# parameters only (``add(a, b)``: this byte model reads every character, so the schema's JSON would
# cost it hundreds of tokens per turn), and an assistant turn's calls as <tool_call> blocks after its
# content, which may be null (docs/design.md section 12).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool.function.name + '(' }}"
    "{{ (tool.function.parameters or {}).get('properties', {}) | join(', ') }}{{ ')' }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    "{% for call in message.tool_calls %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel tokenizers."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer() -> Tokenizer:
    """A byte-level tokenizer whose token id for byte b is b; specials follow at 256.."""
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to out_dir."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # Keep the template inside tokenizer_config.json too (older loaders and the router read
    # it there) and name a class every transformers release knows.
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
