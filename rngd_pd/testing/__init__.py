"""Servers, clients and harnesses shared by tests/ and bench/; never imported by the serving code."""
