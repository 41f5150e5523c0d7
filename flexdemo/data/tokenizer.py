"""A small byte-level BPE tokenizer trained on the stdlib corpus.

Written as tokenizer.json + tokenizer_config.json, the two files torchtitan
0.2.2's HuggingFaceTokenizer reads from `[model] hf_assets_path`: it loads
tokenizer.json and takes bos/eos from tokenizer_config.json.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# 2048 total ids (special tokens included) = vocab_size of torchtitan's llama3
# "debugmodel", so that flavour runs unchanged with this tokenizer.
VOCAB_SIZE = 2048
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2
# A directory holding one of these has a tokenizer torchtitan's HuggingFaceTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def train_tokenizer(documents: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE; deterministic for the same documents in the same order."""
    tok = Tokenizer(models.BPE())
    # Byte-level: every string encodes (no unknown token) and decodes back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """tokenizer_config.json contents in the Hugging Face layout.

    add_bos_token/add_eos_token are the defaults of a bare encode(); torchtitan's
    text dataset always passes add_bos=True, add_eos=True explicitly.
    """
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }


def tokenizer_files(tok: Tokenizer) -> dict[str, bytes]:
    """File name -> exact bytes to write into the assets directory."""
    cfg = json.dumps(tokenizer_config(tok), indent=2, sort_keys=True) + "\n"
    return {
        "tokenizer.json": tok.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": cfg.encode("utf-8"),
    }


class FileTokenizer:
    """A ``tokenizer.json`` with torchtitan's encode(text, add_bos, add_eos): BOS / EOS named by
    ``tokenizer_config.json`` where it names them, else flexdemo's."""

    def __init__(self, path: str):
        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        names = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
        config = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                for key, value in json.load(f).items():
                    if key in names and value:
                        names[key] = value["content"] if isinstance(value, dict) else value
        self.bos_id = self._tok.token_to_id(names["bos_token"])
        self.eos_id = self._tok.token_to_id(names["eos_token"])

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._tok.encode(text).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids + (
            [self.eos_id] if add_eos and self.eos_id is not None else [])
