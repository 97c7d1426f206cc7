"""A real vLLM on the tiny model, in a process of its own, for the serving tests
(`VLLMServer`; tests marked `vllm`, skipped with one line when there is no .venv-vllm,
which `./run.sh test` builds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixgym.local_service import LocalService
from prefixgym.serving.launch import ServerProcess, VLLMLaunch, free_port
from prefixgym.serving.openai_client import OpenAISamplingClient

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_OPT_OUT = "PREFIXGYM_VLLM"


def vllm_skip_reason() -> str | None:
    """Why the real-vLLM tests cannot run here (None: they can)."""
    if os.environ.get(VLLM_OPT_OUT) == "0":
        return (f"real-vLLM tests skipped ({VLLM_OPT_OUT}=0); without it `./run.sh test` "
                "builds .venv-vllm and runs them")
    if not VLLM_PYTHON.is_file():
        return ("real-vLLM tests skipped: no .venv-vllm; `./run.sh test` (or `./run.sh "
                "vllm`) builds it, once: about 4 minutes")
    return None


class VLLMServer:
    """A vLLM server on the tiny model's seed-0 weights (the trainer's base), taking
    LoRA adapters up to rank 8 and full-weight reloads; float32, as the trainer."""

    def __init__(self, directory: Path, lora_rank: int = 8) -> None:
        if (reason := vllm_skip_reason()) is not None:
            pytest.skip(reason)
        self.base = directory / "tiny"
        if not self.base.is_dir():
            with LocalService(model="tiny", seed=0) as service:
                service.save_hf_dir(self.base)
        launch = VLLMLaunch(str(self.base), served_model_name="tiny", port=free_port(),
                            lora_rank=lora_rank, dtype="float32", block_size=32)
        self.url = f"http://127.0.0.1:{launch.port}"
        self.log = directory / f"vllm-{launch.port}.log"
        self.process = ServerProcess(launch.argv(str(VLLM_PYTHON)), self.url, launch.env(),
                                     log_path=self.log, name="vLLM")
        self.process.wait_ready(timeout_s=900, progress=False)

    def restore(self) -> None:
        """Back to the base weights, no adapters, an empty prefix cache."""
        with OpenAISamplingClient(self.url) as client:
            for name in client.loaded_adapters():
                client.unload_lora_adapter(name)
            client.update_weights_from_disk(str(self.base), "base")
