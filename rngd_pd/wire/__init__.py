"""What crosses Triton between stubs and clients: tensor names, request inputs, the gRPC codec, status."""
