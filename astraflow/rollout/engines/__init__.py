"""Engines: how a rollout node generates tokens (the ``Engine`` contract in ``base``).

``registry`` builds the one ``rollout.engine`` names; ``options`` holds the option model of each
built-in engine (light: validated at recipe load); ``hf``, ``scripted``, ``sglang``, ``vllm`` (over
``remote``) are the engines; ``testing`` is a scripted-text test double. Nothing is imported here,
so validating a recipe loads no engine.
"""
