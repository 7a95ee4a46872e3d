"""Offline tokenizers: the byte tokenizer, loading any local one, and the ids a model needs.

- ``build_byte_tokenizer()``: a byte-level tokenizer (token id == byte value for the 256 bytes,
  then a few specials) with a small ChatML-style chat template. It round-trips any UTF-8 text
  exactly, needs no training and no download.
- ``load_tokenizer(path)``: load a local tokenizer folder (or the byte tokenizer for ``"byte"``),
  robust to transformers picking a class that splits text unlike the saved ``tokenizer.json``.
- ``stop_token_ids`` / ``pad_token_id`` / ``check_vocab``: the ids generation stops at and pads
  with, and whether a model's embedding holds every token id.

The tiny models (``relax.models._tiny``, ``relax.models._omni``) build on these tokenizers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from relax.errors import ConfigError, ConfigIssue, EngineError

log = logging.getLogger(__name__)

BYTE_TOKENIZER = "byte"
"""The name ``model.tokenizer`` uses for the built-in byte-level tokenizer."""

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, IM_START, IM_END)
"""Specials of the byte tokenizer, with ids 256, 257, … in this order."""

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}"
    "{{ '\\n' }}{% endfor %}"
    '{{ \'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>\''
    " + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: one ``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn; a reply ends with ``<|im_end|>``.
Tools (OpenAI ``tools``) are listed in a first system turn; an assistant turn's tool calls are
written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes/Qwen style)."""

# Text whose encoding is compared between loading paths (see ``load_tokenizer``): ASCII,
# spaces in odd places, digits, accents, a decomposed "é" and a ligature (which an NFC/NFKC
# normaliser, as in ``Qwen2Tokenizer``, would silently rewrite), CJK, an emoji and a special.
_PROBE = "  Hello,world! 12+345=357\n\té e\u0301 \ufb01 中文 🙂 <|im_end|>x"

# Saved ``tokenizer_class`` values that mean "tokenizer.json is the whole tokenizer".
_FILE_ONLY_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


# --------------------------------------------------------------------------- tokenizers


def _byte_alphabet() -> list[str]:
    """GPT-2's byte → printable-character table (``bytes_to_unicode``), indexed by byte.

    The ByteLevel pre-tokenizer maps byte b to this character; the vocabulary uses the same
    characters so that a byte's token id is its value.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars: list[str] = []
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_byte_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """The offline byte-level tokenizer: ids 0-255 are the bytes, 256+ the specials.

    No merges, so every UTF-8 string encodes to exactly its bytes and decodes back unchanged.
    Padding is on the left (what batched generation needs); ``<|im_end|>`` ends a chat reply and
    ``<|eos|>`` ends a document — ``stop_token_ids`` returns both.
    """
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # use_regex=False: without merges the split cannot change the ids, and skipping it keeps
    # whitespace handling trivially exact.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    for offset, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == 256 + offset, token
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a generation: the tokenizer's EOS plus the chat end-of-turn, when present."""
    ids: list[int] = []
    candidates = [
        tokenizer.eos_token_id,
        *(tokenizer.convert_tokens_to_ids(t) for t in (IM_END, "<|endoftext|>")),
    ]
    for token_id in candidates:
        if token_id is not None and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(int(token_id))
    return ids


def load_tokenizer(
    source: str | Path, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder, or build the byte tokenizer for ``"byte"``.

    Robust to the transformers 5 pitfall where ``AutoTokenizer`` picks a class from the model
    config (e.g. ``Qwen2Tokenizer``) that splits text differently from the saved
    ``tokenizer.json``: whenever a ``tokenizer.json`` exists, the loaded tokenizer must encode a
    probe text exactly like that file does, otherwise ``PreTrainedTokenizerFast`` (which uses
    the file verbatim) is loaded instead.
    """
    if str(source) == BYTE_TOKENIZER:
        return build_byte_tokenizer()
    folder = Path(source)
    if not folder.is_dir():
        raise ConfigError(
            [ConfigIssue("model.tokenizer", f"tokenizer folder {str(folder)!r} does not exist")]
        )
    tokenizer_file = folder / "tokenizer.json"
    config_file = folder / "tokenizer_config.json"
    saved_class = None
    if config_file.exists():
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class")
    if tokenizer_file.exists() and saved_class in _FILE_ONLY_CLASSES:
        # The file is the whole truth; no class-specific behaviour to preserve.
        return PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tokenizer_file.exists():
        expected = (
            Tokenizer.from_file(str(tokenizer_file)).encode(_PROBE, add_special_tokens=False).ids
        )
        got = tokenizer.encode(_PROBE, add_special_tokens=False)
        if got != expected:
            log.warning(
                "%s loaded as %s encodes differently from its tokenizer.json; using the file",
                folder,
                type(tokenizer).__name__,
            )
            return PreTrainedTokenizerFast.from_pretrained(folder)
    return tokenizer


def check_vocab(
    vocab_size: int, tokenizer: PreTrainedTokenizerBase, *, key: str = "model.init.vocab_size"
) -> None:
    """Raise ``ConfigError`` when the model's embedding cannot hold every token id."""
    needed = len(tokenizer)
    if vocab_size < needed:
        raise ConfigError(
            [
                ConfigIssue(
                    key,
                    f"is {vocab_size}, but the tokenizer has {needed} tokens (ids up to {needed - 1})",
                    hint=f"set {key} to at least {needed}",
                )
            ]
        )


def pad_token_id(tokenizer: Any, source: object = "the model") -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise EngineError(
            f"the tokenizer of {source} has neither a pad nor an EOS token to pad with"
        )
    return int(pad)
