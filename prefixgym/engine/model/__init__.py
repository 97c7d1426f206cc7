"""The model wing: what a model is and how it gets in and out.

`config.py` (ModelConfig and the presets), `layers.py` (RMSNorm, RoPE, attention and
its sliding windows, the block), `mlp.py` (the gated MLP, the mixture of experts),
`token_packing.py` (a padded batch's real tokens), `shared_attention.py` (one-query attention over keys rows share),
`wide_ops.py` (narrow decode steps), `decoder.py` (the Transformer, its init), `loading.py` (a model by
preset name or checkpoint directory), `hf_checkpoint.py` / `hf_export.py` (Hugging
Face directories in and out), `lora.py` (adapters inside the linear layers) and
`peft_format.py` (those adapters in PEFT's files). It knows tensors and files, never
requests, KV blocks, losses or optimizers: the sampler and trainer wings import it,
it imports neither. The names below are what the rest of the package uses.
"""

from prefixgym.engine.model.config import PRESETS, ModelConfig
from prefixgym.engine.model.decoder import Transformer, count_parameters, init_weights
from prefixgym.engine.model.layers import window_allows
from prefixgym.engine.model.loading import load_model
from prefixgym.engine.model.mlp import MixtureOfExperts
from prefixgym.engine.model.shared_attention import SharedKeys
from prefixgym.engine.model.token_packing import Packing

__all__ = ["PRESETS", "MixtureOfExperts", "ModelConfig", "Packing", "SharedKeys", "Transformer",
           "count_parameters", "init_weights", "load_model", "window_allows"]
