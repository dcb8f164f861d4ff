"""The Triton kernel of training/optim/adamw_bf16.py: one AdamW step of one flat parameter, every element read and written once.

Imported on first use, so that TRITON_INTERPRET (the CPU interpreter, for tests) is read after it is set.
"""

import triton
import triton.language as tl


@triton.jit
def adamw_step(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, step_ptr, lr_ptr, scale_ptr, n,
               beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
               HAS_COPY: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # Per program, not per element: the bias corrections from the (already incremented) step count.
    step = tl.load(step_ptr)
    lr = tl.load(lr_ptr)
    step_size = lr / (1 - tl.exp2(step * log2_beta1))
    bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(step * log2_beta2))
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
    # torch's lerp(m, g, 1 - beta1): from the nearer end, so that beta1 = 0 gives g exactly
    m = tl.where(beta1 > 0.5, m + (1 - beta1) * (g - m), g - beta1 * (g - m))
    v = v * beta2 + (1 - beta2) * g * g
    p = tl.load(param_ptr + offs, mask=mask)
    p = p * (1 - lr * weight_decay) - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)
