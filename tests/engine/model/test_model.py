"""The built-in Transformer: presets, the plain causal forward, the KVView path,
cloning, dtypes and input errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixgym.engine.model import (
    PRESETS,
    ModelConfig,
    Transformer,
    count_parameters,
    init_weights,
    load_model,
)


class ContiguousKV:
    """A test-only KVView: one contiguous (B, Hkv, T_max, D) buffer per layer.

    Rows are left-aligned; `begin(n_new_B)` announces a forward whose row b has
    n_new_B[b] real tokens (the rest of its T positions are right padding)."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.lengths_B = torch.zeros(batch, dtype=torch.long)
        self.max_len = max_len
        self._n_new_B: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def begin(self, n_new_B: list[int], T: int) -> torch.Tensor:
        """Prepare the mask for a forward of T positions; return positions_B_T."""
        n_new = torch.tensor(n_new_B, dtype=torch.long)
        start = self.lengths_B
        positions_B_T = start[:, None] + torch.arange(T)[None, :]
        end = int((start + T).max())
        keys = torch.arange(end)
        # query t of row b sees keys j <= start_b + t (its own, possibly padding, key included)
        self._mask = (keys[None, None, :] <= positions_B_T[:, :, None])[:, None]  # (B,1,T,Tk)
        self._n_new_B = n_new
        self._end = end
        return positions_B_T

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = k_B_Hkv_T_D.shape[2]
        for b in range(k_B_Hkv_T_D.shape[0]):
            s = int(self.lengths_B[b])
            self.k[layer_idx][b, :, s : s + T] = k_B_Hkv_T_D[b]
            self.v[layer_idx][b, :, s : s + T] = v_B_Hkv_T_D[b]
        end = self._end
        assert self._mask is not None
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end], self._mask

    def finish(self) -> None:
        """Commit the real tokens of the last forward; padding slots get overwritten later."""
        assert self._n_new_B is not None
        self.lengths_B = self.lengths_B + self._n_new_B
        self._n_new_B = None


SMALL_TEST_CONFIG = ModelConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


@pytest.fixture(autouse=True)
def _seeded_inputs() -> None:
    """The tests draw token ids from torch's global generator: seed it, so that each
    test sees the same ids whichever tests ran before it in its worker."""
    torch.manual_seed(0)


def make_model(seed: int = 0, **overrides: object) -> Transformer:
    model = Transformer(dataclasses.replace(SMALL_TEST_CONFIG, **overrides))
    init_weights(model, seed)
    # Larger weights than the 0.02 init so that position and context visibly matter.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


def new_kv(model: Transformer, batch: int) -> ContiguousKV:
    c = model.config
    return ContiguousKV(c.n_layers, batch, c.n_kv_heads, c.max_seq_len, c.head_dim)


@pytest.mark.parametrize("name, low, high", [("tiny", 3.5e6, 6.5e6), ("small", 22e6, 38e6)])
def test_presets_sizes_and_gqa(name: str, low: float, high: float) -> None:
    config = PRESETS[name]
    assert config.vocab_size == 4096
    assert config.max_seq_len == 2048
    assert config.n_kv_heads < config.n_heads
    model = load_model(name)
    assert model.config == config
    assert low <= count_parameters(model) <= high
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    assert count_parameters(model, non_embedding=True) == count_parameters(model) - embeddings


def test_load_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = load_model("tiny", seed=1)
    after = torch.rand(3)
    assert torch.equal(before, after)
    b = load_model("tiny", seed=1)
    c = load_model("tiny", seed=2)
    assert torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    assert a.training and all(p.requires_grad for p in a.parameters())


def test_unknown_model_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        load_model("huge")


def test_tied_embeddings_share_one_matrix() -> None:
    model = make_model(tie_embeddings=True)
    assert model.output is None
    assert model.output_weight is model.tok_embeddings.weight
    assert "output.weight" not in model.state_dict()
    untied = make_model(tie_embeddings=False)
    c = SMALL_TEST_CONFIG
    assert count_parameters(untied) - count_parameters(model) == c.vocab_size * c.dim


