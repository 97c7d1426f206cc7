"""The trainer wing: forward_backward and optim_step on the model.

`prefix_trie.py` and `shared_forward.py` (each token prefix shared by a call's datums
computed once), `logprob_head.py` (target logprobs a chunk of rows at a time),
`losses.py` and `custom_loss.py` (the losses), `train_batch.py` (datum checks,
padding, chunks), `train_pass.py` (one pass: forward, loss, gradients),
`optimizer.py` (AdamW with the non-finite policy), `training.py` (the
`TrainingClient` users hold), `distributed.py` (DDP under torchrun) and `fsdp.py`
(FSDP2 under torchrun: sharded weights). It imports the
model wing, never the sampler's: a new weights version reaches samplers through the
`publish` callable the service hands it.
"""

from prefixgym.engine.trainer.losses import LOSSES
from prefixgym.engine.trainer.training import TrainingClient

__all__ = ["LOSSES", "TrainingClient"]
