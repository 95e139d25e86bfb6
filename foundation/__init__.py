"""The base layer under both the model runtime and the algorithm: errors typed by gRPC
status, the token sequence and its absolute rollback, the limits of a request, a
worker's load snapshot, what a forward pass costs and its one fit, progress lines of
long steps (a model converted or loaded). It imports neither of them
(tests/test_layout.py)."""
