"""torch's and Inductor's functions: the emulated view of the device torch reports, and the seams of torch.compile's
kernels (their load, launch, autotuning, FlexAttention's configs and the compile cache's key), read against each torch
release."""
