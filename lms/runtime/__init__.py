"""The impure edge: saved-tensor hooks, host buffers, spill files, CUDA streams."""

from lms.runtime.session import LMS, no_offload, no_offload_in
from lms.runtime.stats import LMSStats

__all__ = ["LMS", "LMSStats", "no_offload", "no_offload_in"]
