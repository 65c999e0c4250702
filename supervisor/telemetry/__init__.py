"""What operators see: log events, the console, Prometheus metrics and their bounded endpoint."""
