"""What one node and the cluster offer: GPU memory and bandwidths, links, host RAM, filesystem.

`hardware:` in a job YAML. `profile` picks a known GPU; any field set explicitly overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check, check_range

# Vendor figures. bandwidths in decimal GB/s (TB/s x 1000), memory in decimal GB as the lecture uses.
# matmul_tflops: dense bf16 peak (no sparsity); a training step reaches timing.mfu of it.
GPU_PROFILES: dict[str, dict[str, float]] = {
    "h20-96g": {"hbm_gb": 96, "hbm_bandwidth_tb_s": 4.0, "pcie_gb_s": 64, "matmul_tflops": 148},
    "h100-80g": {"hbm_gb": 80, "hbm_bandwidth_tb_s": 3.35, "pcie_gb_s": 64, "matmul_tflops": 989},
    "h200-141g": {"hbm_gb": 141, "hbm_bandwidth_tb_s": 4.8, "pcie_gb_s": 64, "matmul_tflops": 989},
    "a100-80g": {"hbm_gb": 80, "hbm_bandwidth_tb_s": 2.04, "pcie_gb_s": 32, "matmul_tflops": 312},
    # The embedded default: CPU worker processes stand in for GPUs; "HBM" is a share of host RAM. Its speed is
    # this machine's, measured (rlslurm/plan/machine.py), not a vendor figure.
    "cpu": {"hbm_gb": 4, "hbm_bandwidth_tb_s": 0.02, "pcie_gb_s": 10, "matmul_tflops": 0.0},
}


@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    profile: str = "cpu"
    """GPU model, one of GPU_PROFILES (h20-96g, h100-80g, h200-141g, a100-80g, cpu)."""
    nodes: int = 2
    """Nodes in the cluster that this job may split between training and rollout. Range [1, 64] (the plan
    tabulates every split, one row per node)."""
    gpus_per_node: int = 2
    """Accelerators per node (on the cpu profile: worker processes per node). Range [1, 64]."""
    hbm_gb: float | None = None
    """Override: memory per GPU in GB; null = the profile's. Range [0.1, 100000]."""
    hbm_bandwidth_tb_s: float | None = None
    """Override: GPU memory bandwidth in TB/s; null = the profile's. Range [0.001, 1000]."""
    pcie_gb_s: float | None = None
    """Override: host<->GPU bandwidth in GB/s (offload); null = the profile's. Range [0.01, 100000]."""
    interconnect_gb_s: float = 25.0
    """Inter-node bandwidth per link in GB/s (RoCE/IB); used by broadcast weight sync. Range [0.01, 100000]."""
    fs_bandwidth_gb_s: float = 1.0
    """Shared filesystem bandwidth in GB/s (NFS); used by disk weight sync and checkpoints. Range [0.001, 100000]."""
    host_ram_gb: float = 2000.0
    """Host RAM per node in GB; bounds offload of training state. Range [0.1, 1e7]."""
    matmul_tflops_override: float | None = None
    """Override: dense bf16 matmul TFLOP/s of one GPU; null = the profile's. Range (0, 100000]."""
    cpu_matmul_gflops: float | None = None
    """cpu profile: fp32 matmul GFLOP/s of one trainer thread; null = measured on this machine
    (rlslurm/plan/machine.py, cached). Range (0, 1000000]."""
    cpu_op_overhead_us: float | None = None
    """cpu profile: microseconds of one small op; null = measured on this machine. Range (0, 1000000]."""
    cpu_copy_gb_s: float | None = None
    """cpu profile: memory copy GB/s of one thread; null = measured on this machine. Range (0, 1000000]."""

    def __post_init__(self):
        check(len(self.profile) <= 64 and self.profile in GPU_PROFILES, "profile",
              f"is not a known GPU profile; known: {', '.join(GPU_PROFILES)}")
        check_range(self.nodes, "nodes", 1, 64)
        check_range(self.gpus_per_node, "gpus_per_node", 1, 64)
        check_range(self.hbm_gb, "hbm_gb", 0.1, 100_000, note="GB")
        check_range(self.hbm_bandwidth_tb_s, "hbm_bandwidth_tb_s", 0.001, 1000, note="TB/s")
        for name in ("pcie_gb_s", "interconnect_gb_s"):
            check_range(getattr(self, name), name, 0.01, 100_000, note="GB/s")
        check_range(self.fs_bandwidth_gb_s, "fs_bandwidth_gb_s", 0.001, 100_000, note="GB/s")
        check_range(self.host_ram_gb, "host_ram_gb", 0.1, 10**7, note="GB")
        check_range(self.matmul_tflops_override, "matmul_tflops_override", 0, 100_000, low_open=True, note="TFLOP/s")
        for name in ("cpu_matmul_gflops", "cpu_op_overhead_us", "cpu_copy_gb_s"):
            check_range(getattr(self, name), name, 0, 10**6, low_open=True)

    def _pick(self, name: str) -> float:
        value = getattr(self, name)
        return float(value if value is not None else GPU_PROFILES[self.profile][name])

    @property
    def gpu_mem_gb(self) -> float:
        return self._pick("hbm_gb")

    @property
    def hbm_tb_s(self) -> float:
        return self._pick("hbm_bandwidth_tb_s")

    @property
    def matmul_tflops(self) -> float:
        return float(self.matmul_tflops_override or GPU_PROFILES[self.profile]["matmul_tflops"])

    @property
    def host_link_gb_s(self) -> float:
        return self._pick("pcie_gb_s")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node