def test_forward_shapes_dtype_and_last_only() -> None:
    model = make_model()
    tokens = torch.randint(0, 97, (3, 10))
    full = model(tokens)
    assert full.shape == (3, 10, 97) and full.dtype == torch.float32
    last = model(tokens, last_only=True)
    assert last.shape == (3, 1, 97)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=0)
    picked = model(tokens, last_only=True, last_index_B=torch.tensor([2, 9, 0]))
    torch.testing.assert_close(picked[:, 0], full[[0, 1, 2], [2, 9, 0]], atol=1e-5, rtol=0)


def test_right_padding_does_not_change_earlier_logits() -> None:
    model = make_model()
    tokens = torch.randint(0, 97, (1, 12))
    short = model(tokens[:, :7])
    padded = model(torch.cat([tokens[:, :7], torch.zeros(1, 5, dtype=torch.long)], dim=1))
    torch.testing.assert_close(padded[:, :7], short, atol=1e-5, rtol=0)


def test_positions_matter_and_default_to_arange() -> None:
    model = make_model()
    tokens = torch.randint(0, 97, (2, 6))
    default = model(tokens)
    explicit = model(tokens, torch.arange(6).expand(2, 6))
    torch.testing.assert_close(explicit, default, atol=1e-6, rtol=0)
    # RoPE sees relative positions: a uniform shift changes nothing, a gap does.
    shifted = model(tokens, torch.arange(6).expand(2, 6) + 5)
    torch.testing.assert_close(shifted, default, atol=1e-5, rtol=0)
    gapped = model(tokens, torch.tensor([0, 1, 2, 20, 21, 22]).expand(2, 6))
    torch.testing.assert_close(gapped[:, :3], default[:, :3], atol=1e-5, rtol=0)
    assert (gapped[:, 3:] - default[:, 3:]).abs().max() > 1e-2


def test_kv_prefill_then_decode_matches_full_forward() -> None:
    model = make_model()
    tokens = torch.randint(0, 97, (1, 20))
    expected = model(tokens)
    kv = new_kv(model, 1)
    with torch.no_grad():
        positions = kv.begin([8], 8)
        got = [model(tokens[:, :8], positions, kv)]
        kv.finish()
        for t in range(8, 20):
            positions = kv.begin([1], 1)
            got.append(model(tokens[:, t : t + 1], positions, kv))
            kv.finish()
    # one-query decode attention and the full causal kernel sum in different orders: on
    # some CPUs they differ by up to ~2e-5 here
    torch.testing.assert_close(torch.cat(got, dim=1), expected, atol=5e-5, rtol=0)


def test_kv_batch_with_different_lengths_matches_separate_forwards() -> None:
    """Two rows, prompts of 9 and 4 tokens (row 1 right-padded in the prefill), then
    decode steps at per-row positions: each row equals its own unbatched forward."""
    model = make_model()
    seqs = [torch.randint(0, 97, (16,)), torch.randint(0, 97, (11,))]
    prompt_lens = [9, 4]
    expected = [model(s[None])[0] for s in seqs]
    kv = new_kv(model, 2)
    with torch.no_grad():
        prompt = torch.zeros(2, 9, dtype=torch.long)
        for b, n in enumerate(prompt_lens):
            prompt[b, :n] = seqs[b][:n]
        positions = kv.begin(prompt_lens, 9)
        logits = model(prompt, positions, kv)
        kv.finish()
        for b, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[b, :n], expected[b][:n], atol=1e-5, rtol=0)
        for step in range(7):
            idx = [prompt_lens[b] + step for b in range(2)]
            tok = torch.stack([seqs[b][idx[b]] for b in range(2)])[:, None]
            positions = kv.begin([1, 1], 1)
            assert positions[:, 0].tolist() == idx
            last = model(tok, positions, kv, last_only=True)
            kv.finish()
            for b in range(2):
                torch.testing.assert_close(last[b, 0], expected[b][idx[b]], atol=1e-5, rtol=0)


