"""prefixgym beyond one process: `prefixgym serve` (an OpenAI-compatible completions
endpoint over the built-in engine) and `OpenAISamplingClient` (rollouts and evaluation
against any such endpoint: `prefixgym serve`, vLLM, SGLang).

Importing this package needs fastapi/uvicorn only for the server parts
(`pip install prefixgym[serve]`); the client needs httpx.
"""
