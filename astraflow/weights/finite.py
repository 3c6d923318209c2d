"""Whether a state's weights are all finite, in one fused reduction per tensor.

A tensor holds a NaN or an infinity iff its float64 sum is not finite: any NaN makes the sum NaN, an infinity
makes it infinite (or NaN beside one of the other sign), and a float64 sum of finite bf16, fp16 or fp32 values
cannot overflow (|sum| <= n * 3.4e38, far below 1.8e308). A float64 tensor is checked value by value (its own
finite values can overflow a sum). The sums are read back once for a state on one device (one sync on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def non_finite(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity, in the state's order (empty: every weight is finite)."""
    summed: list[str] = []
    sums: list[torch.Tensor] = []
    bad: set[str] = set()
    for name, t in state.items():
        if not t.is_floating_point() or not t.numel():
            continue
        if t.element_size() >= 8:  # its own finite values can overflow a sum: value by value
            if not bool(torch.isfinite(t).all()):
                bad.add(name)
        else:
            summed.append(name)
            sums.append(t.sum(dtype=torch.float64))
    if sums:
        on_one_device = len({s.device for s in sums}) == 1
        finite = torch.isfinite(torch.stack(sums if on_one_device else [s.cpu() for s in sums])).tolist()
        bad.update(name for name, ok in zip(summed, finite) if not ok)
    return [name for name in state if name in bad]
