"""Tests across OS processes on one machine (spawned ranks, loopback providers)."""
