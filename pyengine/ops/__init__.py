"""Device-agnostic wrappers over the native kernels (pyengine._C on CPU, pyengine._cuda on GPU).

Each wrapper validates its arguments (dtype, device, shape, layout) and raises a clear
TypeError/ValueError before any pointer reaches native code.
"""
from pyengine.ops.attention import paged_attention
from pyengine.ops.cache import reshape_and_cache
from pyengine.ops.layers import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from pyengine.ops.sampling import SampleResult, apply_penalties, sample

__all__ = [
    "SampleResult",
    "add_rms_norm",
    "apply_penalties",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "sample",
    "silu_and_mul",
]
