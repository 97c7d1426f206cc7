"""Shared prefixes in training: the same losses, logprobs and gradients as the plain path
(`share_prefixes=False`), with each shared position computed, and counted, once.

The claims hold in the test dtype (tests/numerics.py): exactly up to summation order in
fp32, within bf16's bound with PREFIXGYM_TEST_DTYPE=bf16, where shared and plain run
matmuls of other shapes and so round differently. Optimizer steps are compared in fp32
only; test_bf16_shared_stays_within_the_bf16_drift checks bf16 on peaked predictions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from numerics import from_environment, max_abs_logit

from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ForwardBackwardOutput, ModelInput

CONFIG = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=48
)
WINDOWED = dataclasses.replace(  # a window shorter than the datums, its own RoPE, soft-caps
    CONFIG, layer_windows=(5, 0), local_rope_theta=300.0, attention_softcap=4.0,
    norms="both", norm_offset=True)
NUMERICS = from_environment()
REL = 1e-5  # fp32: shared vs plain differ by summation order only


def make_model(seed: int = 0, config: ModelConfig = CONFIG) -> Transformer:
    model = Transformer(config)
    init_weights(model, seed)
    return model


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_datum(tokens: list[int], n_prompt: int, seed: int, sft: bool = False) -> Datum:
    """Targets are the next tokens (any ids past the end); RL fields on the completion,
    or, with `sft`, a weight on every position, the shared ones included."""
    n = len(tokens)
    extra = random_ids(1, seed + 1000)
    gen = torch.Generator().manual_seed(seed)
    weights = ([0.5 + i / n for i in range(n)] if sft
               else [0.0 if t < n_prompt - 1 else 1.0 for t in range(n)])
    return Datum(
        model_input=ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": tokens[1:] + extra,
            "weights": weights,
            "logprobs": (-torch.rand(n, generator=gen) * 3 - 0.1).tolist(),
            "advantages": [(seed % 5 - 2) * 0.3 * w for w in weights],
        },
    )


def group(prompt_len: int = 12, reply_lens: tuple[int, ...] = (5, 9, 3, 7), seed: int = 0,
          sft: bool = False, system: tuple[int, ...] = ()) -> list[Datum]:
    """G episodes of one prompt (after `system`), different reply lengths (a GRPO group)."""
    prompt = [*system, *random_ids(prompt_len, seed)]
    return [make_datum(prompt + random_ids(n, seed + 10 + g), len(prompt), seed + g, sft)
            for g, n in enumerate(reply_lens)]


def run(datums: list[Datum], loss_fn: str, share: bool, backward: bool = True,
        config: ModelConfig = CONFIG, **kwargs: object
        ) -> tuple[ForwardBackwardOutput, dict[str, torch.Tensor | None]]:
    client = TrainingClient(make_model(config=config), TrainerOptions(  # type: ignore[arg-type]
        share_prefixes=share, compute_dtype=NUMERICS.dtype, **kwargs))
    call = client.forward_backward if backward else client.forward
    out = call(datums, loss_fn).result()
    grads = {n: None if p.grad is None else p.grad.clone()
             for n, p in client.model.named_parameters()}
    client.close()
    return out, grads


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rel: float, what: str) -> None:
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    assert err <= rel * max(scale, 1e-12), f"{what}: |diff| {err:.3g} > {rel} x {scale:.3g}"


def assert_same_logprobs(a: list[float], b: list[float], datums: list[Datum], what: str) -> None:
    """Within REL of their size in fp32; within bf16's bound for two bf16 computations."""
    scale = max(max_abs_logit(make_model(), d.model_input.tokens) for d in datums)
    atol = NUMERICS.logprob_atol(REL * max(abs(x) for x in b), CONFIG.n_layers, scale, sides=2)
    err = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert err <= atol, f"{what}: |diff| {err:.3g} > {atol:.3g}"


def assert_same_training(datums: list[Datum], loss_fn: str = "ppo", config: ModelConfig = CONFIG,
                         **kwargs: object) -> ForwardBackwardOutput:
    rel = NUMERICS.rel(REL, CONFIG.n_layers)
    shared, shared_grads = run(datums, loss_fn, True, config=config, **kwargs)
    plain, plain_grads = run(datums, loss_fn, False, config=config, **kwargs)
    loss = torch.tensor(shared.metrics["loss"])
    assert_rel_close(loss, torch.tensor(plain.metrics["loss"]), rel, "loss")
    for i, (a, b) in enumerate(zip(shared.loss_fn_outputs, plain.loss_fn_outputs, strict=True)):
        assert len(a["logprobs"]) == datums[i].model_input.length
        assert_same_logprobs(a["logprobs"], b["logprobs"], datums, f"logprobs of datum {i}")
    for name, g in shared_grads.items():
        assert g is not None and plain_grads[name] is not None, name
        assert_rel_close(g, plain_grads[name], rel, f"grad {name}")  # type: ignore[arg-type]
    assert shared.usage.train_loss_tokens == plain.usage.train_loss_tokens
    assert shared.usage.train_tokens == plain.usage.train_computed_tokens
    assert plain.usage.train_shared_tokens == 0
    return shared


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo",
                                     "dro", "gspo", "stable_reinforce"])
