"""Speculative decoding: draft proposers (n-gram, draft model) and the verification
with rejection sampling; recurrent layers roll back by choosing a kept state."""
