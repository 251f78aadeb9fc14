"""The device a node computes on, over the seam that finds it (no GPU here: the
packages installed and nvidia-smi's answer are given)."""

from __future__ import annotations

import subprocess
import sys

from mlxfleet.accelerator import Accelerator, backend, detect, nvidia_gpus
from mlxfleet.manifest import NodeManifest
from mlxfleet.supervisor.fleet import _labels


def test_the_backend_is_read_from_the_installed_packages_without_touching_a_gpu():
    if sys.platform == "darwin":
        assert backend() == "metal"
        return
    assert backend(lambda d: d == "mlx-cuda-13") == "cuda"
    assert backend(lambda d: d == "mlx-cuda-12") == "cuda"
    assert backend(lambda d: d == "mlx-cpu") == "cpu"
    assert backend() == "cpu"  # this machine: mlx[cpu]


def test_an_nvidia_gpu_is_found_by_nvidia_smi_and_its_memory_is_the_budget():
    def smi(args, **kw):
        assert "--query-gpu=name,memory.total" in args
        return subprocess.CompletedProcess(args, 0, "NVIDIA H200, 143771\nNVIDIA H200, 143771\n")

    gpus = nvidia_gpus(smi)
    assert gpus == [("NVIDIA H200", 143771 << 20)] * 2
    dev = detect("cuda", gpus)
    assert dev == Accelerator("cuda", "NVIDIA H200", int((143771 << 20) * 0.9),
                              "90% of NVIDIA H200's memory")
    assert dev.as_dict()["kind"] == "cuda"

    def broken(args, **kw):
        raise OSError("no driver")

    assert nvidia_gpus(broken) == []
    assert detect("cuda", []).memory_bytes is None  # then a share of RAM, as on the CPU
    assert detect("cpu") == Accelerator("cpu", "cpu")


def test_a_node_is_labelled_with_its_accelerator_for_node_selectors():
    node = NodeManifest.model_validate({"apiVersion": "mlxfleet/v1", "kind": "Node",
                                        "metadata": {"name": "gpu1", "labels": {"tier": "x"}},
                                        "spec": {"url": "https://gpu1:8443"}})
    assert _labels(node, "cuda") == {"tier": "x", "accelerator": "cuda"}
    assert _labels(node, None) == {"tier": "x"}
    pinned = node.model_copy(update={"metadata": node.metadata.model_copy(
        update={"labels": {"accelerator": "h100"}})})
    assert _labels(pinned, "cuda") == {"accelerator": "h100"}  # the manifest's wins
