"""The training client's memory options give the plain path's results: the chunked
logprob head (`chunked_head`, `logprob_head.py`) and per-block activation recompute
(`recompute_activations`), for every loss, with and without shared prefixes, under
bf16 autocast, with LoRA adapters (the head's too); and what backward keeps shrinks.
The chunked head's and LoRA's comparisons run in the test dtype (tests/numerics.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from numerics import from_environment

from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.engine.service import EngineService
from prefixgym.engine.trainer import logprob_head
from prefixgym.engine.trainer.losses import LOSSES
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import Datum, ForwardBackwardOutput, ModelInput

CONFIG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                     max_seq_len=48)
CAPPED = dataclasses.replace(CONFIG, final_softcap=1.5, logit_divisor=0.5)  # Gemma 2's head
REL = 5e-6  # fp32: matmuls and gradient sums split by chunk
NUMERICS = from_environment()
REL_TEST_DTYPE = NUMERICS.rel(REL, CONFIG.n_layers)  # bf16: tests/numerics.py
Grads = dict[str, torch.Tensor]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rl_datum(tokens: list[int], n_prompt: int, seed: int) -> Datum:
    n = len(tokens)
    gen = torch.Generator().manual_seed(seed)
    weights = [0.0 if t < n_prompt - 1 else 1.0 for t in range(n)]
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": tokens[1:] + ids(1, seed + 99),
        "weights": weights,
        "logprobs": (-torch.rand(n, generator=gen) * 3 - 0.1).tolist(),
        "advantages": [(seed % 5 - 2.2) * 0.3 * w for w in weights],
    })


def group() -> list[Datum]:
    """A GRPO group: one 12-token prompt, four replies (shared prefixes to share)."""
    prompt = ids(12, 0)
    return [rl_datum(prompt + ids(n, 10 + g), 12, g) for g, n in enumerate((5, 9, 3, 7))]


@contextmanager
def small_chunks(rows: int = 5) -> Iterator[None]:
    """Chunks of `rows` positions on CONFIG's vocabulary: many chunks per forward."""
    before = logprob_head.CHUNK_ELEMENTS
    logprob_head.CHUNK_ELEMENTS = rows * CONFIG.vocab_size
    try:
        yield
    finally:
        logprob_head.CHUNK_ELEMENTS = before


def train(make: Callable[[], TrainingClient], data: list[Datum], loss_fn: str,
          ) -> tuple[ForwardBackwardOutput, Grads]:
    client = make()
    out = client.forward_backward(data, loss_fn).result()
    grads = {n: p.grad.clone() for n, p in client.model.named_parameters() if p.grad is not None}
    client.close()
    return out, grads


def full_client(**kwargs: object) -> Callable[[], TrainingClient]:
    """A trainer of CONFIG, in the test dtype unless `compute_dtype` says otherwise."""
    def make() -> TrainingClient:
        model = Transformer(CONFIG)
        init_weights(model, 0)
        return TrainingClient(model, TrainerOptions(**{  # type: ignore[arg-type]
            "compute_dtype": NUMERICS.dtype, **kwargs}))
    return make


def assert_close(a: torch.Tensor, b: torch.Tensor, rel: float, what: str) -> None:
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    assert err <= rel * max(scale, 1e-12), f"{what}: |diff| {err:.3g} > {rel} x {scale:.3g}"


