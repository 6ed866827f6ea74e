"""The device side: the runner (the only place that builds device arrays and calls
the jitted step), the step functions, parameter packing and host-to-device packing,
result buffers, ahead-of-time compilation and the on-disk executable store."""
