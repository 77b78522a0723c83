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
    "rezero",
    "mix_ln",
    "layernorm_scaling",
    "branch_scaling",
    "training_norm_choices",
    "training_seeds",
    "divergence",
    "fp16_stats",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
