"""The machinery that produces this repository's committed evidence, beside the package, not in it.

The installed ``qsdp`` holds what a user runs against their own model or cluster (``qsdp bench
volume | memory | cluster | faults | simulate | kernels | codecs | codec-share | phases``, ``qsdp
advise --measure``, ``qsdp check``). What only proves this project's claims lives here and runs
from a clone of the repository, its root as the working directory::

    python -m benchmarks.convergence --setting tiny   # paired-seed loss gaps with intervals
    python -m benchmarks.soak --minutes 30            # memory and step time over a long run
    python -m benchmarks.gpu_report --dry-run --next  # the GPU report's stages (make gpu-report)

Their results go to ``benchmarks/results/``; docs/design.md states where the line runs.
"""
