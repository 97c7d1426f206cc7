"""`--model FILE.gguf` without a real model (tests/real_models/ converts two): a tiny
Llama written here as a GGUF file (float32 and Q8_0 tensors, a byte-level BPE and a chat
template) converts and loads, what is refused is refused in one line, and a file
converted once is read from the cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from prefixgym.cli import main
from prefixgym.cli.proxy import tokenizer_for
from prefixgym.engine.model import gguf_import, load_model
from prefixgym.engine.model.gguf_import import CACHE_VARIABLE, SOURCE_FILE, checkpoint_dir_of
from prefixgym.local_service import LocalService
from prefixgym.prompting.tokenizer import ASSETS_DIR, builtin_chat_template
from prefixgym.serving.config import ServeConfig

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_tiny_llama(path: Path) -> None:
    """A 2-layer Llama with the built-in tokenizer's vocabulary as a GGUF file: random
    weights, the embedding, q and down projections in Q8_0 blocks, the rest float32."""
    spec = json.loads((ASSETS_DIR / "tokenizer.json").read_text())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 64, 128, 4, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL
                            for i in range(vocab)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(builtin_chat_template())
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, scale: float = 0.2, q8: bool = False) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if q8:
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, values)

    tensor("token_embd.weight", vocab, hidden, q8=True)
    tensor("output_norm.weight", hidden, scale=1.0)
    head = hidden // heads
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", hidden, scale=1.0)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, scale=1.0)
        tensor(f"blk.{i}.attn_q.weight", heads * head, hidden, q8=True)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn, q8=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_loads_with_its_weights_tokenizer_and_template(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf")
    with LocalService(model=str(tmp_path / "tiny.gguf"), thread_tuning=False) as service:
        model, tokenizer = service.train_model, service.tokenizer
        assert model.config.family == "llama" and model.config.n_layers == 2
        assert tokenizer.chat_template == builtin_chat_template()
        text = "Guess a number between 1 and 100."
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        # the Q8_0 embedding as gguf's own dequantisation gives it, to the bit
        embedding = next(t for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors
                         if t.name == "token_embd.weight")
        expected = gguf.quants.dequantize(embedding.data, embedding.tensor_type)
        assert torch.equal(model.tok_embeddings.weight, torch.from_numpy(expected))
        ours = service.create_sampling_client().compute_logprobs(ids).result()[1:]
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint_dir_of(tmp_path / "tiny.gguf"))
    with torch.no_grad():
        logits = hf.eval()(torch.tensor([ids])).logits[0]
    theirs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    assert ours == pytest.approx(theirs[:, 0].tolist(), abs=1e-5)


def test_a_missing_file_is_refused_by_each_loader(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    for load in (checkpoint_dir_of, load_model, LocalService, tokenizer_for):
        with pytest.raises(ValueError, match=r"missing\.gguf: no such GGUF file"):
            load(missing)


def test_a_file_that_is_not_gguf_is_refused_before_any_conversion(tmp_path: Path,
                                                                  cache: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, renamed")
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        checkpoint_dir_of(tmp_path / "model.gguf")
    assert not cache.exists()


def test_without_the_gguf_package_the_error_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the gguf package: pip install "
                                         r"'prefixgym\[gguf\]'"):
        checkpoint_dir_of(tmp_path / "model.gguf")


def test_a_file_converted_once_is_read_from_the_cache_wherever_it_lies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converted: list[Path] = []

    def convert(source: Path, digest: str, out: Path) -> None:
        converted.append(source)
        (out / SOURCE_FILE).write_text(digest)

    monkeypatch.setattr(gguf_import, "_convert", convert)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(b"GGUF and some weights")
    first = checkpoint_dir_of(tmp_path / "a" / "model.gguf")
    (tmp_path / "a" / "model.gguf").rename(tmp_path / "model.gguf")  # moved: same bytes
    assert checkpoint_dir_of(tmp_path / "model.gguf") == first
    (tmp_path / "model.gguf").write_bytes(b"GGUF and other weights")  # changed: converted again
    assert checkpoint_dir_of(tmp_path / "model.gguf") != first
    assert len(converted) == 2 and first.name.startswith("model-")


def test_train_refuses_a_bad_chat_template_file_and_one_for_a_preset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "run"), "--steps", "1"]
    assert main(["train", "--chat-template", str(tmp_path / "none.jinja"), *out]) == 2
    assert "--chat-template " + str(tmp_path / "none.jinja") + ": no such file" in (
        capsys.readouterr().err)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(["train", "--chat-template", str(tmp_path / "t.jinja"), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("prefixgym train: --chat-template and --chat-template-kwargs apply "
                       "to a checkpoint's chat template; --model tiny uses the built-in format")


def test_serve_takes_a_chat_template_for_the_built_in_engine_only() -> None:
    assert ServeConfig(chat_template="t.jinja").chat_template == "t.jinja"
    with pytest.raises(ValueError, match="--chat-template is the built-in engine's"):
        ServeConfig(engine="vllm", chat_template="t.jinja")
