"""Importing this package registers every experiment, in the order the modules are listed."""

import importlib

MODULES: list[str] = [
    "init_time",
    "xiong",
    "deepnet",
    "admin",
    "numerics",
    "training",
    "wortsman",
    "training_norms",
    "training_newer",
    "training_residuals",
    "training_depth",
    "olmo2",
    "powernorm",
    "training_seeds",
    "training_seeds_faults",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
