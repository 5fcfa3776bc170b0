"""What the CLI and the benches use: the demo and the workloads, the overhead model, ``gpuremote
top``, the pool's commands, a proxy in a child process, and the same API run in-process with no
remoting (``direct``, the baseline).
"""
