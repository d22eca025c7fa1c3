"""How close the Triton kernels must come to the torch reference (tests and `gpu_check`).

(atol, rtol) per kind of kernel and dtype. float32 is tight: same math, different summation
order. bfloat16 allows about two units in the last place (2 ** -7 relative each): Triton's
interpreter rounds float32 -> bfloat16 by truncation where torch rounds to nearest, and
attention rounds its softmax probabilities to bfloat16 before the second product, as flash
attention does, where the reference keeps them in float32. float16 allows the same number of
units in its last place (2 ** -10 relative each) as bfloat16 does in its.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("elementwise", torch.float32): (1e-5, 1e-5),
    ("elementwise", torch.bfloat16): (1.6e-2, 1.6e-2),
    ("attention", torch.float32): (1e-5, 1e-5),
    ("attention", torch.bfloat16): (3e-2, 2e-2),
    ("elementwise", torch.float16): (2e-3, 2e-3),
    ("attention", torch.float16): (4e-3, 2.5e-3),
}
