"""Decoding methods.  Each one drives :class:`~forerun.decoder.Decoder`
objects and knows nothing of the engines behind them."""
