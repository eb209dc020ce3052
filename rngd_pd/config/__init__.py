"""Settings: the one parser, the model parameters, the registry of environment variables, the dtype table."""
