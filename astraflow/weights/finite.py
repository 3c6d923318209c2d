"""Whether a state's weights are all finite, in one fused reduction per tensor.

A tensor holds a NaN or an infinity iff its float64 sum is not finite: any NaN makes the sum NaN, an infinity
makes it infinite (or NaN beside one of the other sign), and a float64 sum of finite bf16, fp16 or fp32 values
cannot overflow (|sum| <= n * 3.4e38, far below 1.8e308). A float64 tensor is checked value by value (its own
finite values can overflow a sum). The sums are read back once for a state on one device (one sync on a GPU).

A float32 sum is taken first: a NaN or an infinity makes any float sum non-finite, so a finite float32 sum clears its
tensor; only a tensor whose float32 sum is not finite (a NaN, an infinity, or finite values whose sum overflows float32)
is summed again in float64. On a CPU the float32 sums are the faster and the steadier: the recipe's 1.08M-parameter
bf16 image took 0.6-1.1 ms a check, against 0.7-6.8 ms in float64, on one core (BENCHMARKS.md).

A state in one buffer (``delta.to_bf16_state``, as the trainer takes each version's image) is summed whole first: a
finite sum clears every tensor in one call; only a sum that is not finite leads to the sums tensor by tensor.

A state found finite can be passed on as a :class:`FiniteState` (:func:`checked`), so that the next holder does not check
it again: the trainer checks each version's image as it takes it, and the publisher stores that image without a second
check (any other state it is given, it checks).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from astraflow.weights.delta import whole_of


class FiniteState(dict[str, torch.Tensor]):
    """A state :func:`checked` found finite: copies nothing changes any more (the trainer's image of a version)."""


def checked(state: Mapping[str, torch.Tensor]) -> tuple[FiniteState | None, list[str]]:
    """``state`` as a :class:`FiniteState` when every weight is finite, else None and the names of the tensors holding
    a NaN or an infinity."""
    bad = non_finite(state)
    return (None if bad else FiniteState(state)), bad


def non_finite(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity, in the state's order (empty: every weight is finite)."""
    whole = whole_of(list(state.values()))  # a state in one buffer (the trainer's image): one sum clears it
    if (whole is not None and whole.is_floating_point() and whole.element_size() < 8
            and bool(torch.isfinite(whole.sum(dtype=torch.float32)))):
        return []
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
            sums.append(t.sum(dtype=torch.float32))
    if sums:
        on_one_device = len({s.device for s in sums}) == 1
        finite = torch.isfinite(torch.stack(sums if on_one_device else [s.cpu() for s in sums])).tolist()
        for name, ok in zip(summed, finite):
            if not ok and not bool(torch.isfinite(state[name].sum(dtype=torch.float64))):  # not an overflow of float32
                bad.add(name)
    return [name for name in state if name in bad]
