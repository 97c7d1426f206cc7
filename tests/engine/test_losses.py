"""The three losses: hand-computed values, gradients, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgym.engine import losses


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


def test_ppo_thresholds_are_offsets_from_one() -> None:
    logp = torch.tensor([[0.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0], logprobs=[-1.0], advantages=[1.0])  # r = e
    config = losses.validate_config("ppo", {"clip_low_threshold": 0.1, "clip_high_threshold": 0.5})
    loss, _ = losses.ppo(logp, inputs, config)
    assert loss.item() == pytest.approx(-1.5)


def test_weight_zero_positions_do_not_count() -> None:
    logp = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    inputs = _inputs(weights=[1.0, 0.0], logprobs=[-1.0, -1.0], advantages=[1.0, 5.0])
    loss, sums = losses.ppo(logp, inputs, losses.validate_config("ppo", None))
    assert loss.item() == pytest.approx(-1.0)
    assert sums["clip_fraction"] == 0.0 and sums["ratio/mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("loss_fn", sorted(losses.LOSSES))
def test_gradcheck_through_logits(loss_fn: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (2, 4), generator=gen)
    with torch.no_grad():
        base = losses.target_logprobs(logits, targets)
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
        return spec.fn(losses.target_logprobs(x, targets), inputs, config)[0]

    assert torch.autograd.gradcheck(f, (logits,))


def test_target_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(losses.target_logprobs(logits, targets), expected)


@pytest.mark.parametrize(
    ("loss_fn", "config", "match"),
    [
        ("mse", None, "unknown loss_fn 'mse'"),
        ("cross_entropy", {"clip_low_threshold": 0.2}, "not used by 'cross_entropy'"),
        ("ppo", {"clip_low": 0.2}, "clip_low"),
        ("ppo", {"clip_low_threshold": 1.0}, "clip_low_threshold"),
        ("ppo", {"clip_high_threshold": -0.1}, "clip_high_threshold"),
        ("ppo", {"clip_high_threshold": float("nan")}, "finite"),
        ("ppo", {"clip_high_threshold": "0.2"}, "finite number"),
    ],
)
def test_bad_loss_or_config_is_refused(loss_fn: str, config: dict | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        losses.validate_config(loss_fn, config)
