"""``python -m gpuremote``: the ``gpuremote`` command."""

from gpuremote.cli import main

if __name__ == "__main__":  # (imported, as documentation tools do, it runs nothing)
    raise SystemExit(main())