def assert_same(a: tuple[ForwardBackwardOutput, Grads], b: tuple[ForwardBackwardOutput, Grads],
                rel: float) -> None:
    """Loss, every datum's logprobs and every gradient within `rel` (0: bit for bit)."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert_close(torch.tensor(out_a.metrics["loss"]), torch.tensor(out_b.metrics["loss"]), rel,
                 "loss")
    for i, (x, y) in enumerate(zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs, strict=True)):
        assert len(x["logprobs"]) == len(y["logprobs"])
        assert_close(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), rel, f"logprobs {i}")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        if rel == 0:
            assert torch.equal(g, grads_b[name]), name
        assert_close(g, grads_b[name], rel, f"grad {name}")


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_chunked_head_gives_the_plain_head_results_for_every_loss(loss_fn: str,
                                                                   share: bool) -> None:
    plain = train(full_client(chunked_head=False, share_prefixes=share), group(), loss_fn)
    with small_chunks():
        chunked = train(full_client(chunked_head=True, share_prefixes=share), group(), loss_fn)
    assert_same(chunked, plain, REL_TEST_DTYPE)


@pytest.mark.parametrize("chunked_head", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_recompute_gives_the_same_gradients_bit_for_bit(share: bool, chunked_head: bool) -> None:
    """Also split by max_tokens_per_forward (20: the group's datums in several forwards)."""
    kwargs = dict(share_prefixes=share, chunked_head=chunked_head, max_tokens_per_forward=20)
    with small_chunks():
        kept = train(full_client(**kwargs), group(), "ppo")
        recomputed = train(full_client(recompute_activations=True, **kwargs), group(), "ppo")
    assert_same(recomputed, kept, 0.0)


def test_bf16_autocast_recompute_exact_and_chunked_head_close() -> None:
    bf16 = dict(compute_dtype=torch.bfloat16)
    plain = train(full_client(chunked_head=False, **bf16), group(), "importance_sampling")
    with small_chunks():
        chunked = train(full_client(**bf16), group(), "importance_sampling")
        both = train(full_client(recompute_activations=True, **bf16), group(),
                     "importance_sampling")
    assert_same(both, chunked, 0.0)
    assert_same(chunked, plain, 2e-2)  # bf16 matmuls rounded in another order


@pytest.mark.parametrize("config", [CONFIG, CAPPED], ids=["plain", "softcapped"])
@pytest.mark.parametrize("train_unembed", [False, True])
def test_lora_with_and_without_the_head_adapter(train_unembed: bool, config: ModelConfig) -> None:
    """A frozen head (the fast path: d logprob / d h computed in forward, through a
    soft-cap where the model has one) and a head adapter (chunks recomputed in
    backward): the plain path's adapter gradients."""
    def lora_run(**kwargs: object) -> tuple[ForwardBackwardOutput, Grads]:
        with EngineService(config, thread_tuning=False) as svc:
            client = svc.create_lora_training_client(  # type: ignore[arg-type]
                rank=4, train_unembed=train_unembed, compute_dtype=NUMERICS.dtype, **kwargs)
            with torch.no_grad():  # B starts at zero: make every adapter matter
                gen = torch.Generator().manual_seed(7)
                for p in client._params:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            return train(lambda: client, group(), "cispo")

    plain = lora_run(chunked_head=False)
    with small_chunks():
        chunked = lora_run()
        recomputed = lora_run(recompute_activations=True)
    assert all("lora_" in n for n in plain[1])  # only the adapters train
    assert any(n.startswith("head_adapter.") for n in plain[1]) == train_unembed
    assert_same(chunked, plain, REL_TEST_DTYPE)
    assert_same(recomputed, chunked, 0.0)


@pytest.mark.parametrize("guess", ["exact", "too_few", "none"])
def test_loss_surrogates_gradients_are_autograds_whatever_the_loss_positions_guess(
    guess: str,
) -> None:
    """`loss_surrogate` runs the head's backward on the guessed loss positions only; a
    loss that reads cells outside the guess still gets its exact gradient (those rows
    are computed again), and a loss with no positions at all gets zeros, as autograd
    on the whole head gives."""
    model = Transformer(CONFIG)
    init_weights(model, 0)
    params = list(model.parameters())
    tokens_B_T = torch.tensor([ids(9, 1), ids(9, 2)])
    targets_B_T = torch.tensor([ids(9, 3), ids(9, 4)])
    weights_B_T = torch.rand(2, 9, generator=torch.Generator().manual_seed(5))
    weights_B_T[:, :4] = 0.0  # a prompt
    if guess == "none":
        weights_B_T.zero_()
    in_loss_B_T = weights_B_T != 0
    if guess == "too_few":
        in_loss_B_T[:, 6:] = False  # cells the loss reads, outside the guess

    def loss_of_grid(logprobs_B_T: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -(weights_B_T * logprobs_B_T).sum(), None

    h_B_T_C = model.hidden(tokens_B_T)
    rows = logprob_head.HeadRows(h_B_T_C.reshape(18, -1), targets_B_T.reshape(18),
                                 torch.arange(18).view(2, 9))
    logprobs, loss, _, surrogate = logprob_head.loss_surrogate(model, rows, in_loss_B_T,
                                                               loss_of_grid)
    grads = torch.autograd.grad(surrogate, params, allow_unused=True)
    expected = logprob_head.target_logprobs(model, model.hidden(tokens_B_T).reshape(18, -1),
                                            targets_B_T.reshape(18)).view(2, 9)
    expected_loss, _ = loss_of_grid(expected)
    expected_grads = torch.autograd.grad(expected_loss, params)
    assert_close(logprobs, expected.detach(), REL, "logprobs")
    assert_close(loss, expected_loss.detach(), REL, "loss")
    for p, g, e in zip(model.parameters(), grads, expected_grads, strict=True):
        assert g is not None
        if guess == "none":
            assert not g.any() and not e.any()
        else:
            assert_close(g, e, REL, f"grad {tuple(p.shape)}")


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or a view of one (linear saves the weight's transpose)."""
    return isinstance(t, torch.nn.Parameter) or (t._base is not None and _is_weight(t._base))


def saved_tensors(make: Callable[[], TrainingClient], data: list[Datum]) -> list[torch.Tensor]:
    """Every tensor autograd saved for backward during one forward_backward (recorded on
    the client's worker thread, where the graph is built)."""
    client = make()
    saved: list[torch.Tensor] = []

    def run() -> None:
        request = client._validate(data, "cross_entropy", None)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            client._run(*request, True)

    client._submit(run).result()
    client.close()
    return saved


@pytest.mark.parametrize("share", [False, True])
def test_chunked_head_keeps_no_positions_by_vocab_tensor(share: bool) -> None:
    """The plain head keeps every position's logits (per wave with shared prefixes); the chunked one (5 rows a chunk)
    nothing larger than a chunk's logits but the head's own weight. V = 97 is prime and
    no other size is a multiple of it, so numel % V == 0 marks a tensor of logits."""
    V = CONFIG.vocab_size

    def logits_sized(kept: list[torch.Tensor]) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in kept
                if t.numel() % V == 0 and t.numel() > 5 * V and not _is_weight(t)]

    data = group()
    positions = sum(d.model_input.length for d in data) if not share else 12 + 5 + 9 + 3 + 7
    fp32 = torch.float32  # under autocast, bf16 copies of the head's weight would count
    plain = logits_sized(saved_tensors(full_client(chunked_head=False, share_prefixes=share,
                                                   compute_dtype=fp32), data))
    assert sum(math.prod(s) for s in plain) >= positions * V, plain  # every position's
    with small_chunks():
        kept = logits_sized(saved_tensors(full_client(share_prefixes=share, compute_dtype=fp32),
                                          data))
    assert kept == []


def test_recompute_keeps_a_fraction_of_the_activations() -> None:
    """Backward keeps the blocks' inputs (and what the head and embedding keep), not
    each block's norms, projections and MLP activations."""
    def kept_bytes(**kwargs: object) -> int:
        kept = saved_tensors(full_client(share_prefixes=False, compute_dtype=torch.float32,
                                         **kwargs), group())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in kept if not _is_weight(t)}
        return sum(storages.values())

    kept, recomputed = kept_bytes(), kept_bytes(recompute_activations=True)
    assert recomputed < kept / 4, (recomputed, kept)


def test_head_logprobs_of_an_empty_row_set_and_without_gradients() -> None:
    model = Transformer(CONFIG)
    init_weights(model, 0)
    h_N_C = torch.randn(9, CONFIG.dim)
    targets_N = torch.randint(0, 64, (9,))
    expected = torch.log_softmax(model.head(h_N_C), -1)[torch.arange(9), targets_N]
    with torch.no_grad():
        got = logprob_head.target_logprobs(model, h_N_C, targets_N, rows=4)
    assert_close(got, expected.detach(), REL, "no-grad logprobs")
    empty = logprob_head.target_logprobs(model, h_N_C[:0].requires_grad_(), targets_N[:0], 4)
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="targets"):
        logprob_head.target_logprobs(model, h_N_C, targets_N[:3])
