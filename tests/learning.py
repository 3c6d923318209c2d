"""What "the policy learned" means in a test: held-out evaluations after v0, averaged, beat v0.

One greedy evaluation of 100 held-out prompts moves by about 0.05 with the prompts' luck, so a single
final evaluation against v0 fails now and then on a run that did learn. The mean of every evaluation
after v0 is steadier, and a run that did not learn still fails it.
"""

from __future__ import annotations

from typing import Any


def held_out_rose(summary: dict[str, Any], by: float) -> bool:
    later = [r for v, r in summary["held_out_reward"].items() if int(v) > 0]
    return bool(later) and sum(later) / len(later) > summary["initial_reward"] + by
