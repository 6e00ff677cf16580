"""The service: owns the comm and reduce threads, the configuration and the client calls."""
