"""The rollout role (RaaS): nodes that play tasks and publish trajectories, and the evaluator.

- ``node.py``: the rollout worker (``astraflow worker rollout``);
- ``evaluator.py``: held-out evaluation (``astraflow worker evaluator``);
- ``engines/``: how tokens are generated (hf, sglang, vllm, scripted, plug-ins);
- ``workflows/``: what an episode is (single turn, tools, environments, several policies, agent code);
- ``rewards/``: how an answer is scored (verifiers, the code sandbox);
- ``envs/``: bundled text environments served over HTTP.
"""
