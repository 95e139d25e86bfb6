"""The draft worker: a gRPC server around a drafter (a small model or n-gram lookup)
that runs the speculation loop against a remote target worker, one Verify round trip
per round, and streams the committed tokens back to its caller."""
