"""What a run records about its machine (lab/machine.py) and how the results page shows it."""

from __future__ import annotations

import platform

import torch

from addnorm.lab.docs import render_results_doc
from addnorm.lab.machine import cpu_model, run_meta
from addnorm.lab.runner import RunOptions
from tests.lab.test_lab_report import doc

# two processors of a VM that names only the vendor's family: the first block is the one read
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: Other
stepping\t: 0
"""


def test_cpu_model_names_family_model_and_stepping_of_the_first_processor():
    assert cpu_model(CPUINFO) == "AMD EPYC (family 25, model 17, stepping 1)"


def test_cpu_model_without_ids_is_the_name_alone():
    assert cpu_model("Hardware\t: BCM2835\n") == "BCM2835"  # an ARM board's cpuinfo
    assert cpu_model("processor\t: 0\nmodel name\t: Apple M2\n") == "Apple M2"


def test_cpu_model_without_cpuinfo_falls_back_to_platform():
    assert cpu_model("") == (platform.processor() or platform.machine() or "unknown")
    assert cpu_model("flags\t: sse avx2\n") == cpu_model("")  # no name line: the ids alone are not a name


def test_run_meta_records_the_cpu_and_the_kernels_torch_dispatches_to(tmp_path):
    meta = run_meta(RunOptions(out=tmp_path), torch.device("cpu"), jobs=2)
    assert meta["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert meta["cpu"] == cpu_model()
    assert meta["jobs"] == 2 and meta["torch_threads"] == torch.get_num_threads()


def test_results_page_shows_the_kernels_when_recorded():
    assert "Test CPU 9000, 2 cores, PyTorch's CPU kernels AVX2;" in render_results_doc(doc(cpu_kernels="AVX2"))
    assert "Test CPU 9000, 2 cores;" in render_results_doc(doc())  # records made before it was recorded
