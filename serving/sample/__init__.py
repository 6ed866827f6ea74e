"""Sampling: `SamplingParams`, the on-device sampler (temperature, top-k/p, min-p,
seeds, logprobs), repetition/presence/frequency penalties, and the per-slot rows of
sampling parameters that the engine keeps on device."""
