"""The built-in tokenizer: size, digits, round trips, loading, and a reproducible build."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgym.prompting import build_tokenizer
from prefixgym.prompting.tokenizer import (
    ASSETS_DIR,
    EOS_TOKEN,
    IM_END,
    IM_START,
    builtin_chat_template,
    end_of_turn_ids,
    is_builtin_tokenizer,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_vocab_is_exactly_4096_with_three_specials(tok):
    assert len(tok) == 4096
    assert tok.backend_tokenizer.get_vocab_size() == 4096
    ids = tok.convert_tokens_to_ids([EOS_TOKEN, IM_START, IM_END])
    assert ids == [0, 1, 2]
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    assert tok.pad_token == EOS_TOKEN and tok.pad_token_id == 0
    assert sorted(tok.all_special_ids) == [0, 1, 2]
    assert max(tok.get_vocab().values()) == 4095


def test_builtin_is_cached_and_carries_the_chat_template(tok):
    assert load_tokenizer("builtin") is tok
    assert tok.chat_template == builtin_chat_template()
    assert "<|im_start|>" in tok.chat_template


def test_every_integer_below_1000_is_one_token(tok):
    for i in range(1000):
        ids = tok.encode(str(i), add_special_tokens=False)
        assert len(ids) == 1, (i, ids)
        assert tok.decode(ids) == str(i)
    assert len({tok.encode(str(i), add_special_tokens=False)[0] for i in range(1000)}) == 1000


def test_longer_numbers_split_into_runs_of_three(tok):
    ids = tok.encode("1234567", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["123", "456", "7"]


def test_special_tokens_are_single_ids_in_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids
    assert tok.encode("hi", add_special_tokens=False) == ids[3 : ids.index(2)]


@given(st.text(max_size=200))
def test_decode_inverts_encode_for_any_text(text):
    tok = load_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_agent_vocabulary_is_compact(tok):
    # The corpus teaches the words of the built-in envs: each is one token.
    for word in [" higher", " lower", " up", " down", " left", " right", "lookup", " wall"]:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def test_build_script_reproduces_the_shipped_files(tmp_path: Path):
    # Building takes about a second, so the test rebuilds and compares bytes.
    build_tokenizer.write(tmp_path)
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        assert (tmp_path / name).read_bytes() == (ASSETS_DIR / name).read_bytes(), name


def test_assets_dir_loads_as_a_hugging_face_directory(tok):
    other = load_tokenizer(ASSETS_DIR)
    assert other is not tok
    assert len(other) == 4096
    assert other.eos_token == EOS_TOKEN
    assert other.chat_template == tok.chat_template
    text = "Guess 537: higher!"
    assert other.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert is_builtin_tokenizer(other)


def test_saved_copy_loads_from_a_local_directory(tok, tmp_path: Path):
    tok.save_pretrained(tmp_path)
    copy = load_tokenizer(tmp_path)
    assert copy.encode("x = 42", add_special_tokens=False) == tok.encode(
        "x = 42", add_special_tokens=False
    )


def test_bad_names_give_clear_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="neither 'builtin' nor a local directory"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="cannot load a tokenizer from directory"):
        load_tokenizer(tmp_path)  # an empty directory


def test_a_checkpoints_generation_config_adds_its_turn_ends(tok, tmp_path: Path):
    """An instruct checkpoint lists its turn end beside eos in generation_config.json
    (Gemma's <end_of_turn>, Llama 3's <|eot_id|>): the sampler stops at those too."""
    from prefixgym.local_service import LocalService
    from tests.tiny_checkpoints import save_tiny_qwen2

    own = end_of_turn_ids(tok)
    assert own == (tok.eos_token_id, tok.convert_tokens_to_ids(IM_END))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 1000, true]}')
    assert end_of_turn_ids(tok, tmp_path) == (*own, 7, 1000)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 9}')
    assert end_of_turn_ids(tok, tmp_path) == (*own, 9)
    (tmp_path / "generation_config.json").write_text("not json")
    assert end_of_turn_ids(tok, tmp_path) == own
    model = tmp_path / "model"
    save_tiny_qwen2(model)
    (model / "generation_config.json").write_text('{"eos_token_id": [3, 44]}')
    with LocalService(str(model)) as service:
        assert service.end_of_turn_ids == (*own, 3, 44)
