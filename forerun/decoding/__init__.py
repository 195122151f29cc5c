"""Decoding methods.  Each one drives :class:`~forerun.protocol.decoder.Decoder`
objects and knows nothing of the engines behind them."""
