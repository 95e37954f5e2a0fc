"""How many times the device check compiled each Triton attention kernel, and whether any configuration of it
(its declared constexprs: head dim, tiles, split, window...) was compiled more than once.

Triton compiles a kernel again for each new specialisation of its integer arguments (1, a multiple of 16, anything
else). A configuration compiled more than once is a compile some step paid for while serving because a value such as
a table width changed; triton_attention keeps the per-step ones out of the specialisation, and
loadtest/kernel_compile_check.py counts it without a GPU. This reads what really happened on the GPU, from each
kernel's own caches (filled by the JIT on the device: the interpreter has none).
"""

from __future__ import annotations

from collections import Counter

from flotilla.engine.model import triton_attention


def kernel_compiles(kernel) -> dict:
    """{compiles, configurations, most_compiles_of_one_configuration} for one JIT kernel."""
    configurations: Counter = Counter()
    for caches in kernel.device_caches.values():
        key_cache = caches[1]  # (specialisation, options) -> cache key, one entry per compile
        for specialization, _options in key_cache:
            declared = tuple(value for param, value in zip(kernel.params, specialization) if param.is_constexpr)
            configurations[declared] += 1
    return {
        "compiles": sum(configurations.values()),
        "configurations": len(configurations),
        "most_compiles_of_one_configuration": max(configurations.values(), default=0),
    }


def triton_compiles() -> dict:
    """Per kernel, kernel_compiles; read after every part, so a Triton whose caches are laid out otherwise gives an
    error here rather than costing the report its last line."""
    kernels = (triton_attention._paged_attention_kernel, triton_attention._combine_splits_kernel)
    if not all(hasattr(kernel, "device_caches") for kernel in kernels):
        return {"skipped": "Triton's interpreter compiles nothing"}
    counts = {}
    for kernel in kernels:
        try:
            counts[kernel.fn.__name__] = kernel_compiles(kernel)
        except Exception as error:  # noqa: BLE001 - a figure of the report, not a reason to lose it
            counts[kernel.fn.__name__] = {"error": f"{type(error).__name__}: {error}"}
    return counts
