"""The impure edge: saved-tensor hooks, host buffers, spill files, CUDA streams."""

from lms.runtime.session import Session, no_offload, no_offload_in
from lms.runtime.stats import LMSStats

__all__ = ["LMSStats", "Session", "no_offload", "no_offload_in"]
