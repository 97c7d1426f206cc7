"""The decoder's MLPs: `GatedMLP` (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU) and
`MixtureOfExperts` (a router picks each token's experts, Qwen3-MoE's or gpt-oss's
routing), with the `ExpertAdapter` protocol a LoRA model's experts implement.

This module knows one layer's MLP in isolation: nothing of attention, norms, KV storage
or where the weights came from (`families.py`, `hf_checkpoint.py`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefixgym.engine.model.config import ModelConfig

__all__ = ["ExpertAdapter", "GatedMLP", "MixtureOfExperts"]


def _glu(gate: torch.Tensor, up: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The gated unit of `config.activation`: act(gate) * up, or gpt-oss's clamped one."""
    if config.activation == "silu":
        return F.silu(gate) * up
    if config.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    limit = config.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * config.swiglu_alpha))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (SiLU) or GeGLU (tanh GeLU: Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul; rows ordered [gate | up].
        self.w_gate_up = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)
        self.w_down = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(_glu(gate, up, self.config))


class ExpertAdapter(Protocol):
    """What a mixture asks of its experts' LoRA (`lora.ExpertLora`)."""

    def delta(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        """The update of one expert's "gate_up" or "down" output for its rows `x`."""
        ...


class MixtureOfExperts(nn.Module):
    """A router picks `experts_per_token` of `num_experts` gated MLPs for each token and
    adds their outputs, weighted by the router: Qwen3-MoE's softmax over every expert in
    fp32, then the top k (renormalised when the config says), or gpt-oss's top k logits,
    then a softmax over them. transformers' ops in its order, so the same experts win,
    ties included, and each token's experts are summed in ascending expert order.

    The experts' weights are stacked: `w_gate_up` (E, 2F, C), rows [gate | up] per
    expert, and `w_down` (E, C, F), as transformers 5 holds Qwen3-MoE's; with
    `expert_bias`, `b_gate_up` (E, 2F) and `b_down` (E, C) too (gpt-oss's, whose
    interleaved gate/up columns the loader puts in this order)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, C, F_ = config.num_experts, config.dim, config.expert_hidden_dim
        self.config = config
        self.top_k = config.experts_per_token
        self.router = nn.Linear(C, E, bias=config.router_bias)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * F_, C))
        self.w_down = nn.Parameter(torch.empty(E, C, F_))
        self.b_gate_up: nn.Parameter | None = None
        self.b_down: nn.Parameter | None = None
        self.adapter: ExpertAdapter | None = None
        """The experts' LoRA (`lora.ExpertLora`) of a LoRA model, or None."""
        self.router_logits: list[torch.Tensor] | None = None
        """When a list, each forward appends its router logits (N, E) to it (the
        trainer's auxiliary loss: `engine/trainer/router_loss.py`)."""
        if config.expert_bias:
            self.b_gate_up = nn.Parameter(torch.zeros(E, 2 * F_))
            self.b_down = nn.Parameter(torch.zeros(E, C))

    def route(self, x_N_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) in x's dtype, expert ids (N, k)) of each token."""
        logits = self.router(x_N_C)
        if self.router_logits is not None:
            self.router_logits.append(logits)
        if self.config.router == "topk_softmax":
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.config.normalize_router_weights:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x_N_C.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_N_C = x.reshape(-1, x.shape[-1])
        weights_N_k, experts_N_k = self.route(x_N_C)
        out = torch.zeros_like(x_N_C)
        b_gate_up, b_down, lora = self.b_gate_up, self.b_down, self.adapter
        for e in torch.unique(experts_N_k).tolist():  # ascending
            slot, token = torch.where(experts_N_k.T == e)  # transformers' row order
            x_e = x_N_C[token]
            gate_up = F.linear(x_e, self.w_gate_up[e])
            if b_gate_up is not None:  # added after the matmul, as transformers rounds
                gate_up = gate_up + b_gate_up[e]
            if lora is not None:
                gate_up = gate_up + lora.delta(x_e, e, "gate_up")
            gate, up = gate_up.chunk(2, dim=-1)
            h = _glu(gate, up, self.config)
            y = F.linear(h, self.w_down[e])
            if b_down is not None:
                y = y + b_down[e]
            if lora is not None:
                y = y + lora.delta(h, e, "down")
            out.index_add_(0, token, (y * weights_N_k[token, slot, None]).to(out.dtype))
        return out.view(x.shape)
