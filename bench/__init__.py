"""Benchmarks of gpuremote against bare baselines measured in the same run.

``gpuremote bench ping | throughput | load | fuzz | requirements | emu | ops | tenants | flood |
peer | failover | api`` (``cli``: one table of them). Each bench returns raw samples or its
figures; statistics live in ``stats``, and what the benches show (live views and summaries)
in ``render``.
"""
