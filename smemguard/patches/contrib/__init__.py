"""Library packs: a library's Triton kernels (vLLM, SGLang, LMDeploy, FlagGems, DeepGEMM) described to the engine,
each applied only where the kernels have what its safety argument (its docstring) reads, wherever a release keeps
them (:class:`smemguard.patches.Kernels`)."""
