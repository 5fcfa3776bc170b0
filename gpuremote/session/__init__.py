"""Sessions with a proxy: the pipeline of one connection (``pipeline``), opening sessions by URL
(``connection``), and sessions that survive the loss of their proxy (``failover``).
"""
