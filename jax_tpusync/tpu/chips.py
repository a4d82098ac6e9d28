"""What a plan needs to know of each TPU generation: the host link it brings a host pool's
KV over (published host-to-device rates per chip, for projecting a step's time from the
bytes it copies: a projection, not a measurement) and the device memory of a chip
(published, for saying what a whole-KV-resident step would need against what there is).
"""

from __future__ import annotations

import dataclasses

__all__ = ["HBM_BYTES_PER_CHIP", "HOST_LINKS", "HostLink", "hbm_bytes_per_device", "host_link"]


@dataclasses.dataclass(frozen=True)
class HostLink:
    """A generation's host-to-device rate per chip, in GB/s (1e9 bytes a second), and
    where the figure comes from."""

    gbps: float
    source: str


# By device kind (most specific prefix first). Sources, restated:
# - TPU v5e ("TPU v5 lite"): TPU Sync (the host-to-device library for TPUs) measured about
#   13 GB/s per chip copying host memory to the device on a v5e host.
# - TPU v6e ("TPU v6 lite"): the JAX scaling book ("How to Scale Your Model", its chapter on
#   TPUs) works its v6e examples with a PCIe link of 1.5e10 bytes a second per chip.
# - TPU7x (Ironwood): TPU Sync's published 190 GB/s of contiguous host-to-device copies
#   on an 8-chip Ironwood host, 23.75 GB/s a chip.
# - TPU v4 and v5p: no figure of their own found; they take the scaling book's PCIe figure
#   (15 GB/s a chip), as any other TPU does.
HOST_LINKS: tuple[tuple[str, HostLink], ...] = (
    ("TPU v5 lite", HostLink(13.0, "TPU Sync's host-to-device measurement on v5e")),
    ("TPU v6 lite", HostLink(15.0, "the JAX scaling book's PCIe figure for v6e")),
    ("TPU7x", HostLink(190 / 8, "TPU Sync's 190 GB/s per 8-chip Ironwood host")),
)
FALLBACK_LINK = HostLink(
    15.0, "no published figure for this generation: the JAX scaling book's PCIe figure"
)


def host_link(device_kind: str) -> HostLink:
    """The host link of a chip of ``device_kind`` (``jax.Device.device_kind``): its
    generation's published figure, or :data:`FALLBACK_LINK` (TPU v4, v5p, others)."""
    for prefix, link in HOST_LINKS:
        if device_kind.startswith(prefix):
            return link
    return FALLBACK_LINK


# Device memory (HBM) of one chip, by device kind, as Google publishes it: TPU v4 32 GiB,
# v5e 16 GiB, v5p 95 GiB, v6e 32 GiB, Ironwood (TPU7x) 192 GiB.
HBM_BYTES_PER_CHIP: tuple[tuple[str, int], ...] = (
    ("TPU v5 lite", 16 << 30),
    ("TPU v6 lite", 32 << 30),
    ("TPU v5", 95 << 30),
    ("TPU v4", 32 << 30),
    ("TPU7x", 192 << 30),
)


def hbm_bytes_per_device(device_kind: str, devices_per_chip: int = 1) -> int | None:
    """Device memory of one JAX device of ``device_kind``: its chip's, shared by the
    ``devices_per_chip`` devices a chip shows (TPU v4 and TPU7x topologies list two a
    chip); None for a kind not in :data:`HBM_BYTES_PER_CHIP`."""
    for prefix, size in HBM_BYTES_PER_CHIP:
        if device_kind.startswith(prefix):
            return size // max(1, devices_per_chip)
    return None
