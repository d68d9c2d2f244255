"""Generated gRPC code for protos/psgd/v1/parameter_server.proto. Do not edit: `make proto`."""
