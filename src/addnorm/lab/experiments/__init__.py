"""Importing this package registers every experiment, in the order the modules are listed."""

import importlib

MODULES: list[str] = [
    "init_time",
    "init_xiong",
    "init_deepnet",
    "init_admin",
    "numerics",
    "training",
    "training_logits",
    "training_norms",
    "training_newer",
    "training_residuals",
    "training_depth",
    "training_norm_choices",
    "training_seeds",
    "training_seeds_faults",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
