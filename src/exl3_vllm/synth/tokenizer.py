"""A small byte-level BPE tokenizer written by hand as tokenizers JSON (no hub, no extra dependency).

Byte-level BPE rather than WordLevel because transformers 5 rebuilds some model types' tokenizers
(e.g. qwen2 -> Qwen2Tokenizer) as byte-level BPE from tokenizer.json's vocab and merges.
"""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Plain-text roles; bos_token first because vLLM's chat endpoint tokenizes without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
    "{{ eos_token }} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)
MIN_VOCAB = len(SPECIAL_TOKENS) + 256 + 1  # specials, the byte alphabet, one word
# A multimodal model's placeholder tokens (Qwen-VL's names, which its processor looks up), at the top ids.
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}


def vision_token_ids(vocab_size: int) -> dict[str, int]:
    return {k: vocab_size - len(VISION_TOKENS) + i for i, k in enumerate(VISION_TOKENS)}


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def word(i: int) -> str:
    """Bijective base-26: 0 -> 'a', 25 -> 'z', 26 -> 'aa'; a word's prefix always has a smaller index."""
    s = ""
    i += 1
    while i > 0:
        i -= 1
        s = chr(97 + i % 26) + s
        i //= 26
    return s


def vocabulary(vocab_size: int) -> tuple[list[str], list[str]]:
    """Tokens in id order (specials, 256 byte characters, ' a', ' b', ...) and the BPE merges."""
    space = _byte_chars()[ord(" ")]
    tokens = list(SPECIAL_TOKENS) + _byte_chars()
    merges = []
    for i in range(vocab_size - len(tokens)):
        w = word(i)
        merges.append(f"{space} {w}" if len(w) == 1 else f"{space}{w[:-1]} {w[-1]}")
        tokens.append(space + w)
    return tokens, merges


def _added(i: int, tok: str) -> dict:
    return {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _specials(vocab_size: int, vision: bool) -> list[tuple[int, str]]:
    extra = list(zip(vision_token_ids(vocab_size).values(), VISION_TOKENS.values())) if vision else []
    return list(enumerate(SPECIAL_TOKENS)) + extra


def tokenizer_json(vocab_size: int, vision: bool = False) -> dict:
    """A byte-level BPE (GPT-2/Llama-3/Qwen style): every text encodes, words ' a'..' zz..' are one token. vision:
    the last words give way to the vision placeholders (no word is a prefix of a later one, so no merge breaks)."""
    bos = SPECIAL_TOKENS[BOS_ID]
    n = len(VISION_TOKENS) if vision else 0
    tokens, merges = vocabulary(vocab_size - n)
    tokens += list(VISION_TOKENS.values())[:n]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added(i, t) for i, t in _specials(vocab_size, vision)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


def tokenizer_files(vocab_size: int, model_max_length: int, vision: bool = False) -> dict[str, dict]:
    names = dict(zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS))
    config = {
        "added_tokens_decoder": {str(i): {k: v for k, v in _added(i, t).items() if k != "id"}
                                 for i, t in _specials(vocab_size, vision)},
        **{k: names[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {k: names[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    return {"tokenizer.json": tokenizer_json(vocab_size, vision), "tokenizer_config.json": config,
            "special_tokens_map.json": special_map, "generation_config.json": generation}


def write_tokenizer(out_dir: str, vocab_size: int, model_max_length: int, vision: bool = False) -> None:
    for name, data in tokenizer_files(vocab_size, model_max_length, vision).items():
        indent = None if name == "tokenizer.json" else 2
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, ensure_ascii=False)
            f.write("\n")
