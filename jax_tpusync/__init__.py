"""jax_tpusync: stream a KV cache through host DRAM and storage tiers inside jitted decode."""

from jax_tpusync._tpusync import TpusyncError
from jax_tpusync.engine import Engine, TierInfo

__all__ = ["Engine", "TierInfo", "TpusyncError"]
__version__ = "0.1.0"
