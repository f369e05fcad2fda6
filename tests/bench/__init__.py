"""Benchmark harness: the service against pgbench on the same PostgreSQL (see README.md)."""
