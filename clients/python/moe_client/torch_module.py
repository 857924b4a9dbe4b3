"""A torch.nn.Module that stands in for the Kimi K3 MoE block and calls the service: what an
attention engine written in PyTorch puts where the block was, so that its routed experts run on
the expert pool (optional dependency: torch, e.g. Debian's python3-torch).

    from moe_client.torch_module import RemoteMoeBlock
    block = RemoteMoeBlock("127.0.0.1:50051", layer=1)
    y = block(hidden_states)   # [..., H] bf16 or fp32 -> the block's output, same shape and dtype

Inference only: the service returns the block's output (without the residual add, which stays
in the decoder layer around it), not gradients; inputs that require grad are refused. The
bf16 bits go to the service unchanged (fp32 inputs are rounded to bf16, RNE, as the service
rounds them), and the output's bf16 bits come back unchanged.
"""
import numpy as np
import torch

from .client import Client


def to_bf16_bits(x):
    """A CPU tensor -> its bf16 bits as numpy uint16 (fp32 rounded to nearest even, as the
    service rounds; torch has no numpy bfloat16, so through int16)."""
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(bits):
    """numpy uint16 bf16 bits -> a bfloat16 tensor of the same shape, bits unchanged."""
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


class RemoteMoeBlock(torch.nn.Module):
    """The K3 MoE block (router, latent experts, shared experts) served by attention-svc.

    attention: host:port; layer: the MoE layer (default: the node's first); expert_budget:
    dynamic k's cap per call (None: the layer's); client_options: Client's other arguments
    (credentials=, timeout=, ...)."""

    def __init__(self, attention, layer=None, expert_budget=None, **client_options):
        super().__init__()
        self._client = Client(attention, **client_options)
        info = self._client.model_info()
        self.hidden_size = info.hidden
        self.layer = layer if layer is not None else info.layers[0]
        self.expert_budget = expert_budget
        self.last_result = None  # the service's Result of the last call (routing, budget, ...)

    def forward(self, hidden_states):
        if hidden_states.requires_grad:
            raise RuntimeError("RemoteMoeBlock is inference only (no gradients from the service)")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states [..., {hidden_states.shape[-1]}], the layer takes "
                             f"[..., {self.hidden_size}]")
        shape, dtype = hidden_states.shape, hidden_states.dtype
        x = hidden_states.detach().reshape(-1, self.hidden_size).to("cpu")
        r = self._client.forward(to_bf16_bits(x), layer=self.layer,
                                 expert_budget=self.expert_budget)
        self.last_result = r
        out = from_bf16_bits(r.out_bf16)
        return out.reshape(shape).to(dtype=dtype, device=hidden_states.device)

    def close(self):
        self._client.close()
