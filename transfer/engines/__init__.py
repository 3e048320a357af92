"""Engine adapters: an inference engine's own plug-in point mapped onto `WeightReceiver`.

One package per engine, holding both halves: `vllm/` (`trainer`, which imports no vLLM, and
`worker`, which vLLM's plug-in loader imports). Importing this package imports no engine.
"""
