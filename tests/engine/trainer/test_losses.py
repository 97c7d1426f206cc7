"""The losses: hand-computed values, gradients, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgym.engine.trainer import losses


def _inputs(**kw: list[float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([v], dtype=torch.float64) for k, v in kw.items()}


def test_cross_entropy_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    loss, sums = losses.cross_entropy(logp, _inputs(weights=[1.0, 0.0, 2.0]), {})
    # -(1*-1 + 0*-2 + 2*-0.5) = 2
    assert loss.item() == pytest.approx(2.0)
    assert sums["nll/mean"] == pytest.approx(1.5)  # unweighted nll summed over the 2 loss tokens


def test_importance_sampling_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0, 1.0], logprobs=[-1.0, -2.5], advantages=[2.0, -1.0])
    loss, sums = losses.importance_sampling(logp, inputs, {})
    # ratios 1 and e^0.5: -(1*2 + e^0.5*-1)
    assert loss.item() == pytest.approx(-(2.0 - math.exp(0.5)))
    assert sums["ratio/mean"] == pytest.approx(1.0 + math.exp(0.5))


def test_ppo_by_hand_and_clipped_tokens_have_no_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -1.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(
        weights=[1.0, 1.0, 1.0], logprobs=[-1.0, -2.5, -0.5], advantages=[2.0, 1.0, -1.0]
    )
    config = losses.validate_config("ppo", None)
    loss, sums = losses.ppo(logp, inputs, config)
    # r = [1, e^0.5=1.65, e^-0.5=0.61]: terms min(2, 2)=2, min(1.65, 1.2)=1.2, min(-0.61, -0.8)=-0.8
    assert loss.item() == pytest.approx(-(2.0 + 1.2 - 0.8))
    assert sums["clip_fraction"] == 2.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-2.0, 0.0, 0.0])


def test_ppo_thresholds_are_bounds_on_the_ratio_as_the_service_takes_them() -> None:
    logp = torch.tensor([[0.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0], logprobs=[-1.0], advantages=[1.0])  # r = e
    config = losses.validate_config("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5})
    loss, _ = losses.ppo(logp, inputs, config)
    assert loss.item() == pytest.approx(-1.5)


def test_weight_zero_positions_do_not_count() -> None:
    logp = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0, 0.0], logprobs=[-1.0, -1.0], advantages=[1.0, 5.0])
    loss, sums = losses.ppo(logp, inputs, losses.validate_config("ppo", None))
    assert loss.item() == pytest.approx(-1.0)
    assert sums["clip_fraction"] == 0.0 and sums["ratio/mean"] == pytest.approx(1.0)


# cispo, gspo and stable_reinforce hold a stop-gradient coefficient by design, so their
# gradient is not the numerical derivative of their value; their tests check it by hand.
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "dro"])
def test_gradcheck_through_logits(loss_fn: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (2, 4), generator=gen)
    with torch.no_grad():
        base = losses.target_logprobs_of_logits(logits, targets)
    # sampler logprobs: some ratios inside the clip range, some well outside (never at a kink)
    offsets = torch.tensor([[0.0, 0.5, -0.5, 0.05], [-0.7, 0.02, 0.9, -0.1]], dtype=torch.float64)
    inputs = {
        "target_tokens": targets,
        "weights": torch.tensor([[1.0, 0.5, 0.0, 2.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64),
        "logprobs": base + offsets,
        "advantages": torch.tensor(
            [[1.0, -2.0, 0.5, 1.0], [-1.0, 0.3, 2.0, 1.0]], dtype=torch.float64
        ),
    }
    spec = losses.get_loss(loss_fn)
    config = losses.validate_config(loss_fn, None)

    def f(x: torch.Tensor) -> torch.Tensor:
        return spec.fn(losses.target_logprobs_of_logits(x, targets), inputs, config)[0]

    assert torch.autograd.gradcheck(f, (logits,))


def test_target_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(losses.target_logprobs_of_logits(logits, targets), expected)


@pytest.mark.parametrize(
    ("loss_fn", "config", "match"),
    [
        ("mse", None, "unknown loss_fn 'mse'"),
        ("cross_entropy", {"clip_low_threshold": 0.2}, "not used by 'cross_entropy'"),
        ("ppo", {"clip_low": 0.2}, "clip_low"),
        ("ppo", {"clip_low_threshold": 1.1}, "clip_low_threshold"),
        ("ppo", {"clip_high_threshold": 0.2}, "not the offset 0.2"),
        ("cispo", {"clip_low_threshold": -0.1}, "lower bound"),
        ("dro", {"beta": -1.0}, "beta"),
        ("dro", {"clip_low_threshold": 0.8}, "not used by 'dro'"),
        ("stable_reinforce", {"kl_coeff": -0.5}, "kl_coeff"),
        ("ppo", {"clip_high_threshold": float("nan")}, "finite"),
        ("ppo", {"clip_high_threshold": "0.2"}, "finite number"),
    ],
)
def test_bad_loss_or_config_is_refused(loss_fn: str, config: dict | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        losses.validate_config(loss_fn, config)


# -- the losses the hosted service added (formulas in each docstring) ---------------------


def test_cispo_by_hand_clamps_a_detached_coefficient_and_never_zeros_a_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -1.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(weights=[1.0, 1.0, 1.0], logprobs=[-1.0, -2.5, -3.0],
                     advantages=[2.0, 1.0, -1.0])
    config = losses.validate_config("cispo", {"clip_low_threshold": 0.0,
                                              "clip_high_threshold": 1.5})
    loss, sums = losses.cispo(logp, inputs, config)
    # r = [1, e^0.5 = 1.65 -> 1.5, e^2 = 7.39 -> 1.5]; loss = -sum c * logp * A
    expected = -(1.0 * -1.0 * 2.0 + 1.5 * -2.0 * 1.0 + 1.5 * -1.0 * -1.0)
    assert loss.item() == pytest.approx(expected)
    assert sums["clip_fraction"] == 2.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-2.0, -1.5, 1.5])  # -c * A, no zeros
    assert losses.validate_config("cispo", None) == {"clip_low_threshold": 0.0,
                                                      "clip_high_threshold": 4.0}


def test_dro_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(weights=[1.0, 1.0], logprobs=[-1.5, -2.0], advantages=[2.0, -1.0])
    loss, _ = losses.dro(logp, inputs, {"beta": 0.1})
    # -( (-1*2 - 0.05*0.25) + (-2*-1 - 0) )
    assert loss.item() == pytest.approx(-((-2.0 - 0.05 * 0.25) + 2.0))
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -(logp A - beta/2 (logp - q)^2) = -A + beta (logp - q)
    assert grad[0].tolist() == pytest.approx([-2.0 + 0.1 * 0.5, 1.0])


def test_gspo_uses_one_ratio_per_sequence_over_the_masked_positions() -> None:
    logp = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, -1.0]], dtype=torch.float64,
                        requires_grad=True)
    inputs = {
        "weights": torch.ones(2, 3, dtype=torch.float64),
        "logprobs": torch.tensor([[-9.0, -1.4, -2.2], [-1.0, -1.0, -1.0]], dtype=torch.float64),
        "advantages": torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]], dtype=torch.float64),
        "sequence_ratio_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
                                            dtype=torch.float64),
    }
    config = losses.validate_config("gspo", None)
    loss, sums = losses.gspo(logp, inputs, config)
    # row 0: s = exp(mean(0.4, 0.2)) = e^0.3 = 1.35 > 1.2, A > 0: clipped to 1.2 on both
    # masked tokens (position 0 has A = 0); row 1: s = 1, A = -1 twice
    assert loss.item() == pytest.approx(-(1.2 * 2 + -1.0 * 2))
    assert sums["clip_fraction"] == 2.0
    (grad,) = torch.autograd.grad(loss, logp)
    # clipped tokens get no gradient; unclipped: -w * A * s (s = 1)
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.0, 1.0])


def test_gspo_token_ratio_has_the_sequence_value_and_its_own_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(weights=[1.0, 1.0], logprobs=[-1.1, -2.0], advantages=[1.0, 3.0],
                     sequence_ratio_mask=[1.0, 1.0])
    config = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}  # no clipping
    loss, _ = losses.gspo(logp, inputs, config)
    s = math.exp(0.05)
    assert loss.item() == pytest.approx(-(s * 1.0 + s * 3.0))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-s * 1.0, -s * 3.0])


def test_stable_reinforce_by_hand_and_its_gradient_is_importance_samplings() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(weights=[1.0, 1.0], logprobs=[-1.0, -2.5], advantages=[2.0, -1.0])
    loss, _ = losses.stable_reinforce(logp, inputs, {"kl_coeff": 0.0})
    assert loss.item() == pytest.approx(-(1.0 * -1.0 * 2.0 + math.exp(0.5) * -2.0 * -1.0))
    (grad,) = torch.autograd.grad(loss, logp)
    is_loss, _ = losses.importance_sampling(logp, inputs, {})
    (is_grad,) = torch.autograd.grad(is_loss, logp)
    assert grad[0].tolist() == pytest.approx(is_grad[0].tolist())
    with_kl, _ = losses.stable_reinforce(logp, inputs, {"kl_coeff": 0.5})
    k3 = math.expm1(0.5) - 0.5  # the second token; the first has log r = 0
    assert with_kl.item() == pytest.approx(loss.item() + 0.5 * k3)


def test_metrics_count_loss_positions_only() -> None:
    """An RL datum without weights (the service's way): its prompt has advantage 0 and
    sampler logprob 0, and must not pull the ratio mean below 1."""
    logp = torch.tensor([[-3.0, -2.0, -1.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0, 1.0, 1.0], logprobs=[0.0, -2.0, -1.0],
                     advantages=[0.0, 1.0, 1.0], loss_mask=[0.0, 1.0, 1.0])
    for name in ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"):
        spec = losses.get_loss(name)
        _, sums = spec.fn(logp, inputs, losses.validate_config(name, None))
        assert sums["ratio/mean"] == pytest.approx(2.0), name  # two tokens, ratio 1 each
        assert sums["kl_sampler/mean"] == pytest.approx(0.0), name


def test_the_losses_are_the_ones_the_wire_types_name() -> None:
    """One list of names (types.LOSS_FN_NAMES): the engine implements exactly those, and
    `prefixgym train --loss` offers every one but the warm start's."""
    from prefixgym.cli.flags import field_docs
    from prefixgym.trainer.config import GRPO_LOSSES, TrainConfig
    from prefixgym.types import LOSS_FN_NAMES

    assert tuple(losses.LOSSES) == LOSS_FN_NAMES
    assert set(GRPO_LOSSES) == set(LOSS_FN_NAMES) - {"cross_entropy"}
    assert all(name in field_docs(TrainConfig)["loss"] for name in GRPO_LOSSES)  # --help
