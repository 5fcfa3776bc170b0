"""The client core under both front ends (``gpuremote.client``, ``gpuremote.xp``): arrays, their
buffers and the calls they make (``arrays``), steps captured once and replayed (``capture``,
``recording``). Builds calls; never waits.
"""
