"""A plain-torch training engine with the methods the trainer calls on a DeepSpeed engine (``train.engine=torch``).

:class:`TorchEngine` wraps the trainable module, its optimiser and LR scheduler with DeepSpeed's ZeRO-stage-0
semantics (``deepspeed.runtime.engine.DeepSpeedEngine``, fp32 master weights): ``backward`` scales the loss by
1 / ``grad_accum``; the ``grad_accum``-th ``step`` of an optimiser step averages the gradients over the processes
(one all-reduce of all of them, flattened), clips them to the global L2 norm ``grad_clip``
(``torch.nn.utils.clip_grad_norm_``: coefficient max_norm / (norm + 1e-6), at most 1), then steps the optimiser and
the scheduler and clears the gradients. Its checkpoints are a folder per tag, written atomically by rank 0:
``model.safetensors`` (the module's state dict) and ``state.pt`` (``torch.save`` of the optimiser and scheduler state,
the micro/global step counters and the caller's client state, read back with ``weights_only=True``).

What it leaves out, and DeepSpeed has: ZeRO stages 1-3 (partitioned optimiser state, gradients, parameters), loss
scaling for fp16, and the compiled CPU comm op (it needs none: it runs on a plain ``torch.distributed`` group, or
on no group at all in one process).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist

from dartree.base.files import write_folder_atomically

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


class TorchEngine:
    """DeepSpeed's engine surface over plain torch (see the module docstring for the semantics).

    Args:
        module: the trainable module (drafter + head), already on the training device.
        optimizer: its optimiser (over the trainable parameters). scheduler: an LR scheduler stepped once per
            optimiser step, or None.
        grad_accum: micro-steps (``backward`` + ``step`` pairs) per optimiser step on this process, >= 1.
        grad_clip: max global L2 norm of the gradients (0: no clipping).
    Attributes:
        micro_steps, global_steps: ``step`` calls and optimiser steps so far (saved and restored).
    Raises:
        ValueError: ``grad_accum`` < 1 or ``grad_clip`` < 0.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, *,
                 grad_accum: int = 1, grad_clip: float = 0.0):
        if int(grad_accum) < 1 or grad_clip < 0:
            raise ValueError(f"TorchEngine needs grad_accum >= 1 and grad_clip >= 0, got {grad_accum}, {grad_clip}")
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, scheduler
        self.grad_accum, self.grad_clip = int(grad_accum), float(grad_clip)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.micro_steps = self.global_steps = 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.world > 1:  # every rank starts from rank 0's weights (DeepSpeed broadcasts them too)
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, 0)

    # ---- DeepSpeed's engine surface -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        """The module's forward."""
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self) -> None:
        """The module in training mode."""
        self.module.train()

    def eval(self) -> None:
        """The module in evaluation mode."""
        self.module.eval()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` ends an optimiser step."""
        return (self.micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` / ``grad_accum`` (a scalar tensor; its graph is freed)."""
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()

    def step(self) -> None:
        """End a micro-step; at an accumulation boundary average the gradients over the processes, clip them,
        step the optimiser and the scheduler, and clear the gradients."""
        if self.is_gradient_accumulation_boundary():
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.world > 1 and grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat.div_(self.world)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
            if self.grad_clip > 0 and grads:
                torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self.grad_clip)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1
        self.micro_steps += 1

    def save_checkpoint(self, save_dir: str | Path, tag: str, client_state: dict | None = None,
                        save_latest: bool = False) -> bool:
        """Write ``save_dir/tag`` atomically on rank 0 (every rank holds the same state; the others write nothing):
        ``model.safetensors`` and ``state.pt``. ``save_latest`` is accepted for DeepSpeed's signature and ignored
        (the caller names the tag). Returns True.

        Raises:
            OSError: the folder cannot be written (the previous one is left as it was).
        """
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return True
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.module.state_dict().items()}
        buf = io.BytesIO()
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
                    "micro_steps": self.micro_steps, "global_steps": self.global_steps,
                    "client_state": client_state or {}}, buf)
        write_folder_atomically(Path(save_dir) / tag, {
            MODEL_FILE: {"tensors": tensors, "metadata": {"format": "pt"}}, STATE_FILE: buf.getvalue()})
        return True

    def load_checkpoint(self, load_dir: str | Path, tag: str, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True):
        """Restore what :meth:`save_checkpoint` wrote in ``load_dir/tag``; returns (its path, the client state),
        or (None, None) when there is no such folder (as DeepSpeed).

        Raises:
            RuntimeError: the module's tensors do not fit (``load_module_strict``: a missing or unexpected key).
            OSError / safetensors' error: a truncated file.
        """
        from safetensors.torch import load_file

        folder = Path(load_dir) / tag
        if not (folder / MODEL_FILE).exists() or not (folder / STATE_FILE).exists():
            return None, None
        dev = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self.module.load_state_dict(load_file(str(folder / MODEL_FILE), device=str(dev)), strict=load_module_strict)
        state = torch.load(folder / STATE_FILE, map_location=dev, weights_only=True)
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.micro_steps, self.global_steps = int(state["micro_steps"]), int(state["global_steps"])
        return str(folder), state["client_state"]
