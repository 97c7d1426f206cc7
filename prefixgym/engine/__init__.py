"""prefixgym.engine: the built-in model, its prefix-cached sampler and its trainer.

Three wings under one service: `model/` (what a model is, how it loads and exports,
LoRA), `sampler/` (the KV pool, the prefix cache, the scheduler and the
`SamplingClient`) and `trainer/` (the prefix trie, losses, passes, the optimizer, the
`TrainingClient`, DDP). The sampler and the trainer import the model wing, never each
other; `service.EngineService` owns the model and its weights versions and hands out
clients of both. The engine knows token ids only: no tokenizer, no chat format, no
envs (`prefixgym.LocalService` adds the tokenizer on top).
"""
