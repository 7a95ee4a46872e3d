"""The offline byte tokenizer: exact UTF-8 round trips, save/load, chat template, robust loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from relax.config import ModelInitConfig
from relax.errors import ConfigError
from relax.models import (
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    build_tiny_model,
    load_tokenizer,
    stop_token_ids,
)

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}
"""The tiny model of every engine test: 2 layers, hidden 64, vocab 512."""
TOKENIZER = build_byte_tokenizer()
TRICKY = [
    "",
    " ",
    "  two  spaces ",
    "tab\tnew\nline\r\n",
    "e\u0301 vs é",
    "\ufb01 Ⅸ",
    "中文 🙂👍🏽",
    "\x00\x7f",
]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trips_any_utf8(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    if not any(special in text for special in SPECIAL_TOKENS):
        assert ids == list(text.encode("utf-8")), "a byte's id is its value"
    assert TOKENIZER.decode(ids) == text


def test_specials_have_fixed_ids() -> None:
    assert [TOKENIZER.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259, 260]
    assert (TOKENIZER.pad_token_id, TOKENIZER.bos_token_id, TOKENIZER.eos_token_id) == (
        256,
        257,
        258,
    )
    assert len(TOKENIZER) == 261
    assert stop_token_ids(TOKENIZER) == [258, 260]
    assert TOKENIZER.padding_side == "left"
    assert TOKENIZER.encode("<|im_end|>", add_special_tokens=False) == [260]


def test_chat_template() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = TOKENIZER.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == TOKENIZER.encode(text, add_special_tokens=False)
    assert ids[0] == 259


def test_save_and_load_encode_identically(tmp_path: Path) -> None:
    TOKENIZER.save_pretrained(tmp_path)
    for loaded in (load_tokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        for text in TRICKY:
            assert loaded.encode(text, add_special_tokens=False) == TOKENIZER.encode(
                text, add_special_tokens=False
            )
            assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
        assert loaded.pad_token_id == 256 and loaded.eos_token_id == 258
        assert loaded.padding_side == "left"
        assert loaded.chat_template == TOKENIZER.chat_template


def test_model_folder_loads_the_saved_tokenizer_not_the_model_class(tmp_path: Path) -> None:
    tiny_dir = build_tiny_model(ModelInitConfig(**TINY), tmp_path)
    # The pitfall: AutoTokenizer on a Qwen2 folder builds Qwen2Tokenizer, which NFC-normalises.
    text = "e\u0301"
    auto = AutoTokenizer.from_pretrained(tiny_dir)
    ours = load_tokenizer(tiny_dir)
    assert ours.encode(text, add_special_tokens=False) == list(text.encode())
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    if auto.encode(text, add_special_tokens=False) != list(text.encode()):
        assert type(ours) is not type(auto)  # the fallback really was needed, and taken


def test_byte_name_and_missing_folder(tmp_path: Path) -> None:
    assert load_tokenizer("byte").encode("ab", add_special_tokens=False) == [97, 98]
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
