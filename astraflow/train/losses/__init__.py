"""Policy losses: the maths (``functional``), the option model of each built-in loss (``options``:
light, validated at recipe load) and the registry the trainer dispatches through (``registry``).
Nothing is imported here, so validating a recipe loads no torch.
"""
