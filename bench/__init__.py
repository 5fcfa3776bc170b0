"""Benchmarks of gpuremote against bare baselines measured in the same run.

``gpuremote bench ping | throughput | api``. Each bench returns raw samples; statistics live
in ``stats`` and rendering in ``render``.
"""
