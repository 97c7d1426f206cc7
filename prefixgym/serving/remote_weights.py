"""RemoteWeights: a sampling server's weight routes, as `serving.weight_sync` calls them.

Full weights go through `update_weights_from_disk` (SGLang's and `prefixgym serve`'s
route; on vLLM, its development routes: `_vllm_reload`); LoRA adapters through
`load_lora_adapter` / `unload_lora_adapter` (vLLM's `/v1/...` names, or SGLang's);
`loaded_adapters` reads them back from /v1/models, and `served_weights_version` the
label of the weights a vLLM server holds. `OpenAISamplingClient` offers these methods
under the same names. Knows the routes and their answers; nothing of sampling, of the
weights' files or of the trainer.
"""

from __future__ import annotations

import contextlib

from prefixgym.serving.server_http import ServerHTTP


class RemoteWeights:
    def __init__(self, http: ServerHTTP) -> None:
        self.http = http

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> str:
        """Have the server load full weights from `model_path` (an HF checkpoint
        directory it can read) and label them `weight_version`: SGLang's and prefixgym
        serve's `/update_weights_from_disk`, else vLLM's development routes
        (`_vllm_reload`). ValueError with the server's message when it cannot."""
        root = self.http.root_url
        data = self.http.call("POST", f"{root}/update_weights_from_disk",
                              {"model_path": model_path, "weight_version": weight_version},
                              absolute=True)
        if "success" not in data:
            if data.get("detail") == "Not Found":  # no such route: vLLM (docs/scaling.md)
                return self._vllm_reload(model_path, weight_version)
            raise ValueError(f"{root}/update_weights_from_disk refused: {str(data)[:300]}")
        if data.get("success") is not True:
            raise ValueError(f"{root} did not load {model_path}: {data.get('message')}")
        return str(data.get("message", ""))

    def _vllm_reload(self, model_path: str, weight_version: str) -> str:
        """vLLM 0.32 started with VLLM_SERVER_DEV_MODE=1: 1) pause, letting requests in
        flight finish; 2) every worker reloads its weights in place from `model_path`
        (`/collective_rpc` `reload_weights`); 3) empty the prefix cache, whose KV the
        old weights computed; 4) label the weights (`/weight_info` answers it); 5)
        resume. vLLM's engine ends itself when a reload fails (a path it cannot read)."""
        root, call = self.http.root_url, self.http.call
        try:
            call("POST", f"{root}/pause?mode=wait")  # 1)
        except ValueError as e:
            raise ValueError(
                f"{root} has no route that loads full weights: neither SGLang's "
                "/update_weights_from_disk nor vLLM's development routes (start vLLM with "
                "VLLM_SERVER_DEV_MODE=1, as `prefixgym serve --engine vllm` does), or "
                f"use LoRA adapters ({e})") from None
        try:
            try:  # 2)
                call("POST", f"{root}/collective_rpc", {
                    "method": "reload_weights", "kwargs": {"weights_path": model_path}})
            except RuntimeError as e:
                raise ValueError(
                    f"{root} failed to reload full weights from {model_path}, and vLLM "
                    "ends itself when that happens; the trainer and the samplers must "
                    f"share a filesystem ({e})") from None
            if call("POST", f"{root}/reset_prefix_cache").get("success") is not True:
                raise RuntimeError(f"{root} could not empty its prefix cache after the "  # 3)
                                   "weights changed")
            call("POST", f"{root}/update_weight_version", {"new_version": weight_version})  # 4)
        except BaseException:
            with contextlib.suppress(ConnectionError, RuntimeError, ValueError):
                call("POST", f"{root}/resume")  # (a server that died stays dead)
            raise
        call("POST", f"{root}/resume")  # 5)
        return f"reloaded {model_path}"

    def served_weights_version(self) -> str | None:
        """The label of the weights the server holds, for a server whose answers do not
        carry it: vLLM's `GET /weight_info` (None where there is no such route)."""
        try:
            data = self.http.call("GET", f"{self.http.root_url}/weight_info")
        except ValueError:
            return None
        version = data.get("weight_version")
        return str(version) if version is not None else None

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """vLLM's /v1/load_lora_adapter, or SGLang's /load_lora_adapter where that is absent."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        self.http.post_first(["/v1/load_lora_adapter", "/load_lora_adapter"], body)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.http.post_first(["/v1/unload_lora_adapter", "/unload_lora_adapter"],
                             {"lora_name": lora_name})

    def loaded_adapters(self) -> dict[str, str]:
        """The server's loaded LoRA adapters, name -> the path it loaded each from:
        `GET /v1/models`, where vLLM, SGLang and prefixgym serve list an adapter with
        its base model as `parent` and its path as `root`."""
        data = self.http.call("GET", "/models").get("data") or []
        return {str(card["id"]): str(card.get("root") or "") for card in data
                if isinstance(card, dict) and card.get("parent")}
