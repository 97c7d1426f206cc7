"""Off-policy corrections: importance weights, caps and masks against hand computation,
and what they do to the losses' values, gradients and configs."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgym.engine.trainer import losses, off_policy

# One row: the trainer's logprobs (before the update), the sampler's, and the loss mask.
TRAINER = [-1.0, -2.0, -0.5, -3.0]
SAMPLER = [-1.5, -1.0, -0.5, -9.0]  # log rho = 0.5, -1, 0, (6: outside the loss)
MASK = [1.0, 1.0, 1.0, 0.0]


def _inputs(**kw: list[float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([v], dtype=torch.float64) for k, v in kw.items()}


def _rl_inputs(advantages: list[float] | None = None) -> dict[str, torch.Tensor]:
    return _inputs(weights=MASK, loss_mask=MASK, logprobs=SAMPLER,
                   advantages=advantages or [1.0, 2.0, -1.0, 5.0])


def _weights(config: dict[str, float]) -> tuple[list[float], list[bool]]:
    correction = off_policy.correction_of(losses.validate_config("ppo", config))
    assert correction is not None
    w, acted = off_policy.importance_weights(
        torch.tensor([TRAINER], dtype=torch.float64), torch.tensor([SAMPLER], dtype=torch.float64),
        torch.tensor([MASK]) != 0, correction)
    return w[0].tolist(), acted[0].tolist()


def test_truncated_per_token_by_hand() -> None:
    w, capped = _weights({"off_policy_tis_cap": 1.5})
    # rho = e^0.5 = 1.65 (cut to 1.5), e^-1 = 0.37, 1; outside the loss: 0
    assert w == pytest.approx([1.5, math.exp(-1.0), 1.0, 0.0])
    assert capped == [True, False, False, False]


def test_masked_per_token_by_hand() -> None:
    w, masked = _weights({"off_policy_mis_low": 0.5, "off_policy_mis_high": 2.0})
    # e^-1 = 0.37 < 0.5: masked to 0; the others kept at rho
    assert w == pytest.approx([math.exp(0.5), 0.0, 1.0, 0.0])
    assert masked == [False, True, False, False]


def test_per_sequence_is_the_geometric_mean_over_the_loss_positions() -> None:
    seq = math.exp((0.5 - 1.0 + 0.0) / 3)  # 0.846; the position outside the loss not counted
    w, capped = _weights({"off_policy_tis_cap": 2.0, "off_policy_sequence": 1.0})
    assert w == pytest.approx([seq, seq, seq, 0.0]) and not any(capped)
    w, masked = _weights({"off_policy_mis_low": 0.9, "off_policy_mis_high": 8.0,
                          "off_policy_sequence": 1.0})
    assert w == pytest.approx([0.0] * 4) and masked == [True, True, True, False]


@pytest.mark.parametrize("decoupled", [0, 1])
def test_corrected_importance_sampling_by_hand_and_its_gradient(decoupled: int) -> None:
    logp = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    config = losses.validate_config("importance_sampling", {"off_policy_tis_cap": 1.5,
                                                            "off_policy_decoupled": decoupled})
    loss, sums = losses.loss_of(losses.LOSSES["importance_sampling"], logp, _rl_inputs(), config)
    w = [1.5, math.exp(-1.0), 1.0, 0.0]
    adv = [1.0, 2.0, -1.0, 5.0]
    # in both forms the ratio times the factor is w in value: -sum w A
    assert loss.item() == pytest.approx(-sum(a * b for a, b in zip(w, adv)))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-a * b for a, b in zip(w, adv)])
    assert sums["off_policy/weight"] == pytest.approx(sum(w))
    assert sums["off_policy/capped"] == 1.0
    # the ratio and k3 metrics stay those to the sampler
    log_r = [0.5, -1.0, 0.0]
    assert sums["ratio/mean"] == pytest.approx(sum(math.exp(x) for x in log_r))
    assert sums["kl_sampler/mean"] == pytest.approx(sum(math.expm1(x) - x for x in log_r))


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo",
                                     "stable_reinforce"])
def test_the_sampler_ratio_leaves_a_loss_as_it_was_where_no_cap_acts(loss_fn: str) -> None:
    config = losses.validate_config(loss_fn, {"off_policy_tis_cap": 100.0})
    (corrected, sums), (plain, _), grads = _loss_and_plain(loss_fn, config, _rl_inputs())
    assert corrected.item() == plain.item() and grads[0] == grads[1]
    assert sums["off_policy/capped"] == 0.0


def test_the_sampler_ratio_keeps_ppos_clip_and_bounds_a_negative_advantage() -> None:
    """rho = e^0.5, e^-1, 1. Token 0's advantage is negative and its ratio 1.65 is past
    the clip, where ppo's own term is unbounded; the cap 1.5 bounds its weight.
    Token 1 (ratio 0.37, inside the cap) trains as uncorrected ppo."""
    logp = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    inputs = _rl_inputs([-1.0, 2.0, -1.0, 5.0])
    config = losses.validate_config("ppo", {"off_policy_tis_cap": 1.5})
    loss, sums = losses.loss_of(losses.LOSSES["ppo"], logp, inputs, config)
    r1 = math.exp(-1.0)
    assert loss.item() == pytest.approx(-(-1.5 + r1 * 2.0 - 1.0))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([1.5, -r1 * 2.0, 1.0, 0.0])
    assert sums["off_policy/capped"] == 1.0
    masked = losses.validate_config("ppo", {"off_policy_mis_low": 0.5, "off_policy_mis_high": 8.0})
    loss, sums = losses.loss_of(losses.LOSSES["ppo"], logp, inputs, masked)
    (grad,) = torch.autograd.grad(loss, logp)  # token 1 (rho 0.37 < 0.5) leaves the loss
    assert grad[0].tolist() == pytest.approx([math.exp(0.5), 0.0, 1.0, 0.0])
    assert sums["off_policy/masked"] == 1.0


def test_the_sampler_ratio_weighs_dros_tokens_whole() -> None:
    """dro's penalty stays on the log-ratio to the sampler; the capped token's whole
    term (advantage and penalty) is weighed by cap / rho."""
    config = losses.validate_config("dro", {"off_policy_tis_cap": 1.5})
    _, _, (grad, plain) = _loss_and_plain("dro", config, _rl_inputs())
    assert grad == pytest.approx([plain[0] * 1.5 / math.exp(0.5), *plain[1:]])


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "gspo"])
def test_decoupled_a_cap_that_never_acts_trains_as_importance_sampling(loss_fn: str) -> None:
    """w x pi_theta/pi_old = pi_theta/pi_sampler: with no cap hit, importance_sampling's
    gradient is the uncorrected one; the clipped losses then train as importance
    sampling does (their clip is around the weights before the update, never hit here)."""
    logp = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    config = losses.validate_config(loss_fn, {"off_policy_tis_cap": 100.0,
                                              "off_policy_decoupled": 1})
    loss, _ = losses.loss_of(losses.LOSSES[loss_fn], logp, _rl_inputs(), config)
    (grad,) = torch.autograd.grad(loss, logp)
    reference = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    plain, _ = losses.importance_sampling(reference, _rl_inputs(), {})
    (expected,) = torch.autograd.grad(plain, reference)
    assert grad[0].tolist() == pytest.approx(expected[0].tolist())


@pytest.mark.parametrize("decoupled", [0, 1])
def test_gspo_per_sequence_weighs_every_token_by_the_geometric_mean(decoupled: int) -> None:
    """The sequence's rho e^(-1/6) is under the cap: decoupled, every token's weight is
    it (gspo's ratio to pi_old is 1); with the sampler ratio, gspo is as uncorrected."""
    logp = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    config = losses.validate_config("gspo", {"off_policy_tis_cap": 2.0, "off_policy_sequence": 1,
                                             "off_policy_decoupled": decoupled})
    loss, _ = losses.loss_of(losses.LOSSES["gspo"], logp, _rl_inputs(), config)
    (grad,) = torch.autograd.grad(loss, logp)
    seq = math.exp((0.5 - 1.0 + 0.0) / 3)
    if decoupled:
        assert grad[0].tolist() == pytest.approx([-seq * 1.0, -seq * 2.0, seq * 1.0, 0.0])
    else:
        _, _, (_, plain) = _loss_and_plain("gspo", config, _rl_inputs())
        assert grad[0].tolist() == plain


def _loss_and_plain(loss_fn: str, config: dict[str, float], inputs: dict[str, torch.Tensor]):
    """(corrected loss and sums, plain loss and sums, (corrected grad, plain grad))."""
    logp = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([TRAINER], dtype=torch.float64, requires_grad=True)
    spec = losses.LOSSES[loss_fn]
    corrected = losses.loss_of(spec, logp, inputs, config)
    plain = spec.fn(reference, inputs, {k: v for k, v in config.items()
                                        if not k.startswith("off_policy_")})
    grads = (torch.autograd.grad(corrected[0], logp)[0][0].tolist(),
             torch.autograd.grad(plain[0], reference)[0][0].tolist())
    return corrected, plain, grads


def test_no_correction_is_the_plain_loss() -> None:
    logp = torch.tensor([TRAINER], dtype=torch.float64)
    config = losses.validate_config("ppo", None)
    corrected = losses.loss_of(losses.LOSSES["ppo"], logp, _rl_inputs(), config)
    plain = losses.ppo(logp, _rl_inputs(), config)
    assert corrected[0].item() == plain[0].item() and corrected[1] == plain[1]


@pytest.mark.parametrize(("loss_fn", "config", "match"), [
    ("cross_entropy", {"off_policy_tis_cap": 2.0}, "takes no off-policy correction"),
    ("dro", {"off_policy_tis_cap": 2.0, "off_policy_decoupled": 1}, "takes no decoupled"),
    ("stable_reinforce", {"off_policy_mis_low": 0.1, "off_policy_mis_high": 8.0,
                          "off_policy_decoupled": 1}, "takes no decoupled"),
    ("ppo", {"off_policy_tis_cap": 2.0, "off_policy_decoupled": 0.5}, "0 \\(the sampler ratio\\)"),
    ("ppo", {"off_policy_decoupled": 1.0}, "needs a correction"),
    ("ppo", {"off_policy_tis_cap": 0.5}, "must be >= 1"),
    ("ppo", {"off_policy_tis_cap": 2.0, "off_policy_mis_low": 0.1}, "give one"),
    ("ppo", {"off_policy_mis_low": 0.1}, "needs both"),
    ("ppo", {"off_policy_sequence": 1.0}, "needs a correction"),
    ("ppo", {"off_policy_tis_cap": 2.0, "off_policy_sequence": 0.5}, "0 \\(per token\\)"),
    ("ppo", {"off_policy_mis_low": 2.0, "off_policy_mis_high": 8.0}, "0 <= low <= 1 <= high"),
])
def test_a_bad_correction_is_refused(loss_fn: str, config: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        losses.validate_config(loss_fn, config)
