"""BatchNorm over the global batch (--sync-batchnorm): torch's SyncBatchNorm on GPUs, and on
CPUs (gloo) `GlobalBatchNorm`, raytrain's own all-reduced BatchNorm."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sync_batchnorm_layers(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` with every BatchNorm layer normalizing over the global batch (--sync-batchnorm).

    On a GPU, torch's SyncBatchNorm. torch's refuses CPU tensors once a process group exists
    ("SyncBatchNorm expected input tensor to be on GPU", torch 2.13), so on CPUs (gloo) each
    layer becomes a `GlobalBatchNorm`, whose statistics are all-reduced in two passes (the
    mean, then the squared deviations from it) with the gradient flowing back through both.
    Parameters and buffers keep their names: checkpoints and exports load into the plain model."""
    if device.type != "cpu":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if isinstance(model, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(model, GlobalBatchNorm):
        converted = GlobalBatchNorm(
            model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats
        )
        with torch.no_grad():
            converted.load_state_dict(model.state_dict())
        converted.train(model.training)
        return converted
    for name, child in model.named_children():
        model.add_module(name, sync_batchnorm_layers(child, device))
    return model


class GlobalBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batch of every rank (CPU, gloo); plain BatchNorm outside a process
    group of more than one, in evaluation mode, or without batch statistics."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        synced = self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not synced:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()  # statistics in fp32 under autocast too, as torch's BatchNorm keeps them
        count = _all_reduce(torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64)).to(x.dtype)
        mean = _all_reduce(x.sum(dims)) / count
        centered = x - mean.view(shape)
        var = _all_reduce((centered * centered).sum(dims)) / count
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


class _AllReduceSum(torch.autograd.Function):
    """A sum over ranks whose gradient is the sum of the ranks' gradients (DDP then averages)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    backward = forward  # the incoming gradients, summed over the ranks the same way


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return _AllReduceSum.apply(tensor)
