"""The training losses of hf_variants' models: label-smoothed cross-entropy computed a chunk of rows at a time,
with its gradient in the same pass (`smoothed_cross_entropy`), and the same loss straight from the hidden states and
the output projection, without the logits (`projected_smoothed_cross_entropy`). Used by
`TransformerNmtForConditionalGeneration` (its forward; `skip_logits=True` without the logits) and the training code."""

from __future__ import annotations

import torch
from torch.nn import functional as F

LOSS_CHUNK_ELEMENTS = 1 << 23  # logits per chunk of the loss (32 MB in float32)


def _smoothed_rows(
    z: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, smoothing: float, work: torch.Tensor
) -> torch.Tensor:
    """sum_i weights_i * (label-smoothed cross-entropy of row i of the logits `z` [n, V]); `work` ([n, V], z's
    dtype, or z itself) ends up holding the gradient with respect to z:
    weights_i * (softmax(z_i) - (1 - smoothing) * onehot(y_i) - smoothing / V).
    Every [n, V] step happens in `work`, so a chunk needs no other tensor of its size (torch.logsumexp would
    allocate two)."""
    vocab = z.shape[-1]
    target = labels.clamp(min=0)[:, None]  # ignored rows have weight 0
    shifted = torch.sub(z, z.amax(dim=-1, keepdim=True), out=work)  # z - max: exp cannot overflow
    # -log p(y) = lse - z_y and the smoothing term -mean_v log p(v) = lse - mean_v z_v (as F.cross_entropy); the
    # shift cancels out of both
    shifted_target = shifted.gather(1, target).squeeze(1)
    shifted_mean = shifted.mean(dim=-1)
    sum_exp = shifted.exp_().sum(dim=-1)
    row_loss = sum_exp.log() - (1.0 - smoothing) * shifted_target - smoothing * shifted_mean
    total = torch.where(weights != 0, row_loss * weights, 0.0).sum()
    work.div_(sum_exp[:, None]).sub_(smoothing / vocab).mul_(weights[:, None])
    work.scatter_add_(1, target, (-(1.0 - smoothing) * weights)[:, None])
    return total


PROJECTED_CHUNK_ROWS = 512  # at most this many hidden states a chunk of projected_smoothed_cross_entropy


