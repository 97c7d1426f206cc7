"""Whether trained weights can be sampled from: the check every save and publish makes.

`require_samplable(model, params, doing)` runs one forward of one position (a
sequence's decode step; a token from the middle of the vocabulary, not a special one
that may have a zero embedding) and requires finite logits, what the sampler checks
of every token it samples. Otherwise it raises ValueError "not <doing>: ...", naming
a NaN or inf weight, or, when every weight is finite but too large to survive a
forward (an update of learning rate 1e30), the largest one.

It computes in the weights' own dtype, as the sampler does, not under the trainer's
autocast: every linear would first cast its weight (with bf16 compute on SmolLM2-135M
the casts were 75% of the probe), and an fp16 autocast would refuse weights that the
fp32 sampler runs. One position, not eight: each product is then a matrix-vector one,
which reads each weight once; from two rows on MKL repacks the weight per call (on
SmolLM2-135M, fp32, AMD EPYC: 41-65 ms with one position, 80-140 with two to eight).
NaN or inf in a weight that one position's forward does not read (another row of an
untied embedding, an expert not routed to) is the publish's and the checkpoint
writer's own check (`nonfinite_tensor` of every tensor).

Knows the model's forward and the trained parameters; nothing of losses, optimizers or
where the weights go next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer.optimizer import named

__all__ = ["require_samplable"]


def require_samplable(model: Transformer, params: Sequence[torch.nn.Parameter],
                      doing: str) -> None:
    """ValueError "not <doing>: ..." unless a forward of the weights on one token
    gives finite logits (the module docstring)."""
    ids = torch.tensor([[model.config.vocab_size // 2]], device=model.output_weight.device)
    with torch.no_grad():
        logits = model(ids)  # (1, 1, V)
    if bool(torch.isfinite(logits).all()):
        return
    names = named(model, params)
    bad = nonfinite_tensor(zip(names, params, strict=True))
    if bad is not None:
        raise ValueError(f"not {doing}: {bad} holds NaN or inf values")
    with torch.no_grad():
        size, name = max((float(p.abs().max()), n)
                         for n, p in zip(names, params, strict=True) if p.numel())
    raise ValueError(
        f"not {doing}: every weight is finite, but a forward of them overflows (its "
        f"logits are not finite), so nothing could sample from them; the largest is "
        f"{size:.3g}, in {name} (a learning rate too large?)")
