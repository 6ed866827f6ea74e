"""The engine core's host bookkeeping: requests (sequences), the scheduler and its
per-step `Schedule`, decode blocks, page and slot pools, block tables and the prefix
cache. Plain Python over ints and numpy: nothing here imports JAX, builds a device
array or knows of an entry point."""
