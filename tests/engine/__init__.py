"""Tests of one engine in one process: transfers, domains, the package."""