def test_a_group_sharing_a_prompt_trains_exactly_and_computes_it_once(loss_fn: str) -> None:
    datums = group()  # a 12-token prompt, replies of 5, 9, 3 and 7
    out = assert_same_training(datums, loss_fn)
    assert out.usage.train_computed_tokens == 12 + 5 + 9 + 3 + 7
    assert out.usage.train_shared_tokens == 3 * 12
    assert out.metrics["train_shared_tokens"] == 36


def test_weights_inside_the_shared_part_sft() -> None:
    out = assert_same_training(group(sft=True), "cross_entropy")
    assert out.usage.train_loss_tokens == sum(d.model_input.length for d in group(sft=True))


def test_a_datum_that_is_a_prefix_of_another_and_a_duplicate() -> None:
    long = random_ids(20, 1)
    datums = [make_datum(long[:9], 4, 1, sft=True), make_datum(long, 4, 2, sft=True),
              make_datum(long[:15], 4, 3), make_datum(long, 4, 4)]
    out = assert_same_training(datums, "importance_sampling")
    assert out.usage.train_computed_tokens == 20


def test_branches_of_branches_and_two_groups_sharing_a_system_prompt() -> None:
    system = tuple(random_ids(10, 5))
    first = group(prompt_len=6, seed=20, system=system)
    second = group(prompt_len=4, reply_lens=(4, 4, 8), seed=30, system=system)
    branch = first[1].model_input.tokens[:19]  # 3 tokens into the second reply
    deeper = [make_datum(branch + random_ids(3, 7 + k), 16, 9 + k) for k in range(2)]
    datums = [*first, *second, *deeper]
    out = assert_same_training(datums, "ppo")
    distinct = len({tuple(d.model_input.tokens[: k + 1]) for d in datums
                    for k in range(d.model_input.length)})
    assert out.usage.train_computed_tokens == distinct == 10 + 6 + 24 + 4 + 16 + 6


def test_the_head_computes_each_distinct_position_and_target_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Datums sharing a position and its target read one head row, not one each; and
    only the rows of loss positions (the replies here) run with gradient."""
    from prefixgym.engine.trainer import logprob_head

    system = tuple(random_ids(10, 5))
    datums = [*group(prompt_len=6, seed=20, system=system),
              *group(prompt_len=4, reply_lens=(4, 4, 8), seed=30, system=system)]
    head_rows: dict[bool, int] = {True: 0, False: 0}  # with gradient -> rows
    inner = logprob_head.target_logprobs

    def counting(model: Transformer, h_N_C: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        head_rows[torch.is_grad_enabled()] += h_N_C.shape[0]
        return inner(model, h_N_C, targets_N)

    monkeypatch.setattr(logprob_head, "target_logprobs", counting)
    run(datums, "ppo", share=True)  # exact: test_branches_of_branches_... on the same shapes

    def pairs(loss_only: bool) -> set[tuple[tuple[int, ...], int]]:
        return {(tuple(d.model_input.tokens[: k + 1]), d.loss_fn_inputs["target_tokens"][k])
                for d in datums for k in range(d.model_input.length)
                if d.loss_fn_inputs["weights"][k] != 0 or not loss_only}

    assert head_rows[True] + head_rows[False] == len(pairs(False)) \
        < sum(d.model_input.length for d in datums)
    assert head_rows[True] == len(pairs(True)) < len(pairs(False))


def test_no_shared_prefix_at_all() -> None:
    datums = [make_datum(random_ids(n, 40 + n), 3, n) for n in (4, 11, 7, 16)]
    datums = [d for d in datums if len({d.model_input.tokens[0] for d in datums}) == 4]
    assert len(datums) == 4  # four different first tokens
    out = assert_same_training(datums, "ppo")
    assert out.usage.train_shared_tokens == 0


def test_chunking_that_splits_a_trie_counts_the_prefix_again() -> None:
    datums = group(prompt_len=20, reply_lens=(6, 6, 6, 6, 6, 6))  # 20 + 6 x 6 = 56 distinct
    # budget 40: a chunk holds 26 + (6 + 20 context rows x ~0.11) = 34.2; a third datum
    # would bring it to 42.4, so three chunks of two, each computing the prompt
    out = assert_same_training(datums, "ppo", max_tokens_per_forward=40)
    assert out.usage.train_computed_tokens == 3 * (20 + 2 * 6)
    assert out.usage.train_tokens == 6 * 26


def test_forward_matches_and_keeps_no_gradients() -> None:
    shared, grads = run(group(), "ppo", True, backward=False)
    plain, _ = run(group(), "ppo", False, backward=False)
    assert all(g is None for g in grads.values())
    for a, b in zip(shared.loss_fn_outputs, plain.loss_fn_outputs):
        assert_same_logprobs(a["logprobs"], b["logprobs"], group(), "logprobs")
    assert shared.usage.train_computed_tokens == 36


def test_training_steps_stay_together() -> None:
    """Three AdamW steps on shared and plain gradients reach the same weights (fp32: in
    bf16, AdamW's normalised step turns a gradient entry's rounding into a full step)."""
    datums = group(sft=True)
    clients = [TrainingClient(make_model(), TrainerOptions(share_prefixes=s))
               for s in (True, False)]
    for _ in range(3):
        for c in clients:
            c.forward_backward(datums, "cross_entropy").result()
            c.optim_step(AdamParams(learning_rate=1e-3)).result()
    for (name, a), b in zip(clients[0].model.named_parameters(), clients[1].model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_bf16_shared_stays_within_the_bf16_drift() -> None:
    """Under bf16 autocast, shared and plain run matmuls of other shapes, so they round
    differently. Measured here: logprobs max 0.013, mean 2e-4; gradients 1.4% of their
    largest entry; bf16 vs fp32 on the same datums: max 0.009, mean 3e-3, 1.7%. The
    bounds are those of test_training_bf16 for logprobs and 5% for gradients."""
    datums = [*group(seed=3), *group(prompt_len=8, reply_lens=(6, 2), seed=4)]
    trainer = TrainingClient(make_model(), TrainerOptions(share_prefixes=False))
    for _ in range(10):  # peaked predictions, where bf16 rounding shows most
        trainer.forward_backward(datums, "cross_entropy").result()
        trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
    outs = {}
    for share in (True, False):
        client = TrainingClient(trainer.model, TrainerOptions(compute_dtype=torch.bfloat16,
                                                               share_prefixes=share))
        outs[share] = client.forward_backward(datums, "ppo").result()
        outs[share, "grads"] = [p.grad.clone() for p in client.model.parameters()]
        client.model.zero_grad(set_to_none=True)
    diffs = torch.cat([(torch.tensor(a["logprobs"]) - torch.tensor(b["logprobs"])).abs()
                       for a, b in zip(outs[True].loss_fn_outputs, outs[False].loss_fn_outputs)])
    assert 0 < diffs.max() < 0.1
    assert diffs.mean() < 0.03
    for a, b in zip(outs[True, "grads"], outs[False, "grads"]):
        assert_rel_close(a, b, 0.05, "bf16 grad")
    assert outs[True].usage.train_shared_tokens > 0


@st.composite
def datum_sets(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Datums grown from a few random trunks, so they share prefixes of random lengths."""
    trunks = draw(st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=14),
                           min_size=1, max_size=3))
    datums = []
    for _ in range(draw(st.integers(1, 7))):
        trunk = draw(st.sampled_from(trunks))
        cut = draw(st.integers(0, len(trunk)))
        tail = draw(st.lists(st.integers(0, 63), max_size=10))
        datums.append((trunk[:cut] + tail) or trunk)
    return datums, draw(st.sampled_from([8192, 24]))


