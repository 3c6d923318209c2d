"""Workflows: what an episode is, from the tasks a node pulled to the trajectories it publishes.

``base`` holds the contract (``Workflow``, ``PolicyHandle``, ``Episode``); ``registry`` builds the
workflow a recipe names; ``options`` holds the option model of each built-in workflow (light:
validated at recipe load). Built in: ``single_turn``; ``multi_turn_tools`` (``tools``, with the
``bm25`` tool in ``retrieval``); ``env_http`` (``env``); ``solver_verifier``, ``solver_selector``,
``solver_testgen`` (``multi_policy``); ``openai_agent`` (``openai_agent``). Nothing is imported
here, so validating a recipe loads no workflow.
"""
