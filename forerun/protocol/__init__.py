"""The engine protocol: what decoding asks of an engine (:class:`Decoder`), the KV
cache contract, and what engines share."""
