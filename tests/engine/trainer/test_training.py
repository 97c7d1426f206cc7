"""TrainingClient: batching, gradient accumulation, AdamW, validation, save/load."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from numerics import max_abs_logit

from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.engine.usage import UsageLedger
from prefixgym.types import AdamParams, Datum, ModelInput

CONFIG = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32
)


def make_model(seed: int = 0) -> Transformer:
    model = Transformer(CONFIG)
    init_weights(model, seed)
    return model


def rl_datum(seq: list[int], n_prompt: int, advantage: float, seed: int = 0) -> Datum:
    """Inputs seq[:-1], targets seq[1:]; weights/advantages on the completion only."""
    n = len(seq) - 1
    gen = torch.Generator().manual_seed(seed)
    sampler_lp = (-torch.rand(n, generator=gen) * 3 - 0.1).tolist()
    weights = [0.0 if t < n_prompt - 1 else 1.0 for t in range(n)]
    return Datum(
        model_input=ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": seq[1:],
            "weights": weights,
            "logprobs": sampler_lp,
            "advantages": [advantage * w for w in weights],
        },
    )


def batch() -> list[Datum]:
    return [
        rl_datum([1, 5, 9, 12, 3, 7], 3, 1.0, seed=1),
        rl_datum([2, 8, 8, 40, 41, 42, 43, 44, 45, 46], 4, -0.5, seed=2),
        rl_datum([3, 4, 60, 61], 2, 2.0, seed=3),
    ]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        if x is None or y is None:
            assert x is None and y is None, k
        elif atol == 0.0:
            assert torch.equal(x, y), k
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=k)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_batched_equals_one_by_one_and_chunked(loss_fn: str, numerics) -> None:
    """In the test dtype (tests/numerics.py): fp32 up to summation order, bf16 within its
    bound (the three group the datums into matmuls of other shapes)."""
    datums = batch()
    together = TrainingClient(make_model(), TrainerOptions(compute_dtype=numerics.dtype))
    out = together.forward_backward(datums, loss_fn).result()
    one_by_one = TrainingClient(make_model(), TrainerOptions(compute_dtype=numerics.dtype))
    singles = [one_by_one.forward_backward([d], loss_fn).result() for d in datums]
    chunked = TrainingClient(make_model(), TrainerOptions(  # one datum per chunk
        max_tokens_per_forward=10, compute_dtype=numerics.dtype))
    out_chunked = chunked.forward_backward(datums, loss_fn).result()

    rel = numerics.rel(0.0, CONFIG.n_layers)
    loss = abs(out.metrics["loss"])
    assert out.metrics["loss"] == pytest.approx(sum(s.metrics["loss"] for s in singles),
                                                abs=max(1e-5, rel * loss))
    assert out_chunked.metrics["loss"] == pytest.approx(out.metrics["loss"],
                                                        abs=max(1e-5, rel * loss))
    scale = max(max_abs_logit(make_model(), d.model_input.tokens) for d in datums)
    atol = numerics.logprob_atol(1e-5, CONFIG.n_layers, scale, sides=2)
    for i, d in enumerate(datums):
        lp = out.loss_fn_outputs[i]["logprobs"]
        assert len(lp) == d.model_input.length
        assert lp == pytest.approx(singles[i].loss_fn_outputs[0]["logprobs"], abs=atol)
        assert lp == pytest.approx(out_chunked.loss_fn_outputs[i]["logprobs"], abs=atol)
    for other in (one_by_one, chunked):
        mine, theirs = grads(together.model), grads(other.model)
        if not numerics.is_bf16:
            assert_same(mine, theirs, atol=1e-5)
            continue
        for name, g in mine.items():
            limit = rel * float(theirs[name].abs().max())
            assert float((g - theirs[name]).abs().max()) <= limit, name


def test_a_call_in_several_forwards_accumulates_as_one_and_fails_atomically() -> None:
    """Each forward's backward adds into `.grad`, the earlier calls' gradients set aside
    meanwhile: calls split into forwards accumulate what unsplit calls do, and a split
    call that fails after its first forward leaves the accumulated gradients as they were."""
    datums = batch()
    whole = TrainingClient(make_model())
    split = TrainingClient(make_model(), TrainerOptions(max_tokens_per_forward=10))
    for client in (whole, split):
        client.forward_backward(datums, "ppo").result()
        client.forward_backward(datums[:2], "importance_sampling").result()
    assert_same(grads(split.model), grads(whole.model), atol=1e-5)
    before = grads(split.model)
    overflowing = datums[1].model_copy(deep=True)  # its importance ratio overflows
    overflowing.loss_fn_inputs["logprobs"] = [-1e4] * overflowing.model_input.length
    with pytest.raises(ValueError, match="not finite"):
        split.forward_backward([datums[0], overflowing], "importance_sampling").result()
    assert_same(grads(split.model), before)


def test_logprobs_are_the_models_target_logprobs() -> None:
    client = TrainingClient(make_model())  # fp32, against the model's own fp32 forward
    datum = batch()[1]
    out = client.forward([datum], "cross_entropy").result()
    tokens = torch.tensor([datum.model_input.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(client.model(tokens), -1)[0]
    expected = [logp[t, tgt].item() for t, tgt in enumerate(datum.loss_fn_inputs["target_tokens"])]
    assert out.loss_fn_outputs[0]["logprobs"] == pytest.approx(expected, abs=1e-5)
    assert all(p.grad is None for p in client.model.parameters())  # forward keeps no gradients


def test_usage_counts_every_position_and_loss_tokens_separately() -> None:
    ledger = UsageLedger()
    client = TrainingClient(make_model(), ledger=ledger)
    datums = batch()  # lengths 5, 9, 3; prompt positions weighted 0
    out = client.forward_backward(datums, "ppo").result()
    assert out.usage.train_computed_tokens == 17
    assert out.usage.train_loss_tokens == sum(d.num_loss_tokens for d in datums) == 4 + 7 + 3 - 3
    assert out.metrics["train_computed_tokens"] == 17
    assert out.metrics["loss/mean_per_loss_token"] == pytest.approx(out.metrics["loss"] / 11)
    assert 0.0 <= out.metrics["clip_fraction"] <= 1.0 and out.metrics["ratio/mean"] > 0
    unweighted = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]},
        )
        for d in datums
    ]
    client.forward(unweighted, "cross_entropy").result()
    assert ledger.total().train_computed_tokens == 34
    assert ledger.total().train_loss_tokens == 11 + 17  # no weights: every position


def test_cross_entropy_training_lowers_the_loss() -> None:
    corpus = [[1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26]]
    datums = [
        Datum(model_input=ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in corpus
    ]
    client = TrainingClient(make_model())
    losses_seen = []
    for _ in range(8):
        losses_seen.append(
            client.forward_backward(datums, "cross_entropy").result().metrics["loss"]
        )
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert losses_seen[-1] < 0.7 * losses_seen[0]
    assert client.step == 8


def test_optim_step_reports_grad_norm_and_clips() -> None:
    eps = 0.5  # a large eps makes Adam's first update depend on the gradient's scale
    clipped = TrainingClient(make_model())
    clipped.forward_backward(batch(), "cross_entropy").result()
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in clipped.model.parameters()])
    )
    out = clipped.optim_step(
        AdamParams(learning_rate=1e-2, eps=eps, grad_clip_norm=0.25 * norm.item())
    )
    metrics = out.result().metrics
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    assert metrics["step"] == 1.0
    assert all(p.grad is None for p in clipped.model.parameters())

    manual = TrainingClient(make_model())
    manual.forward_backward(batch(), "cross_entropy").result()
    for p in manual.model.parameters():
        p.grad.mul_(0.25 * norm / (norm + 1e-6))
    manual.optim_step(AdamParams(learning_rate=1e-2, eps=eps)).result()
    assert_same(weights(clipped.model), weights(manual.model), atol=1e-6)


def _run(client: TrainingClient, steps: int) -> None:
    for _ in range(steps):
        client.forward_backward(batch(), "ppo").result()
        client.optim_step(
            AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
        ).result()


def test_save_load_resumes_exactly(tmp_path: Path) -> None:
    a = TrainingClient(make_model(0))
    _run(a, 1)
    torch.manual_seed(123)
    a.save_state(tmp_path / "ckpt").result()
    a.save_state(tmp_path / "ckpt").result()  # saving again replaces, leaving one set of files
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "ckpt").iterdir())
    assert names == ["manifest.json", "state", "weights"]
    draw_a = torch.rand(3)
    _run(a, 1)

    b = TrainingClient(make_model(seed=7))
    assert b.load_state(tmp_path / "ckpt").result() == 1
    assert torch.equal(torch.rand(3), draw_a)  # RNG state restored
    _run(b, 1)
    assert b.step == a.step == 2
    assert_same(weights(a.model), weights(b.model), atol=1e-6)


def test_load_state_refuses_missing_or_mismatched_checkpoints(tmp_path: Path) -> None:
    client = TrainingClient(make_model())
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        client.load_state(tmp_path / "nothing")
    client.save_state(tmp_path / "ckpt")
    other = Transformer(
        ModelConfig(
            vocab_size=64,
            dim=32,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=64,
            max_seq_len=32,
        )
    )
    with pytest.raises(ValueError, match="does not match"):
        TrainingClient(other).load_state(tmp_path / "ckpt")


def _bad_requests() -> list[tuple[list, str, dict | None, str]]:
    good = batch()[0]
    n = good.model_input.length
    tokens = good.model_input.tokens

    def construct(**inputs: object) -> Datum:
        return Datum.model_construct(
            model_input=ModelInput(tokens=tokens), loss_fn_inputs={**good.loss_fn_inputs, **inputs}
        )

    return [
        (
            [good, construct(target_tokens=[1, 2])],
            "ppo",
            None,
            r"datums\[1\].*'target_tokens'.* 2 values",
        ),
        (
            [good, construct(target_tokens=[1, 2, 3, 64, 4])],
            "ppo",
            None,
            r"datums\[1\].*\[3\] = 64",
        ),
        (
            [construct(advantages=[0.0, 1.0, math.nan, 1.0, 1.0])],
            "ppo",
            None,
            r"'advantages'\]\[2\] = nan",
        ),
        (
            [construct(logprobs=torch.tensor([0.0, -1.0, -1.0, -math.inf, 0.0]))],
            "importance_sampling",
            None,
            r"'logprobs'\]\[3\] = -inf",
        ),
        (
            [
                good,
                Datum(
                    model_input=good.model_input, loss_fn_inputs={"target_tokens": tokens[1:] + [1]}
                ),
            ],
            "ppo",
            None,
            r"datums\[1\].*missing 'logprobs'",
        ),
        (
            [
                Datum(
                    model_input=ModelInput.from_ints([1, 99]),
                    loss_fn_inputs={"target_tokens": [1, 2]},
                )
            ],
            "cross_entropy",
            None,
            r"model_input.tokens\[1\] = 99",
        ),
        (
            [
                Datum(
                    model_input=ModelInput.from_ints([1] * 33),
                    loss_fn_inputs={"target_tokens": [1] * 33},
                )
            ],
            "cross_entropy",
            None,
            "33 tokens, more than the model's max_seq_len 32",
        ),
        ([construct(weight=[1.0] * n)], "ppo", None, r"unknown key\(s\) \['weight'\]"),
        ([good], "reinforce", None, "unknown loss_fn"),
        ([good], "ppo", {"clip_low_threshold": 2.0}, "clip_low_threshold"),
        ([], "ppo", None, "datums is empty"),
        # valid shapes, but the importance ratio overflows: refused after compute, still atomic
        ([good, construct(logprobs=[-1e4] * n)], "importance_sampling", None, "not finite"),
    ]


def test_bad_input_is_refused_and_changes_nothing() -> None:
    reference = TrainingClient(make_model())
    client = TrainingClient(make_model())
    for c in (reference, client):
        _run(c, 1)  # the optimizer exists and has state
        c.forward_backward(batch()[:2], "ppo").result()
    grads_before, weights_before = grads(client.model), weights(client.model)
    optim_before = copy.deepcopy(client._optimizer.state_dict())  # type: ignore[union-attr]
    for datums, loss_fn, config, match in _bad_requests():
        with pytest.raises(ValueError, match=match):
            client.forward_backward(datums, loss_fn, config).result()
        assert_same(grads(client.model), grads_before)
    assert_same(weights(client.model), weights_before)
    assert client.ledger.total() == reference.ledger.total()
    after = client._optimizer.state_dict()  # type: ignore[union-attr]
    for k, state in optim_before["state"].items():
        assert all(torch.equal(state[s], after["state"][k][s]) for s in state)
    for c in (reference, client):
        c.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert_same(weights(client.model), weights(reference.model))


def test_runs_from_another_thread_and_publishes_in_order() -> None:
    published: list[int] = []
    client = TrainingClient(make_model())
    def publish(check: Callable[[], None]) -> str:
        check()  # the weights' probe: these pass it
        published.append(client.step)
        return "sampler"

    client = TrainingClient(client.model, publish=publish)
    results = []
    t = threading.Thread(
        target=lambda: results.append(client.forward_backward(batch(), "ppo").result())
    )
    t.start()
    t.join()
    assert results[0].usage.train_computed_tokens == 17
    client.optim_step(AdamParams())  # not waited on: publishing still comes after it
    assert client.save_weights_and_get_sampling_client() == "sampler"
    assert published == [1]
    with pytest.raises(RuntimeError, match="no publish callable"):
        TrainingClient(make_model()).save_weights_and_get_sampling_client()


def test_bf16_autocast_keeps_fp32_master_weights() -> None:
    fp32 = TrainingClient(make_model()).forward(batch(), "ppo").result()
    client = TrainingClient(make_model(), TrainerOptions(compute_dtype=torch.bfloat16))
    out = client.forward_backward(batch(), "ppo").result()
    for a, b in zip(out.loss_fn_outputs, fp32.loss_fn_outputs):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=0.1)
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert all(p.dtype == torch.float32 for p in client.model.parameters())
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainingClient(make_model(), TrainerOptions(compute_dtype=torch.float16))


# -- the hosted service's conventions -------------------------------------------------------


def test_data_is_the_argument_name() -> None:
    client = TrainingClient(make_model())
    a = client.forward(data=batch(), loss_fn="ppo").result()
    c = client.forward(batch(), "ppo").result()
    assert a.metrics["loss:sum"] == c.metrics["loss:sum"]
    assert a.metrics["loss"] == a.metrics["loss:sum"]  # the old name stays
    with pytest.raises(ValueError, match="needs loss_fn"):
        client.forward(batch())


def _service_style_rl_datum(prompt: list[int], sampled: list[int],
                            sampler_logprobs: list[float], advantage: float) -> Datum:
    """An RL datum as the hosted service's cookbook builds it: no weights; logprobs and
    advantages 0 on the prompt."""
    ob = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={"target_tokens": [0] * ob + sampled,
                        "logprobs": [0.0] * ob + sampler_logprobs,
                        "advantages": [0.0] * ob + [advantage] * len(sampled)},
    )


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "gspo",
                                     "stable_reinforce", "dro"])
def test_rl_datums_without_weights_count_only_their_sampled_positions(loss_fn: str) -> None:
    client = TrainingClient(make_model())
    prompt, sampled = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    # on-policy sampler logprobs: the trainer's own
    probe = _service_style_rl_datum(prompt, sampled, [0.0] * 3, 1.0)
    logp = client.forward([probe], "importance_sampling").result().loss_fn_outputs[0]["logprobs"]
    datum = _service_style_rl_datum(prompt, sampled, logp[-3:], 1.0)
    out = client.forward_backward(data=[datum], loss_fn=loss_fn).result()
    assert out.usage.train_loss_tokens == 3 == datum.num_loss_tokens
    assert out.metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-5)  # not pulled down by prompt
    assert out.metrics["kl_sampler/mean"] == pytest.approx(0.0, abs=1e-5)


def test_forward_backward_custom_matches_autograd_through_the_model() -> None:
    """A loss that no built-in has (a squared mean logprob per datum), trained through
    forward_backward_custom, gives the gradient that autograd gives end to end."""
    datums = batch()

    def loss_fn(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        per_datum = [(lp * torch.tensor(d.loss_fn_inputs["weights"])).sum() ** 2
                     for d, lp in zip(data, logprobs, strict=True)]
        total = torch.stack(per_datum).sum()
        return total, {"custom/first": float(per_datum[0].detach())}

    client = TrainingClient(make_model())
    out = client.forward_backward_custom(datums, loss_fn).result()

    reference = make_model()
    expected = 0.0
    for d in datums:
        tokens = torch.tensor([d.model_input.tokens])
        targets = torch.tensor([d.loss_fn_inputs["target_tokens"]])
        logp = torch.log_softmax(reference(tokens), -1)[0].gather(1, targets.T)[:, 0]
        term = (logp * torch.tensor(d.loss_fn_inputs["weights"])).sum() ** 2
        term.backward()
        expected += float(term.detach())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert "custom/first" in out.metrics
    assert len(out.loss_fn_outputs[1]["logprobs"]) == datums[1].model_input.length
    for (name, p), q in zip(client.model.named_parameters(), reference.parameters(), strict=True):
        # fp32 sums in another order (the chunked head): within 1e-6 of the largest entry
        scale = float(q.grad.abs().max())
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * max(scale, 1.0)), name
    assert out.usage.train_computed_tokens == 2 * 17  # two forwards
    with pytest.raises(ValueError, match="callable"):
        client.forward_backward_custom(datums, "cross_entropy")  # type: ignore[arg-type]
