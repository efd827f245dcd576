"""Reading kernels and their launches: a kernel's ``.fn`` chain and names, the tuners and entry layers smemguard
understands, what users register, a kernel's source and the calls it makes, what each constexpr parameter does, a
failed launch resolved, compiled and checked, the autotune pruner and the shared-memory estimate. Imports only
``facts``."""