def test_backward_gives_finite_gradients_everywhere() -> None:
    model = make_model(qkv_bias=True, out_bias=True).train()
    tokens = torch.randint(0, 97, (2, 9))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tokens[:, 1:].reshape(-1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_clone_for_inference_is_frozen_and_independent() -> None:
    model = make_model().train()
    clone = model.clone_for_inference()
    assert not clone.training and not any(p.requires_grad for p in clone.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    tokens = torch.randint(0, 97, (1, 5))
    before = clone(tokens)
    torch.testing.assert_close(before, model(tokens), atol=0, rtol=0)
    with torch.no_grad():
        model.tok_embeddings.weight.add_(1.0)
    torch.testing.assert_close(clone(tokens), before, atol=0, rtol=0)
    clone.load_weights_from(model)
    torch.testing.assert_close(clone(tokens), model(tokens), atol=0, rtol=0)
    with pytest.raises(ValueError, match="configs differ"):
        clone.load_weights_from(make_model(n_layers=1))


def test_bfloat16_gives_float32_logits_close_to_float32() -> None:
    model = load_model("tiny", seed=3)
    bf16 = load_model("tiny", dtype=torch.bfloat16, seed=3)
    assert bf16.tok_embeddings.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        ref, got = model(tokens), bf16(tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    drift = (ref - got).abs().max().item()
    print(f"bf16 vs fp32 max logit drift (tiny preset): {drift:.4f}")
    assert drift < 0.1 * ref.abs().max().item() + 0.05


@pytest.mark.parametrize(
    "tokens, positions, match",
    [
        (torch.tensor([[0, 97]]), None, "token id out of range"),
        (torch.tensor([[-1, 3]]), None, "token id out of range"),
        (torch.tensor([1, 2]), None, "must be 2-D"),
        (torch.zeros(1, 0, dtype=torch.long), None, "T == 0"),
        (torch.zeros(1, 65, dtype=torch.long), None, "exceeds max_seq_len=64"),
        (torch.tensor([[1, 2]]), torch.tensor([[0, 64]]), "position out of range"),
        (torch.tensor([[1, 2]]), torch.tensor([[0, 1, 2]]), "positions_B_T shape"),
    ],
)
def test_bad_inputs_raise_value_error(
    tokens: torch.Tensor, positions: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_model()(tokens, positions)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"dim": 30}, "not divisible by n_heads"),
        ({"vocab_size": 0}, "vocab_size must be a positive int"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"head_dim_override": 7}, "must be even"),
    ],
)
def test_bad_config_raises_value_error(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SMALL_TEST_CONFIG, **overrides)


def test_head_dim_override_changes_projection_shapes() -> None:
    model = make_model(head_dim_override=16)  # 4 heads x 16 = 64 != dim 32
    assert model.layers[0].attn.wqkv.weight.shape == ((4 + 2 * 2) * 16, 32)
    assert model(torch.randint(0, 97, (1, 4))).shape == (1, 4, 97)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_hf_rotate_half_bit_for_bit_forward_and_backward(dtype: torch.dtype) -> None:
    """Our RoPE (a roll against a sin table negated on its first half) gives exactly
    transformers' rotate-half values and gradients, from the tables HF builds itself."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from prefixgym.engine.model.layers import _apply_rope

    model = load_model("tiny", dtype=dtype)
    cfg = model.config
    hf_config = LlamaConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads,
                            rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len)
    positions = torch.tensor([[0, 1, 5, 17, 300, cfg.max_seq_len - 1]])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.n_heads, 6, cfg.head_dim, generator=gen).to(dtype).requires_grad_()
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(x, positions)  # (1, 6, D) each
    theirs = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)[0]
    ours = _apply_rope(x, model.rope_cos[positions].unsqueeze(1),
                       model.rope_sin[positions].unsqueeze(1))
    assert torch.equal(model.rope_cos[positions], hf_cos)
    assert torch.equal(ours, theirs)
    grad_out = torch.randn(theirs.shape, generator=gen).to(dtype)
    (ours_grad,) = torch.autograd.grad(ours, x, grad_out)
    (theirs_grad,) = torch.autograd.grad(theirs, x, grad_out)
    assert torch.equal(ours_grad, theirs_grad)
