"""The model runtime: loading models (GGUF, HF ids, tiny and random-initialised ones),
the model cache, a sequence's KV cache and rollback (`ModelSession`), batched forward
passes over many sequences, the step scheduler, CPU linears and quantized drafts.

The speculation algorithm (`speculative/`) runs on it; like the algorithm, it never
imports gRPC or a service.
"""
