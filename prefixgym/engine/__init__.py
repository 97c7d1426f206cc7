"""prefixgym.engine: the built-in model, its prefix-cached sampler and its trainer.

`service.EngineService` owns the model, the weights versions, the prefix KV cache,
the scheduler thread and the usage ledger, and hands out sampling and training
clients. The engine knows token ids only: no tokenizer, no chat format, no envs
(`prefixgym.LocalService` adds the tokenizer on top).
"""
