"""prefixgym.trainer: the warm start, GRPO, evaluation, checkpoints and reports.

`run.Run` is the whole job on the clients it is given (built by `prefixgym.cli`).
Typed against the client protocols; knows nothing of the engine or of serving.
"""
