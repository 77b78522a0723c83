"""The stability lab: experiments that reproduce the seeds' and papers' claims on a CPU, with honest verdicts."""

from addnorm.lab.core import EXPERIMENTS, Context, Experiment, Result, experiment, verdict_from

__all__ = ["EXPERIMENTS", "Context", "Experiment", "Result", "experiment", "verdict_from"]
