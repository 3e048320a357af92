"""Engine adapters: an inference engine's own plug-in point mapped onto `WeightReceiver`.

One module per engine. `vllm` needs vLLM installed and is imported only by vLLM's plug-in loader
(or explicitly); `vllm_protocol` is the vLLM-free trainer side of the same protocol. Importing
this package imports neither.
"""
