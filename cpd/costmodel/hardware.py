"""Hardware catalog for the roofline cost model (used by the routing policy and the simulator).

All figures are **per GPU**, dense (no structured sparsity), in SI units
(FLOP/s, bytes, bytes/s). Each entry names the public source of its numbers.
Vendors quote sparse Tensor Core peaks; the dense value is half of it.

Sources:
    * B200: NVIDIA HGX platform page and DGX B200 datasheet
      (https://www.nvidia.com/en-us/data-center/hgx/,
      https://www.nvidia.com/en-us/data-center/dgx-b200/): HGX B200 8-GPU board
      = 72 PFLOPS FP8 and 36 PFLOPS FP16/BF16 (sparse), 1.44 TB HBM3e, 64 TB/s
      HBM bandwidth, fifth-generation NVLink 1.8 TB/s per GPU; DGX B200 has 8x
      ConnectX-7 400 Gb/s compute NICs and PCIe Gen5 host links.
    * H200: NVIDIA H200 Tensor Core GPU datasheet
      (https://www.nvidia.com/en-us/data-center/h200/): SXM, FP8 3,958 TFLOPS and
      BF16 1,979 TFLOPS (sparse), 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s,
      PCIe Gen5 128 GB/s (both directions).
    * H100: NVIDIA H100 Tensor Core GPU datasheet
      (https://www.nvidia.com/en-us/data-center/h100/): SXM, FP8 3,958 TFLOPS and
      BF16 1,979 TFLOPS (sparse), 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s, PCIe
      Gen5 128 GB/s (both directions); DGX H100 has 8x ConnectX-7 400 Gb/s NICs.
    * PCIe Gen5 x16: 32 GT/s x 16 lanes ~= 64 GB/s per direction (PCI-SIG).
    * ConnectX-7: 400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7 product brief).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """One accelerator.

    Attributes:
        name: catalog key.
        bf16_flops: dense BF16 Tensor Core peak, FLOP/s.
        fp8_flops: dense FP8 Tensor Core peak, FLOP/s.
        hbm_bytes: device memory, bytes.
        hbm_bytes_per_s: device memory bandwidth, bytes/s.
        nvlink_bytes_per_s: NVLink bandwidth per GPU (all links, both directions), bytes/s.
        pcie_bytes_per_s: host<->device PCIe bandwidth per direction, bytes/s.
        nic_bytes_per_s: scale-out NIC bandwidth per GPU, bytes/s.
        source: where the numbers come from.
    """

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    nic_bytes_per_s: float
    source: str


_PCIE5 = 64e9
_CX7 = 50e9

CATALOG: dict[str, GPU] = {
    "B200": GPU("B200", bf16_flops=2.25e15, fp8_flops=4.5e15, hbm_bytes=180e9, hbm_bytes_per_s=8.0e12,
                nvlink_bytes_per_s=1.8e12, pcie_bytes_per_s=_PCIE5, nic_bytes_per_s=_CX7,
                source="NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals / 8, sparse peaks / 2)"),
    "H200": GPU("H200", bf16_flops=0.9895e15, fp8_flops=1.979e15, hbm_bytes=141e9, hbm_bytes_per_s=4.8e12,
                nvlink_bytes_per_s=0.9e12, pcie_bytes_per_s=_PCIE5, nic_bytes_per_s=_CX7,
                source="NVIDIA H200 Tensor Core GPU datasheet (SXM; sparse peaks / 2)"),
    "H100": GPU("H100", bf16_flops=0.9895e15, fp8_flops=1.979e15, hbm_bytes=80e9, hbm_bytes_per_s=3.35e12,
                nvlink_bytes_per_s=0.9e12, pcie_bytes_per_s=_PCIE5, nic_bytes_per_s=_CX7,
                source="NVIDIA H100 Tensor Core GPU datasheet (SXM; sparse peaks / 2)"),
}


def get_gpu(name: str) -> GPU:
    """Catalog entry by name (``B200``, ``H200``, ``H100``; case-insensitive).

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    try:
        return CATALOG[name.upper()]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(CATALOG)}") from None
