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
    "rezero",
    "mix_ln",
    "layernorm_scaling",
    "branch_scaling",
    "olmo2",
    "powernorm",
    "training_seeds",
    "divergence",
    "fp16_stats",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
