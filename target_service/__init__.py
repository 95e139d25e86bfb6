"""The target worker: a gRPC server (`specdec.v1.TargetService`) around the target model.

It holds one `speculative.target.TargetSession` (token ids + KV cache) per session under
a memory budget, verifies draft proposals in one forward pass each, and is the authority
on committed tokens. Imports the core, `service_common` and the generated stubs; never
the draft service or the orchestrator.
"""