@given(datum_sets(), st.integers(0, 2**16))
def test_any_datums_with_shared_prefixes_train_exactly(case: tuple[list[list[int]], int],
                                                        seed: int) -> None:
    tokens, budget = case
    datums = [make_datum(t, len(t) // 2, seed + i, sft=i % 2 == 0) for i, t in enumerate(tokens)]
    out = assert_same_training(datums, "ppo", max_tokens_per_forward=budget)
    if budget == 8192:
        distinct = len({tuple(t[: k + 1]) for t in tokens for k in range(len(t))})
        assert out.usage.train_computed_tokens == distinct


@given(datum_sets(), st.integers(0, 2**16))
def test_with_sliding_windows_any_datums_with_shared_prefixes_train_exactly(
        case: tuple[list[list[int]], int], seed: int) -> None:
    """Windowed layers see the same keys through the trie's context rows as in a plain
    forward (positions past the window are masked in both)."""
    tokens, budget = case
    datums = [make_datum(t, len(t) // 2, seed + i) for i, t in enumerate(tokens)]
    assert_same_training(datums, "ppo", config=WINDOWED, max_tokens_per_forward=budget)


def test_repeated_calls_give_the_same_gradient_bits() -> None:
    """A shared row's gradient sums its branches in a fixed order (on two threads, where
    atomic adds would race), so a run can be reproduced bit for bit, in either dtype (on
    one thread count: bf16's kernels round by it, docs/architecture.md "Determinism")."""
    config = ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=2,
                         hidden_dim=64, max_seq_len=128)
    prompt = random_ids(100, 1)
    datums = [make_datum(prompt + random_ids(1 + i % 7, 50 + i), 100, i) for i in range(64)]
    model = Transformer(config)
    init_weights(model, 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        client = TrainingClient(model, TrainerOptions(share_prefixes=True,
                                                       compute_dtype=NUMERICS.dtype))
        grads = []
        for _ in range(4):
            client.forward_backward(datums, "ppo").result()
            grads.append([p.grad.clone() for p in client.model.parameters()])
            client.model.zero_grad(set_to_none=True)
        client.close()
    finally:
        torch.set_num_threads(previous)
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
