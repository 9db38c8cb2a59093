"""Tests across the hosts of the network-namespace test bed (root only)."""