def _chunk_rows(vocab: int) -> int:
    return max(1, LOSS_CHUNK_ELEMENTS // vocab)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """sum_i w_i * (label-smoothed cross-entropy of row i), gradient included: see `smoothed_cross_entropy`."""

    @staticmethod
    def forward(ctx, logits, labels, weights, smoothing: float):
        rows, vocab = logits.shape
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        compute = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 logits' own
        total = torch.zeros((), dtype=compute, device=logits.device)
        step = _chunk_rows(vocab)
        for start in range(0, rows, step):
            rows_ = slice(start, start + step)
            z = logits[rows_].to(compute)  # a view, or a float32 copy of low-precision logits' chunk
            if grad is not None and grad.dtype == compute:
                work = grad[rows_]
            else:  # the float32 copy of low-precision logits is ours to overwrite; a view of the caller's is not
                work = z if logits.dtype != compute else torch.empty_like(z)
            total += _smoothed_rows(z, labels[rows_], weights[rows_], smoothing, work)
            if grad is not None and grad.dtype != compute:
                grad[rows_].copy_(work)
            del z, work  # before the next chunk's are allocated
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        return total

    @staticmethod
    def backward(ctx, grad_output):
        _once(ctx)
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None


def _once(ctx) -> None:
    if ctx.backward_done:  # the gradient buffers were scaled in place by the first backward
        raise RuntimeError(
            "smoothed_cross_entropy: a second backward through the same graph (retain_graph) is "
            "not supported; compute the loss again."
        )
    ctx.backward_done = True


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """`_SmoothedCrossEntropy` of `F.linear(hidden, weight, bias)`, one chunk of rows at a time: see
    `projected_smoothed_cross_entropy`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, smoothing: float):
        rows, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device.type
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        # the products in autocast's dtype when it is on (as the output projection's F.linear would run), the
        # loss in float32 (float64 inputs: float64); weight and bias gradients accumulate in float32 or wider
        gemm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        compute = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(device, enabled=False):
            w = weight.to(gemm)
            b = None if bias is None else bias.to(gemm)
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = (
                torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)
                if need_weight
                else None
            )
            grad_bias = (
                torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, torch.float32), device=bias.device)
                if need_bias
                else None
            )
            any_grad = need_hidden or need_weight or need_bias
            total = torch.zeros((), dtype=compute, device=hidden.device)
            # 512 rows: as fast as larger chunks (the weight gradient's update per chunk costs [V, d] of memory
            # traffic; fewer rows make it dominate), and a 16 MB chunk at V = 8000 (benchmarks/loss_memory.py)
            step = min(PROJECTED_CHUNK_ROWS, _chunk_rows(vocab))
            for start in range(0, rows, step):
                rows_ = slice(start, start + step)
                h = hidden[rows_].to(gemm)
                z = F.linear(h, w, b).to(compute)  # this chunk's logits (the only [rows, V] tensor alive)
                total += _smoothed_rows(z, labels[rows_], weights[rows_], smoothing, z)  # z becomes the gradient
                if not any_grad:
                    del z  # before the next chunk's is allocated: one chunk alive at a time
                    continue
                g = z.to(gemm)  # d loss / d logits of the chunk
                del z
                if need_hidden:
                    grad_hidden[rows_] = g @ w
                if need_weight:
                    if grad_weight.dtype == gemm:
                        grad_weight.addmm_(g.t(), h)
                    else:
                        grad_weight += g.t() @ h
                if need_bias:
                    grad_bias += g.sum(0, dtype=grad_bias.dtype)
                del g
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.backward_done = False
        return total

    @staticmethod
    def backward(ctx, grad_output):
        _once(ctx)
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, (None, *ctx.dtypes)):
            if grad is not None:
                grad = grad.mul_(grad_output.to(grad.dtype))
                grad = grad if dtype is None else grad.to(dtype)
            grads.append(grad)
        return (*grads, None, None, None)


def _loss_weights(labels: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token weights of the flat labels: 1 / (labelled tokens) for the token mean, or `weights`, and 0 on
    ignored (-100) tokens."""
    labelled = labels != -100
    if weights is None:
        return labelled.float() / labelled.sum().clamp(min=1)
    return torch.where(labelled, weights.reshape(-1).float(), 0.0)


def smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Label-smoothed cross-entropy of `logits` [..., V] against `labels` [...] (-100: ignored), as
    `F.cross_entropy(logits.float(), labels, label_smoothing=smoothing)`, with a fraction of its memory:
    `weights` None gives the mean over the labelled tokens (0 when there is none); `weights` [...] (float) gives
    sum_i weights_i * loss_i over the labelled tokens.

    Memory: the rows are processed in chunks of `LOSS_CHUNK_ELEMENTS` logits, in float32 (float64 logits: in
    float64), and the gradient with respect to the logits is computed in the same pass, into ONE buffer of the
    logits' shape and dtype that the backward scales in place. F.cross_entropy keeps the log-probabilities for the
    backward and allocates two more [N, V] tensors there (and a float32 copy of low-precision logits first): for a
    2048-token batch and an 8000-word vocabulary, 62.5 MiB a tensor, the peak of the loss goes from ~4 to ~1 of
    them (`benchmarks/loss_memory.py`). One backward per forward (retain_graph raises). Without the logits,
    `projected_smoothed_cross_entropy` needs none of them."""
    flat_labels = labels.reshape(-1)
    return _SmoothedCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), flat_labels, _loss_weights(flat_labels, weights), float(smoothing)
    )


def projected_smoothed_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    smoothing: float = 0.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`smoothed_cross_entropy(F.linear(hidden_states, weight, bias), labels, smoothing, weights)` without the
    logits: `hidden_states` [..., d] are projected onto the vocabulary (`weight` [V, d]) `PROJECTED_CHUNK_ROWS`
    rows (at most `LOSS_CHUNK_ELEMENTS` logits) at a time, and each chunk's gradients (hidden states, weight, bias)
    are computed in the same pass. The training step never holds a [tokens, V] tensor: beside one chunk, it holds
    gradient buffers of the hidden states' and the projection's sizes (4096 tokens, a 32k vocabulary, d = 512:
    211 MB at the peak where F.linear + F.cross_entropy take 1517 MB, `benchmarks/loss_memory.py`). Under autocast
    the products run in its dtype, as `F.linear` would; the loss in float32.
    One backward per forward (retain_graph raises)."""
    flat_labels = labels.reshape(-1)
    return _ProjectedSmoothedCrossEntropy.apply(
        hidden_states.reshape(-1, hidden_states.shape[-1]),
        weight,
        bias,
        flat_labels,
        _loss_weights(flat_labels, weights),
        float(smoothing),
    )


__all__ = ["smoothed_cross_entropy", "projected_smoothed_cross_entropy", "LOSS_CHUNK_ELEMENTS", "PROJECTED_CHUNK_ROWS"]
