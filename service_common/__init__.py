"""What the three gRPC services share: status mapping, server construction with health
and reflection, proto <-> core conversion, configuration, logs. Imports the core and the
generated stubs; imports no service."""
