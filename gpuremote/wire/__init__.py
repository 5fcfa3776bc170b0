"""The wire, shared by both ends: the call table (``calls``), the sans-I/O protocol and
framing, and the shared secret's proofs (``auth``). Imports nothing above it.
"""
